"""One GRPO step on one GPU, two ways, in the same run: reference-style vs nla-grpo.

Builds a Qwen3-8B-shaped model with random weights (HF ``from_config`` on the GPU, saved once as
safetensors so every service loads it the normal way), a tokenizer with the marker tokens, and an
RL parquet of ``--prompts`` rows whose prompts render to about ``--prompt-len`` tokens. Then times:

- reference-style: HF ``generate()`` once per prompt with the per-token logprob loop
  (``rollout.hf_engine.HfEngine``), the critic one explanation at a time, the learner update;
- nla-grpo: the vLLM engine (prompt-embedding injection, LoRA pushed in memory), batched critic
  scoring, the same learner update, the adapter push (export -> usable by vLLM); plus raw
  ``vllm.LLM.generate`` on the same prompts and adapter, to show the service's overhead.

After the timed steps it also times the update on the last step's samples with
``learner.forward: padded`` at micro-batch 8 (the learner before shared-prefix packing), unless
``--skip-old-update``; ``learner_tflops`` counts 6·N·tokens with N the base model's parameters.

All services run in this one process (vLLM's engine in-process too), sharing the GPU as in the
``colocated`` placement. Responses are forced to ``--new-tokens`` (random weights rarely stop).
Prints a markdown table and writes JSON to ``--out``.

    python benchmarks/step_benchmark.py --out benchmarks/results/h200.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
                max_position_embeddings=4096, tie_word_embeddings=False)
QWEN3_32B = dict(vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                 num_attention_heads=64, num_key_value_heads=8, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
                 max_position_embeddings=4096, tie_word_embeddings=False)
# a dry-run shape for checking the script on a CPU
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
             num_key_value_heads=2, head_dim=32, rope_theta=1e4, rms_norm_eps=1e-6, max_position_embeddings=1024,
             tie_word_embeddings=False)
DEVICE = "cuda"


DATA_ROWS = 256  # rows of the benchmark parquet (at least --prompts): enough for the 256 x 8 batch


def build_workdir(root: Path, shape: dict, layers: int, prompts: int, prompt_len: int, seed: int, nf4: bool = False) -> Path:
    """Model dir (random bf16 weights + small tokenizer), RL parquet and sidecar under ``root``; ``nf4``:
    the weights written pre-quantised (``nf4_checkpoint.py``: a 32B shape does not fit the disk in bf16)."""
    import numpy as np
    import torch
    import yaml
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from nla_grpo.dataprep.tiny import AV_TEMPLATE, AR_TEMPLATE, CONCEPT_CLOSE, CONCEPT_OPEN, MARKER, build_tokenizer, write_rl_parquet

    mdir = root / "model"
    rows = max(prompts, DATA_ROWS)
    if (root / "rl.parquet.nla_meta.yaml").is_file():
        import pyarrow.parquet as pq

        if pq.ParquetFile(root / "rl.parquet").metadata.num_rows >= rows:
            return root
        (root / "rl.parquet.nla_meta.yaml").unlink()  # too few rows for this batch: the data again, the model kept
    rng = np.random.default_rng(seed)
    tok = build_tokenizer(rng)
    eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    cfg = Qwen3Config(**{**shape, "num_hidden_layers": layers}, eos_token_id=eos[0], pad_token_id=eos[1],
                      bos_token_id=None, dtype="bfloat16")
    torch.manual_seed(seed)
    if (mdir / "config.json").is_file():
        pass
    elif nf4:
        from nf4_checkpoint import write_random_nf4

        write_random_nf4(mdir, cfg, device=DEVICE, seed=seed)
        GenerationConfig(eos_token_id=eos, pad_token_id=eos[1]).save_pretrained(mdir)
    else:
        with torch.device(DEVICE):
            model = Qwen3ForCausalLM(cfg).to(torch.bfloat16 if DEVICE == "cuda" else torch.float32)
        model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos[1])
        model.save_pretrained(mdir, safe_serialization=True, max_shard_size="5GB")
        del model
    tok.save_pretrained(mdir)
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    # pad the user message with words until the rendered prompt is about prompt_len tokens
    words = "the sea and the tree near a quiet street with bread and salt".split()
    content = AV_TEMPLATE.format(injection_char="<INJECT>")
    while len(tok.apply_chat_template([{"role": "user", "content": content.replace("<INJECT>", MARKER)}],
                                      tokenize=False, add_generation_prompt=True, enable_thinking=False)) < 4 * prompt_len:
        content += " " + words[len(content) % len(words)]
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": content.replace("<INJECT>", MARKER)}],
                                             tokenize=False, add_generation_prompt=True, enable_thinking=False), add_special_tokens=False)
    while len(ids) > prompt_len:
        content = content[: content.rfind(" ")]
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": content.replace("<INJECT>", MARKER)}],
                                                 tokenize=False, add_generation_prompt=True, enable_thinking=False), add_special_tokens=False)
    acts = rng.standard_normal((rows, cfg.hidden_size)).astype(np.float32)
    write_rl_parquet(root / "rl.parquet", [[{"role": "user", "content": content}]] * rows, acts,
                     [f"doc-{i}" for i in range(rows)])
    meta = {
        "kind": "nla_dataset", "schema_version": 2, "stage": "rl", "base_model": "model",
        "extraction": {"d_model": cfg.hidden_size, "layer_index": min(24, layers - 1), "injection_scale": "embed_norm", "mse_scale": "sqrt_d_model"},
        "tokens": {"injection_char": MARKER, "injection_token_id": tok.convert_tokens_to_ids(MARKER),
                   "injection_left_neighbor_id": tok.convert_tokens_to_ids(CONCEPT_OPEN),
                   "injection_right_neighbor_id": tok.convert_tokens_to_ids(CONCEPT_CLOSE)},
        "prompt_templates": {"av": AV_TEMPLATE, "ar": AR_TEMPLATE},
    }
    (root / "rl.parquet.nla_meta.yaml").write_text(yaml.safe_dump(meta, allow_unicode=True))
    return root


def sync():
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _square_operands(n: int):
    """(dtype, a, b): two random n×n matrices, bf16 on the GPU, float32 on the CPU."""
    import torch

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    return (dtype, torch.randn(n, n, device=DEVICE, dtype=dtype, generator=gen),
            torch.randn(n, n, device=DEVICE, dtype=dtype, generator=gen))


def _seconds(fn) -> float:
    """How long ``fn()``'s work takes: CUDA events around it on the GPU (waited for), the wall clock on the CPU."""
    import torch

    if DEVICE != "cuda":
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _release():
    import torch

    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def gemm_peak(n: int, warmup: int = 3, reps: int = 20) -> dict:
    """Median TFLOP/s of ``reps`` timed n×n×n bf16 ``torch.matmul``s on random data after ``warmup``
    (CUDA events around each); on the CPU a float32 product, only to exercise the code."""
    import torch

    dtype, a, b = _square_operands(n)
    for _ in range(warmup):
        torch.matmul(a, b)
    sync()
    times = [_seconds(lambda: torch.matmul(a, b)) for _ in range(reps)]
    med = statistics.median(times)
    del a, b
    _release()
    return {"n": n, "dtype": str(dtype).replace("torch.", ""), "reps": reps, "median_s": med,
            "tflops": 2 * n ** 3 / med / 1e12, "tflops_best": 2 * n ** 3 / min(times) / 1e12}


def gemm_sustained(n: int, seconds: float = 10.0, block: int = 20) -> dict:
    """TFLOP/s of n×n×n bf16 ``torch.matmul``s issued back to back for ``seconds`` (blocks of ``block``, timed
    by CUDA events), over the second half only: the rate once the board has settled at the clock a long
    load holds it to, beside ``gemm_peak``'s short bursts. On the CPU a few float32 blocks, only to run the code."""
    import torch

    dtype, a, b = _square_operands(n)
    out = torch.empty_like(a)

    def run_block():
        for _ in range(block):
            torch.matmul(a, b, out=out)

    rates, t0 = [], time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        dt = _seconds(run_block)
        rates.append((time.perf_counter() - t0, 2 * n ** 3 * block / dt / 1e12))
    late = [r for t, r in rates if t >= seconds / 2] or [rates[-1][1]]
    del a, b, out
    _release()
    return {"n": n, "dtype": str(dtype).replace("torch.", ""), "seconds": seconds, "blocks": len(rates),
            "tflops": statistics.median(late), "tflops_first_block": rates[0][1]}


def reset_peak():
    import torch

    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_gb() -> float:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else float("nan")


def timed(fn):
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t


def micro_batch_arg(text: str):
    return text if text == "auto" else int(text)


def vllm_mem_arg(value: str):
    return value if value == "auto" else float(value)


def add_workload_args(ap, steps: int) -> None:
    """The workload options both GPU benchmarks share (the issue's workload by default)."""
    ap.add_argument("--workdir", default="/tmp/nla-bench")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--critic-layers", type=int, default=25)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=150)
    ap.add_argument("--lora-r", type=int, default=128)
    ap.add_argument("--micro-batch", type=micro_batch_arg, default="auto", help="learner.micro_batch: samples, or auto")
    ap.add_argument("--steps", type=int, default=steps, help="steps timed (the first warms up)")
    ap.add_argument("--vllm-mem", type=vllm_mem_arg, default=0.35, help="vLLM's share of the GPU when it shares one, or auto")


def workload_requests(cfg, spec, n: int) -> list:
    """The first ``n`` rows of the run's RL parquet as ``PromptRequest``s, rendered as the job renders them."""
    from transformers import AutoTokenizer

    from nla_grpo.shared.data import read_rows
    from nla_grpo.shared.prompts import prompt_table
    from nla_grpo.shared.types import PromptRequest

    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    rows = read_rows(cfg.data.parquet, spec.d_model)
    table, (index,) = prompt_table([rows], tok, spec, cfg.rollout.prefill, cfg.data.parquet, False)
    return [PromptRequest(int(rows.row_ids[i]), table[index[i]][0], table[index[i]][1], rows.activations[i].tolist())
            for i in range(n)]


def add_engine_options(ap) -> None:
    """``--engine-option KEY=VALUE``, for the benchmarks that run vLLM."""
    ap.add_argument("--engine-option", type=engine_option_arg, action="append", default=[], metavar="KEY=VALUE",
                    help="a rollout.engine_options entry for vLLM (repeatable; VALUE read as YAML), e.g. kv_cache_dtype=fp8")


def engine_option_arg(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` -> (KEY, VALUE read as YAML)."""
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, found {text!r}")
    return key.strip(), yaml.safe_load(value)


def parse_with_dry_run(ap, out: str):
    """``--out`` (default ``out``) and ``--dry-run-cpu`` added, the arguments parsed; a dry run moves the
    benchmarks to the CPU (``DEVICE``) with at most 4 decoder layers."""
    global DEVICE
    ap.add_argument("--out", default=out)
    ap.add_argument("--dry-run-cpu", action="store_true", help="a small model on the CPU, to check the script")
    args = ap.parse_args()
    if args.dry_run_cpu:
        DEVICE = "cpu"
        args.layers = min(args.layers, 4)
    return args


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(ap, steps=3)
    add_engine_options(ap)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument("--skip-old-update", action="store_true", help="do not also time the padded (pre-packing) update")
    ap.add_argument("--transport", choices=["memory", "file"], default="memory",
                    help="how the engine registers the adapter: in memory, or from a PEFT directory (weight_sync.kind: file)")
    args = parse_with_dry_run(ap, "benchmarks/results/h200.json")
    if args.dry_run_cpu:
        args.critic_layers = min(args.critic_layers, 3)

    # in-process engine: the in-memory adapter push then stays inside this process
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if DEVICE == "cpu":
        from nla_grpo.rollout.vllm.env import prepare_engine_env

        prepare_engine_env(cpu=True)
    import torch

    from nla_grpo.critic.scoring import Critic
    from nla_grpo.orchestrator.job import prepare_job
    from nla_grpo.learner.learner import Learner
    from nla_grpo.shared.config import build_config
    from nla_grpo.shared.types import PromptRequest

    root = build_workdir(Path(args.workdir), SMALL if args.dry_run_cpu else QWEN3_8B, args.layers, args.prompts, args.prompt_len, seed=0)
    cfg = build_config({
        "model": {"path": str(root / "model"), "dtype": "bfloat16" if DEVICE == "cuda" else "float32"},
        "data": {"parquet": str(root / "rl.parquet"), "eval_fraction": 0.0, "fve_baseline_rows": 8},
        "rollout": {"group_size": args.group, "max_new_tokens": args.new_tokens, "gpu_memory_utilization": args.vllm_mem,
                    "enforce_eager": args.enforce_eager, "max_loras": 2,
                    "max_num_seqs": max(64, args.prompts * args.group), "engine_options": dict(args.engine_option)},
        "weight_sync": {"kind": "file" if args.transport == "file" else "auto"},
        "critic": {"num_layers": args.critic_layers, "micro_batch": 64, "max_prompt_tokens": 1024, "train": False},
        "learner": {"lora_r": args.lora_r, "lora_alpha": 16, "use_rslora": True, "micro_batch": args.micro_batch,
                    "lr": 1e-6, "optimizer": "auto"},
        "grpo": {"prompts_per_step": args.prompts},
        "placement": {"mode": "colocated" if DEVICE == "cuda" else "cpu"},
        "logging": {"eval_every": 0},
    }, "benchmark")
    job = prepare_job(cfg, log=lambda m: print(m, flush=True))
    rows = job.train
    reqs = [PromptRequest(int(rows.row_ids[i]), list(job.prompt_ids[int(job.prompt_index_train[i])][0]),
                          job.prompt_ids[int(job.prompt_index_train[i])][1], torch.from_numpy(rows.activations[i].copy()))
            for i in range(args.prompts)]
    vectors = torch.from_numpy(rows.activations[: args.prompts]).repeat_interleave(args.group, 0)
    group_ids = torch.arange(args.prompts).repeat_interleave(args.group)
    def dump(r):
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(r, indent=1))

    res: dict = {"config": vars(args), "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu", "torch": torch.__version__}

    t0 = time.perf_counter()
    learner = Learner(cfg, job.spec, DEVICE)
    critic = Critic(cfg, job.spec, DEVICE)
    res["load_s"] = time.perf_counter() - t0
    n_lora = sum(p.numel() for p in learner.params)
    res["lora_params"] = n_lora
    print(f"[load] learner + critic {res['load_s']:.1f}s; LoRA params {n_lora / 1e6:.0f}M", flush=True)

    def explanations(samples):
        # random weights: use the decoded text itself as the explanation (length ~ the response)
        return [s.text[:600] or "empty" for s in samples]

    def update(samples):
        from nla_grpo.learner.grpo import group_advantages

        rewards = torch.randn(len(samples))
        adv = group_advantages(rewards, group_ids)
        return learner.update(samples, adv.tolist(), vectors)

    def parity(samples):
        """vLLM's sampled-token logprobs vs the learner's recomputation (same adapter, same injection)."""
        learned = learner.logprobs(samples, vectors)
        d = torch.cat([torch.tensor(s.logprobs) - torch.tensor(l) for s, l in zip(samples, learned)])
        k3 = torch.exp(-d) + d - 1  # k3(vllm || learner) with delta = learner - vllm
        return {"mean_abs": d.abs().mean().item(), "max_abs": d.abs().max().item(), "k3_mean": k3.mean().item(), "tokens": d.numel()}

    # ---- reference-style step ----
    if not args.skip_reference:
        from nla_grpo.rollout.hf_engine import HfEngine

        hf = HfEngine(cfg, job.spec, DEVICE)
        hf.load_adapter(learner.export_adapter())
        samples, t_roll = timed(lambda: hf.generate(reqs, seed=0, ignore_eos=True))
        expl = explanations(samples)
        _, t_score = timed(lambda: [critic.score([e], vectors[i : i + 1]) for i, e in enumerate(expl)])
        reset_peak()
        upd, t_upd = timed(lambda: update(samples))
        res["reference"] = {"rollout": t_roll, "score": t_score, "update": t_upd, "push": 0.0,
                            "total": t_roll + t_score + t_upd, "peak_gb": peak_gb()}
        print(f"[reference] {res['reference']}", flush=True)
        dump(res)
        hf.close()
        del hf
        if DEVICE == "cuda":
            torch.cuda.empty_cache()

    # ---- nla-grpo step ----
    from nla_grpo.rollout.vllm.engine import VllmEngine

    t = time.perf_counter()
    eng = VllmEngine(cfg, job.spec, DEVICE)
    res["vllm_start_s"] = time.perf_counter() - t
    # the engine lives in this process: the adapter's GPU tensors go to it as they are
    eng.load_adapter(learner.export_adapter(device="same"))
    steps = []
    for k in range(args.steps):
        samples, t_roll = timed(lambda: eng.generate(reqs, seed=k, ignore_eos=True))
        assert all(len(s.response_ids) == args.new_tokens for s in samples)
        expl = explanations(samples)
        _, t_score = timed(lambda: critic.score(expl, vectors))
        if k == 0:
            res["parity_bf16"] = parity(samples)
            print(f"[parity] {res['parity_bf16']}", flush=True)
        reset_peak()
        upd, t_upd = timed(lambda: update(samples))
        peak = peak_gb()

        def push():
            u = learner.export_adapter(device="same")
            eng.load_adapter(u)
            return u

        _, t_push = timed(push)
        push_parts = getattr(eng.registry, "last_timings", None)
        # the first forward on the new adapter, one token only, so decoding does not hide its cost
        def first_token():
            p = eng.sampling_params(99, reqs[0].row_id)
            p.max_tokens, p.n = 1, 1
            return eng.llm.generate([{"prompt_embeds": eng.prompt_embeds(reqs[0])}], [p],
                                    lora_request=eng._lora_request, use_tqdm=False)

        _, t_first_use = timed(first_token)
        steps.append({"rollout": t_roll, "score": t_score, "update": t_upd, "push": t_push, "push_parts": push_parts, "first_token_after_push": t_first_use,
                      "total": t_roll + t_score + t_upd + t_push, "peak_gb": peak,
                      "mismatch_mean_abs": upd.get("logprob_mismatch_mean_abs"), "mismatch_k3": upd.get("logprob_mismatch_k3")})
        print(f"[nla-grpo step {k}] {steps[-1]}", flush=True)
        res["nla_grpo_steps"] = steps
        dump(res)
    res["nla_grpo_steps"] = steps

    # ---- raw vLLM on the same prompts and adapter (the service's overhead) ----
    prompts = [{"prompt_embeds": eng.prompt_embeds(r)} for r in reqs]
    params = [eng.sampling_params(0, r.row_id, ignore_eos=True) for r in reqs]
    raw = []
    for _ in range(2):
        _, t_raw = timed(lambda: eng.llm.generate(prompts, params, lora_request=eng._lora_request, use_tqdm=False))
        raw.append(t_raw)
    res["raw_vllm_rollout"] = min(raw)

    # ---- the update before this change: PEFT's fp32 LoRA on padded rows, micro-batch 8, same samples ----
    if not args.skip_old_update:
        learner.policy.use_forward("padded")
        learner.cfg.learner.micro_batch = 8
        res["parity_bf16_padded"] = parity(samples)
        old = []
        for _ in range(2):
            reset_peak()
            _, t_old = timed(lambda: update(samples))
            old.append({"update": t_old, "peak_gb": peak_gb()})
            print(f"[padded update] {old[-1]}", flush=True)
        res["update_padded"] = old
        learner.policy.use_forward(cfg.learner.forward)
        learner.cfg.learner.micro_batch = cfg.learner.micro_batch

    warm = steps[1:] or steps
    med = {k: statistics.median(s[k] for s in warm) for k in ("rollout", "score", "update", "push", "total")}
    res["nla_grpo"] = med
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    # 6·N·tokens (policy forward + backward, reference forward), N = the base model's parameters
    flops = 6 * learner.base_params * tokens
    res["base_params"], res["update_tokens"] = learner.base_params, tokens
    res["learner_tflops"] = flops / med["update"] / 1e12
    res["micro_batch_tokens"] = learner.micro_batch_tokens
    if "update_padded" in res:
        t_old = res["update_padded"][-1]["update"]
        res["learner_tflops_padded"] = flops / t_old / 1e12
        res["update_speedup"] = t_old / med["update"]
    res["samples_per_s"] = args.prompts * args.group / med["total"]
    if "reference" in res:
        res["speedup"] = res["reference"]["total"] / med["total"]
        res["reference"]["samples_per_s"] = args.prompts * args.group / res["reference"]["total"]
    dump(res)

    ref = res.get("reference", {})
    print("\n| phase | reference-style (s) | nla-grpo (s) |\n|---|---|---|")
    for k in ("rollout", "score", "update", "push", "total"):
        print(f"| {k} | {ref.get(k, float('nan')):.2f} | {med[k]:.2f} |")
    print(f"\nraw vLLM rollout {res['raw_vllm_rollout']:.2f}s (service/raw {med['rollout'] / res['raw_vllm_rollout']:.2f}); "
          f"samples/s {res['samples_per_s']:.1f}; learner {res['learner_tflops']:.0f} TFLOP/s "
          f"(padded path {res.get('learner_tflops_padded', float('nan')):.0f}); "
          f"speedup {res.get('speedup', float('nan')):.1f}x")
    eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
