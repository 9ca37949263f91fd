"""Outside Qwen: tiny random Gemma-3 and Llama models on the tiny fixture's tokenizer and data. The vLLM
rollout's prompt embeddings equal the learner's (Gemma's embedding multiplies its rows by sqrt(d), which
vLLM applies to token ids only), so their logprobs agree; critic prompts start with the tokenizer's start
token where the tokenizer adds one."""
import json
import shutil

import pytest
import torch

FAMILIES = ("gemma3", "llama")


def _with_start_token(model_dir):
    """The tiny tokenizer made to put a start token before every text, as Gemma's and Llama's do."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    bos = "<|endoftext|>"
    tok.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(str(model_dir / "tokenizer.json"))
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": bos}))


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tiny_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig

    out = tmp_path_factory.mktemp(request.param) / "tiny"
    shutil.copytree(tiny_dir, out, ignore=shutil.ignore_patterns("model"))
    model_dir = out / "model"
    model_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy2(tiny_dir / "model" / name, model_dir / name)
    _with_start_token(model_dir)
    shape = dict(vocab_size=json.loads((tiny_dir / "model" / "config.json").read_text())["vocab_size"], hidden_size=64,
                 intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                 max_position_embeddings=512, tie_word_embeddings=True, pad_token_id=0, eos_token_id=2, initializer_range=0.2)
    if request.param == "gemma3":
        config = Gemma3TextConfig(**shape, sliding_window=512, query_pre_attn_scalar=32)
        config.architectures = ["Gemma3ForCausalLM"]
    else:
        config = LlamaConfig(**shape)
        config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model_dir)
    return out


def _cfg(family_dir):
    from test_learner_support import make_cfg

    # Gemma-3's sliding-window layers need the padded forward (the packed mask refuses them)
    cfg = make_cfg(family_dir, "embed", micro_batch=8, forward="padded")
    return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"group_size": 2, "max_new_tokens": 6})})


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_vllm_rollout_matches_the_learner_outside_qwen(family_dir):
    pytest.importorskip("vllm")
    from nla_grpo.learner.learner import Learner
    from nla_grpo.rollout.vllm.engine import VllmEngine
    from nla_grpo.shared.types import PromptRequest
    from test_learner_support import load_tiny_spec, prompts_and_vectors

    cfg, spec = _cfg(family_dir), load_tiny_spec(family_dir)
    gemma = "gemma" in json.loads((family_dir / "model" / "config.json").read_text())["model_type"]
    learner = Learner(cfg, spec)
    rows = prompts_and_vectors(family_dir, 3)
    requests = [PromptRequest(row_id=i, prompt_ids=ids, site=site, vector=vec) for i, (ids, site, vec) in enumerate(rows)]
    engine = VllmEngine(cfg, spec, "cpu")
    try:
        assert engine.embed_multiplier == (8.0 if gemma else None)  # sqrt(64)
        # the plain rows are the learner's embedding module's output, to the bit
        ids = torch.tensor(requests[0].prompt_ids)
        with torch.no_grad():
            theirs = learner.model.get_input_embeddings()(ids)
        assert torch.equal(engine.prompt_embeds(requests[0], inject=False), theirs)
        if gemma:  # the raw matrix alone would be sqrt(d) too small
            assert not torch.allclose(engine.embed_weight[ids], theirs)
        engine.load_adapter(learner.export_adapter())
        samples = engine.generate(requests, seed=0)
        vectors = torch.stack([rows[s.row_id][2] for s in samples])
        got = learner.logprobs(samples, vectors)
        gap = max(abs(a - b) for s, lp in zip(samples, got) for a, b in zip(s.logprobs, lp))
        assert sum(len(s.response_ids) for s in samples) > len(samples) and gap <= 1e-4, gap
    finally:
        engine.close()


def test_critic_prompts_start_with_the_start_token_where_the_tokenizer_has_one(family_dir, tiny_dir):
    from nla_grpo.critic.scoring import Critic
    from nla_grpo.shared.config import build_config
    from nla_grpo.shared.errors import NlaInputError
    from nla_grpo.shared.spec import load_spec, sidecar_path

    spec = load_spec(sidecar_path(family_dir / "rl.parquet"))

    def critic(model_dir, **section):
        cfg = build_config({"model": {"path": str(model_dir), "dtype": "float32"}, "critic": {"lora_r": 4, **section}}, "t")
        return Critic(cfg, spec)

    with_bos = critic(family_dir / "model")
    ids = with_bos.encode(["moss and pine trees"])[0]
    assert ids[0] == with_bos.tokenizer.bos_token_id == 0 and ids.count(0) == 1
    plain = critic(family_dir / "model", add_bos=False).encode(["moss and pine trees"])[0]
    assert ids == [0] + plain  # the reference trainer's encoding, kept on request
    with torch.no_grad():  # and the start token changes what the critic predicts
        x, y = torch.tensor([ids]), torch.tensor([plain])
        assert not torch.allclose(with_bos.model(x, torch.ones_like(x)), with_bos.model(y, torch.ones_like(y)), atol=1e-4)
    qwen = critic(tiny_dir / "model")  # no start token: as before
    assert qwen.bos is None and qwen.encode(["moss"])[0] == critic(tiny_dir / "model", add_bos=False).encode(["moss"])[0]
    with pytest.raises(NlaInputError, match="critic.add_bos: true, but the tokenizer has no start token"):
        critic(tiny_dir / "model", add_bos=True)
