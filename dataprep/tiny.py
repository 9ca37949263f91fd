"""Tiny fixtures: a small random Qwen3, a byte-level BPE tokenizer trained here, and an RL dataset.

``build_tiny(out_dir, seed)`` writes, deterministically from the seed:
- ``model/``: Qwen3 (hidden 64, 2 layers, head_dim 32, fp32, tied embeddings, initializer_range 0.2,
  which a tiny model needs to be trainable at all) with a tokenizer that has Qwen-style chat tokens,
  the marker character and its neighbour tokens;
- ``rl.parquet`` + ``rl.parquet.nla_meta.yaml`` in the official NLA format, ``topics.json``
  (each row's topic, for tests), ``corpus.jsonl`` (the documents, for ``nla-grpo data extract``) and
  ``subject/`` (the model with a quieter block 0: the tiny pipeline's subject, ``_write_subject``). Documents are generated from four topics and run through the model;
  each topic's direction is extracted from its documents' residual stream after block
  ``layer_index``, and a row's activation is its topic's direction plus noise. A single random tiny
  model's per-token residuals are dominated by context and barely cluster; this keeps the extraction
  real while giving a task a tiny verbaliser can learn (predict-the-topic reaches FVE ~0.9).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from nla_grpo.shared.fileio import write_json

MARKER = "※"
CONCEPT_OPEN, CONCEPT_CLOSE = "<concept>", "</concept>"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PLAIN_ADDED_TOKENS = [MARKER, CONCEPT_OPEN, CONCEPT_CLOSE, "<explanation>", "</explanation>", "<think>", "</think>"]
AV_TEMPLATE = "Describe the concept " + CONCEPT_OPEN + "{injection_char}" + CONCEPT_CLOSE + " in a few words."
AR_TEMPLATE = "Explanation: {explanation}\nReconstruct the concept."
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
TOPICS = {
    "ocean": "sea wave salt ship tide fish coral harbor sailor storm",
    "forest": "tree leaf moss wolf pine branch root owl trail fern",
    "city": "street tower bus crowd market bridge light traffic shop noise",
    "kitchen": "bread oven salt knife soup pan spice butter table fork",
}
FILLER = "the a of and with near under over some every quiet bright old new".split()

HIDDEN, LAYERS, HEADS, HEAD_DIM, FFN = 64, 2, 2, 32, 128
LAYER_INDEX = 0
ROWS_PER_DOC = 2


def _documents(rng: np.random.Generator, n_docs: int) -> list[tuple[str, str, list[str]]]:
    """(doc_id, topic, words): each document draws mostly from its topic's words."""
    names = sorted(TOPICS)
    docs = []
    for i in range(n_docs):
        topic = names[i % len(names)]
        vocab = TOPICS[topic].split()
        n = int(rng.integers(24, 48))
        words = [str(rng.choice(vocab)) if rng.random() < 0.8 else str(rng.choice(FILLER)) for _ in range(n)]
        docs.append((f"doc-{i:05d}", topic, words))
    return docs


def _corpus(rng: np.random.Generator) -> list[str]:
    lines = []
    for _ in range(400):
        topic = TOPICS[str(rng.choice(sorted(TOPICS)))].split()
        lines.append(" ".join(str(rng.choice(topic + FILLER)) for _ in range(12)))
    lines += sorted(TOPICS) * 20
    lines += [AV_TEMPLATE.replace("{injection_char}", MARKER), AR_TEMPLATE, "user assistant system explanation"] * 20
    return lines


def build_tokenizer(rng: np.random.Generator, vocab_size: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(rng), trainer=trainer)
    from tokenizers import AddedToken

    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in PLAIN_ADDED_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None, unk_token=None,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(vocab_size: int, eos_ids: list[int], pad_id: int, seed: int):
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=HEAD_DIM, max_position_embeddings=512,
        tie_word_embeddings=True, initializer_range=0.2, rope_theta=10000.0, rms_norm_eps=1e-6,
        bos_token_id=None, eos_token_id=eos_ids[0], pad_token_id=pad_id, dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).float().eval()
    model.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=pad_id, do_sample=True, temperature=1.0, top_p=1.0, top_k=0)
    return model


SUBJECT_BLOCK0_WRITE = 0.1  # the subject model's block 0 writes into the residual stream at this scale


def _write_subject(model, tokenizer, out: Path) -> None:
    """``subject/``: the tiny model with block 0's two writes into the residual stream (attention output and
    MLP down projection) scaled by ``SUBJECT_BLOCK0_WRITE``. The random model's own residual after block 0
    is dominated by a context mix no short text describes; in this one it is mostly its token's embedding,
    which a few words name, so the pipeline's stages have something to learn from an extraction
    (deploy/pipeline-tiny.yaml; tests/test_pipeline.py checks that AR-SFT then passes FVE 0.2 held out)."""
    import copy

    import torch
    from safetensors.torch import save_file

    subject = copy.deepcopy(model)
    block = subject.model.layers[0]
    with torch.no_grad():
        block.self_attn.o_proj.weight.mul_(SUBJECT_BLOCK0_WRITE)
        block.mlp.down_proj.weight.mul_(SUBJECT_BLOCK0_WRITE)
    subject.save_pretrained(out, safe_serialization=True)
    state = {k: v.contiguous() for k, v in subject.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out)


def _residuals(model, tokenizer, docs, layer_index: int) -> np.ndarray:
    """Per document: the residual stream after block ``layer_index``, averaged over its tokens."""
    import torch

    out = []
    with torch.no_grad():
        for _, _, words in docs:
            ids = tokenizer.encode(" ".join(words), add_special_tokens=False)
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
            out.append(hs[layer_index + 1][0].float().mean(dim=0).numpy())
    return np.stack(out).astype(np.float32)


def topic_activations(residuals: np.ndarray, topics: list[str], rng: np.random.Generator, noise: float) -> np.ndarray:
    """Row = its topic's direction + ``noise``·N(0, I/d), at the residuals' typical norm.

    A topic's direction is the mean residual of its documents minus the mean over all documents,
    unit-normalised: the few well-separated directions a tiny verbaliser can learn to name.
    """
    d = residuals.shape[1]
    centre = residuals.mean(axis=0)
    names = sorted(set(topics))
    dirs = {}
    for t in names:
        v = residuals[[i for i, x in enumerate(topics) if x == t]].mean(axis=0) - centre
        dirs[t] = v / np.linalg.norm(v)
    scale = float(np.linalg.norm(residuals, axis=1).mean())
    rows = np.stack([dirs[t] for t in topics]) + noise * rng.standard_normal((len(topics), d)) / np.sqrt(d)
    return (rows * scale).astype(np.float32)


def write_rl_parquet(path: Path, prompts, activations: np.ndarray, doc_ids, row_group_size: int = 64, fixed_size: bool = True,
                     texts=None):
    """The RL parquet; ``texts``: the source text behind each row (the official release's
    ``detokenized_text_truncated`` column, which the hallucination eval shows its judge)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = activations.shape[1]
    flat = pa.array(activations.reshape(-1), type=pa.float32())
    vec = pa.FixedSizeListArray.from_arrays(flat, d) if fixed_size else pa.ListArray.from_arrays(
        pa.array(np.arange(0, activations.size + 1, d, dtype=np.int32)), flat)
    msg = pa.struct([("role", pa.string()), ("content", pa.string())])
    table = pa.table({
        "prompt": pa.array(prompts, type=pa.list_(msg)),
        "activation_vector": vec,
        "doc_id": pa.array(doc_ids, type=pa.string()),
        **({"detokenized_text_truncated": pa.array(list(texts), type=pa.string())} if texts is not None else {}),
    })
    # a CRC per page: a reader that checks them (shared.data does) finds a damaged page instead of its garbage
    pq.write_table(table, path, row_group_size=row_group_size, write_page_checksum=True)


def write_confusion_records(path: Path, prompt, activations: np.ndarray, topics, doc_ids, per_topic: int = 2) -> None:
    """The karvonen-confusion records of the tiny fixture (``evals.karvonen_confusion.records``): per topic,
    ``per_topic`` activations from held-out documents, the topic as the quirk, the next topic as the
    distractor."""
    from nla_grpo.shared.data import is_eval_doc

    names = sorted(TOPICS)
    lines = []
    for k, topic in enumerate(names):
        rows = [i for i, (t, d) in enumerate(zip(topics, doc_ids)) if t == topic and is_eval_doc(d, 0.1)][:per_topic]
        for i in rows:
            other = names[(k + 1) % len(names)]
            lines.append(json.dumps({"id": f"{doc_ids[i]}-{i}", "prompt": prompt,
                                     "activation": [round(float(x), 6) for x in activations[i]],
                                     "quirk": f"the text is about {topic} ({', '.join(TOPICS[topic].split()[:4])})",
                                     "distractor": f"the text is about {other} ({', '.join(TOPICS[other].split()[:4])})"}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def build_tiny(out_dir: str | Path, seed: int = 0, n_docs: int = 256, noise: float = 0.3) -> Path:
    """Write the tiny model, tokenizer, parquet and sidecar into ``out_dir`` (atomically)."""
    import torch
    import yaml
    from safetensors.torch import save_file

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out}: exists and is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=out.parent))
    try:
        rng = np.random.default_rng(seed)
        tok = build_tokenizer(rng)
        eos_ids = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
        model = build_model(len(tok), eos_ids, tok.pad_token_id, seed)
        mdir = tmp / "model"
        model.save_pretrained(mdir, safe_serialization=True)
        # save_pretrained's safetensors header order and metadata are stable; re-save to pin them
        state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        save_file(state, str(mdir / "model.safetensors"), metadata={"format": "pt"})
        tok.save_pretrained(mdir)
        _write_subject(model, tok, tmp / "subject")
        docs = _documents(rng, n_docs)
        residuals = _residuals(model, tok, docs, LAYER_INDEX)
        # ROWS_PER_DOC rows per document (independent noise), so the eval split has whole documents to hold out
        topics = [d[1] for d in docs for _ in range(ROWS_PER_DOC)]
        acts = topic_activations(np.repeat(residuals, ROWS_PER_DOC, axis=0), topics, rng, noise)
        prompt = [{"role": "user", "content": AV_TEMPLATE.format(injection_char="<INJECT>")}]
        doc_ids = [d[0] for d in docs for _ in range(ROWS_PER_DOC)]
        texts = [" ".join(d[2]) for d in docs for _ in range(ROWS_PER_DOC)]
        write_rl_parquet(tmp / "rl.parquet", [prompt] * len(doc_ids), acts, doc_ids, texts=texts)
        write_json(tmp / "topics.json", topics)
        # the same documents as a corpus, for the pipeline's own extraction (deploy/pipeline-tiny.yaml)
        (tmp / "corpus.jsonl").write_text("".join(json.dumps({"doc_id": d[0], "text": " ".join(d[2])}) + "\n" for d in docs))
        write_confusion_records(tmp / "karvonen_confusion.jsonl", prompt, acts, topics, doc_ids)
        marker_id = tok.convert_tokens_to_ids(MARKER)
        embed_norm = float(torch.linalg.vector_norm(model.get_input_embeddings().weight.detach(), dim=-1).mean())
        # the official release's dataset sidecar (kind nla_dataset, schema_version 1), field for field; its
        # pipeline hands the scales to the trainer on the command line, this one records them at the top
        # level, which the official readers ignore
        meta = {
            "kind": "nla_dataset", "schema_version": 1, "dataset_id": f"rl_tiny_L{LAYER_INDEX}_seed{seed}",
            "stage": "rl", "row_count": len(doc_ids),
            "extraction": {"base_model": "model", "d_model": HIDDEN, "layer_index": LAYER_INDEX, "norm": "none",
                           "corpus": "tiny-topics", "corpus_slice": {"start": 0, "length": n_docs},
                           "positions_per_doc": ROWS_PER_DOC},
            "keep_debug_metadata": False,
            "tokens": {
                "injection_char": MARKER, "injection_token_id": marker_id,
                "injection_left_neighbor_id": tok.convert_tokens_to_ids(CONCEPT_OPEN),
                "injection_right_neighbor_id": tok.convert_tokens_to_ids(CONCEPT_CLOSE),
                "critic_suffix_ids": None,
            },
            "prompt_templates": {"actor": AV_TEMPLATE, "critic": AR_TEMPLATE},
            "injection_scale": round(embed_norm, 4), "mse_scale": "sqrt_d_model",
        }
        (tmp / "rl.parquet.nla_meta.yaml").write_text(yaml.safe_dump(meta, sort_keys=False, allow_unicode=True), encoding="utf-8")
        tmp.chmod(0o755)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# The tiny demo (deploy/tiny.yaml) on a GPU: vLLM's GPU LoRA kernels refuse float32, so bf16; 16-bit full
# fine-tuning of the critic is refused, so the critic trains a LoRA; a little of the GPU for vLLM, eager
# (the tiny model gains nothing from CUDA graphs), and no checkpoints.
GPU_OVERRIDES = ("model.dtype=bfloat16", "critic.lora_r=8", "rollout.gpu_memory_utilization=0.1",
                 "rollout.enforce_eager=true", "checkpointing.every=0")


def learning_summary(rows: list[dict], window: int = 25) -> dict:
    """Means of reward and FVE over the first and last ``window`` steps of a run's metrics rows, and the
    held-out eval FVE at each eval step: what the GPU test's margins are checked on."""
    def mean(key, part):
        return float(np.mean([r[key] for r in part]))

    first, last = rows[:window], rows[-window:]
    return {"steps": len(rows), "reward_first": mean("reward_mean", first), "reward_last": mean("reward_mean", last),
            "fve_first": mean("fve", first), "fve_last": mean("fve", last),
            "eval_fve": {int(r["step"]): float(r["eval/fve"]) for r in rows if "eval/fve" in r}}


def tiny_command(out_dir: str | Path, seed: int = 0, log=print) -> int:
    """``nla-grpo data tiny``: the fixture into ``out_dir``, which must be new or empty; returns 0."""
    from nla_grpo.shared.errors import NlaInputError

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise NlaInputError(out, "exists and is not an empty directory")
    build_tiny(out, seed=seed)
    log(f"wrote {out}/model, {out}/rl.parquet and its sidecar (seed {seed})")
    return 0
