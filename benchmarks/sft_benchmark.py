"""The two SFT stages' steps on the 8B shape, on one GPU: AV-SFT (``sft.av.AvSftLearner``) and AR-SFT
(``sft.ar.ArSftCritic``), each timed on synthetic batches, with MFU against a bf16 GEMM peak measured
in the same run.

The workload (model with random weights, tokenizer, prompt table, sidecar) is ``step_benchmark.py``'s,
built once under ``--workdir`` with one RL row (and so one activation vector) per AV row:

- AV-SFT: ``--rows`` rows a step, each the job's rendered prompt (about ``--prompt-len`` tokens) with
  its own activation (so no two rows share a packed prefix) and an explanation response of
  ``--response-tokens`` random plain tokens (``--lengths uniform``: 20 to 2·response-tokens − 20).
  The learner is the RL one with its defaults: packed forward, ``micro_batch: auto``, bf16 LoRA r=128
  alpha 16 rsLoRA on the 7 linears; ``--gradient-checkpointing`` as an option.
- AR-SFT: ``--ar-rows`` explanations of about ``--ar-explanation-tokens`` tokens (random words) with
  random activations, on the critic truncated at the job's layer + 1 blocks (as RL builds it), LoRA
  ``--ar-lora-r`` (0: full fine-tuning, which wants float32 weights to be sound, see ``shared.config``),
  at each ``--ar-micro-batch`` (``critic.micro_batch``; 16 is the config default).

``--steps`` steps each; the first warms up and the median of the rest is reported. Executed FLOP are
counted as the stages' docstrings do: 4·N per executed token with a LoRA on a frozen base (forward 2·N
+ backward to the inputs 2·N), 6·N with the whole backbone trained, N = the model's parameters
without the adapters (embedding table included, as everywhere in these benchmarks). MFU is that rate
over the median of timed 8192³ bf16 ``torch.matmul``s (the larger of a reading before and after).

    python benchmarks/sft_benchmark.py --steps 4 --out benchmarks/results/h200-sft.json
    python benchmarks/sft_benchmark.py --dry-run-cpu --steps 2 --out /tmp/sft-cpu.json
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import step_benchmark  # noqa: E402  (the shared workload)

WORDS = ("the sea and a tree near quiet street with bread salt river stone light old city market "
         "music night small house green field cold wind warm fire book story dog cat child road").split()


def response_lengths(rows: int, mean: int, lengths: str, gen) -> list[int]:
    import torch

    if lengths == "fixed":
        return [mean] * rows
    lo, hi = 20, max(20, 2 * mean - 20)
    return [int(x) for x in torch.randint(lo, hi + 1, (rows,), generator=gen)]


def word_explanations(tokenizer, targets: list[int], seed: int) -> list[str]:
    """Random word strings, each cut at the first word that brings it to its target token count."""
    import random

    rnd = random.Random(seed)
    out = []
    for target in targets:
        words: list[str] = []
        while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < target:
            words.append(rnd.choice(WORDS))
        out.append(" ".join(words))
    return out


def free_gpu() -> None:
    import torch

    gc.collect()
    if step_benchmark.DEVICE == "cuda":
        torch.cuda.empty_cache()


def summarise(steps: list[dict], tokens_all: int, per_token: int, n_params: int, peak: float) -> dict:
    """Medians over the timed steps after the first (the warm-up)."""
    warm = steps[1:] or steps
    sec = statistics.median(s["seconds"] for s in warm)
    executed = statistics.median(s["executed_tokens"] for s in warm)
    tflops = per_token * n_params * executed / sec / 1e12
    # the stage's own count (sft/av.py, sft/ar.py: only the matmuls that run, where they run), the headline
    stage = statistics.median(s["tflops_executed"] for s in warm)
    return {"step_s": sec, "tokens_per_s": tokens_all / sec, "executed_tokens": executed,
            "executed_tflops": stage, "mfu": stage / peak if peak else float("nan"),
            "tflops_all_weights": tflops, "mfu_all_weights": tflops / peak if peak else float("nan"),
            "flops_per_token_all_weights": f"{per_token}*N", "n_params": n_params}


def run_av(args, base_cfg, job, res, dump) -> None:
    import torch

    from nla_grpo.shared.config import build_config
    from nla_grpo.sft.av import AvSftLearner

    dev = step_benchmark.DEVICE
    cfg = build_config({**base_cfg, "learner": {**base_cfg["learner"], "forward": "packed", "micro_batch": args.micro_batch,
                                                "gradient_checkpointing": args.gradient_checkpointing}}, "benchmark")
    gen = torch.Generator().manual_seed(0)
    prompts, sites = [], []
    for i in range(args.rows):
        ids, site = job.prompt_ids[int(job.prompt_index_train[i])]
        prompts.append(list(ids))
        sites.append(int(site))
    vectors = torch.from_numpy(job.train.activations[: args.rows].copy())
    assert len({tuple(v[:8].tolist()) for v in vectors}) == args.rows, "rows must not share an activation"
    lens = response_lengths(args.rows, args.response_tokens, args.lengths, gen)
    responses = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lens]
    prompt_tokens = sum(len(p) for p in prompts)
    response_tokens = sum(lens)
    t0 = time.perf_counter()
    learner = AvSftLearner(cfg, job.spec, dev)
    load_s = time.perf_counter() - t0
    out = {"rows": args.rows, "prompt_tokens": prompt_tokens, "response_tokens": response_tokens,
           "tokens": prompt_tokens + response_tokens, "prompt_len_min_max": [min(map(len, prompts)), max(map(len, prompts))],
           "response_len_min_max": [min(lens), max(lens)], "load_s": load_s, "base_params": learner.base_params,
           "lora_params": sum(p.numel() for p in learner.params), "optimizer": type(learner.optimizer).__module__ + "." +
           type(learner.optimizer).__name__, "gradient_checkpointing": args.gradient_checkpointing, "steps": []}
    res["av_sft"] = out
    for k in range(args.steps):
        step_benchmark.reset_peak()
        m, wall = step_benchmark.timed(lambda: learner.sft_step(prompts, sites, responses, vectors, lr=1e-5))
        m = {key: v for key, v in m.items() if isinstance(v, (int, float, bool))}
        m.update(wall_s=wall, peak_gib=step_benchmark.peak_gb())
        out["steps"].append(m)
        print(f"[av-sft {k}] {m['seconds']:.2f}s loss {m['loss']:.3f} executed {m['executed_tokens']} tokens "
              f"{m['tflops_executed']:.0f} TFLOP/s mb tokens {m['micro_batch_tokens']} peak {m['peak_gib']:.1f} GiB", flush=True)
        dump()
    out["micro_batch_tokens"] = learner.micro_batch_tokens
    out["peak_gib"] = max(s["peak_gib"] for s in out["steps"])
    out.update(summarise(out["steps"], out["tokens"], 4, learner.base_params, res["gemm_peak_tflops"]))
    dump()
    del learner
    free_gpu()


def run_ar(args, base_cfg, job, res, dump) -> None:
    import torch

    from nla_grpo.shared.config import build_config
    from nla_grpo.sft.ar import ArSftCritic

    dev = step_benchmark.DEVICE
    gen = torch.Generator().manual_seed(1)
    res["ar_sft"] = {}
    for mb in [int(x) for x in str(args.ar_micro_batch).split(",")]:
        cfg = build_config({**base_cfg, "critic": {"lora_r": args.ar_lora_r, "lora_alpha": 16, "micro_batch": mb,
                                                   "max_prompt_tokens": 1024, "lr": 1e-5, "train": False}}, "benchmark")
        t0 = time.perf_counter()
        critic = ArSftCritic(cfg, job.spec, dev)
        load_s = time.perf_counter() - t0
        targets = response_lengths(args.ar_rows, args.ar_explanation_tokens, args.lengths, gen)
        texts = word_explanations(critic.tokenizer, targets, seed=mb)
        acts = torch.randn(args.ar_rows, job.spec.d_model, generator=gen)
        ids = critic.encode(texts)
        assert all(x is not None for x in ids)
        n_params = sum(p.numel() for n, p in critic.model.named_parameters() if "lora_" not in n)
        expl_tokens = sum(len(critic.tokenizer.encode(t, add_special_tokens=False)) for t in texts)
        out = {"rows": args.ar_rows, "micro_batch": mb, "lora_r": critic.meta.lora_r, "num_layers": critic.meta.num_layers,
               "explanation_tokens": expl_tokens, "tokens": sum(len(x) for x in ids),
               "prompt_len_min_max": [min(map(len, ids)), max(map(len, ids))], "load_s": load_s,
               "trainable_params": sum(p.numel() for p in critic.trainable), "steps": []}
        res["ar_sft"][f"mb{mb}"] = out
        for k in range(args.steps):
            step_benchmark.reset_peak()
            m, wall = step_benchmark.timed(lambda: critic.sft_step(texts, acts, lr=1e-5))
            m = {key: v for key, v in m.items() if isinstance(v, (int, float, bool))}
            m.update(wall_s=wall, peak_gib=step_benchmark.peak_gb(), executed_tokens=m["tokens"])
            out["steps"].append(m)
            print(f"[ar-sft mb{mb} {k}] {m['seconds']:.3f}s loss {m['loss']:.3f} {m['tokens']} tokens "
                  f"{m['tflops_executed']:.0f} TFLOP/s peak {m['peak_gib']:.1f} GiB", flush=True)
            dump()
        out["optimizer"] = type(critic.optimizer).__module__ + "." + type(critic.optimizer).__name__
        out["peak_gib"] = max(s["peak_gib"] for s in out["steps"])
        out.update(summarise(out["steps"], out["tokens"], 4 if critic.meta.lora_r > 0 else 6, n_params,
                             res["gemm_peak_tflops"]))
        dump()
        del critic
        free_gpu()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    step_benchmark.add_workload_args(ap, steps=4)
    ap.set_defaults(workdir=None)
    ap.add_argument("--rows", type=int, default=512, help="AV-SFT rows per step (each its own prompt and vector)")
    ap.add_argument("--response-tokens", type=int, default=40, help="AV-SFT explanation response tokens (the mean with --lengths uniform)")
    ap.add_argument("--lengths", choices=["fixed", "uniform"], default="fixed")
    ap.add_argument("--gradient-checkpointing", action="store_true", help="learner.gradient_checkpointing for AV-SFT")
    ap.add_argument("--ar-rows", type=int, default=256, help="AR-SFT explanations per step")
    ap.add_argument("--ar-explanation-tokens", type=int, default=40)
    ap.add_argument("--ar-lora-r", type=int, default=128, help="critic.lora_r (0: full fine-tuning)")
    ap.add_argument("--ar-micro-batch", default="16", help="critic.micro_batch, or several comma-separated")
    ap.add_argument("--stages", default="av,ar")
    ap.add_argument("--gemm-n", type=int, default=8192)
    args = step_benchmark.parse_with_dry_run(ap, "benchmarks/results/h200-sft.json")
    if args.dry_run_cpu:
        args.gemm_n = min(args.gemm_n, 512)
    dev = step_benchmark.DEVICE
    shape = step_benchmark.SMALL if args.dry_run_cpu else step_benchmark.QWEN3_8B
    n_rows = max(args.rows, args.ar_rows, 8)
    if args.workdir is None:
        args.workdir = f"/tmp/nla-sft-bench-{'small' if args.dry_run_cpu else '8b'}-{args.layers}l-{n_rows}"
    import peft
    import torch
    import transformers

    from nla_grpo.orchestrator.job import prepare_job
    from nla_grpo.shared.config import build_config

    res: dict = {"config": vars(args), "date": time.strftime("%Y-%m-%d"),
                 "device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu",
                 "torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                 "python": platform.python_version(), "shape": {**shape, "num_hidden_layers": args.layers}}

    def dump():
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))

    res["gemm_before"] = step_benchmark.gemm_peak(args.gemm_n)
    res["gemm_peak_tflops"] = res["gemm_before"]["tflops"]
    print(f"[gemm] {args.gemm_n}^3 {res['gemm_before']['dtype']}: {res['gemm_peak_tflops']:.0f} TFLOP/s", flush=True)
    t0 = time.perf_counter()
    root = step_benchmark.build_workdir(Path(args.workdir), shape, args.layers, n_rows, args.prompt_len, seed=0)
    res["build_s"] = time.perf_counter() - t0
    base_cfg = {
        "model": {"path": str(root / "model"), "dtype": "bfloat16" if dev == "cuda" else "float32"},
        "data": {"parquet": str(root / "rl.parquet"), "eval_fraction": 0.0, "fve_baseline_rows": 8},
        "learner": {"lora_r": args.lora_r, "lora_alpha": 16, "use_rslora": True, "lr": 1e-5, "optimizer": "auto"},
        "grpo": {"prompts_per_step": 8},
        "placement": {"mode": "cpu"},
        "logging": {"eval_every": 0},
    }
    job = prepare_job(build_config(base_cfg, "benchmark"), log=lambda m: None)
    if len(job.train.activations) < n_rows:
        raise SystemExit(f"the workdir {root} holds {len(job.train.activations)} rows, fewer than {n_rows}: use another --workdir")
    res["layer_index"] = job.spec.layer_index
    dump()
    stages = args.stages.split(",")
    if "av" in stages:
        run_av(args, base_cfg, job, res, dump)
    if "ar" in stages:
        run_ar(args, base_cfg, job, res, dump)
    res["gemm_after"] = step_benchmark.gemm_peak(args.gemm_n)
    # the higher of the two readings: MFU is not flattered by a slow first reading
    peak = max(res["gemm_before"]["tflops"], res["gemm_after"]["tflops"])
    res["gemm_peak_tflops"] = peak
    for stage in [res.get("av_sft")] + list(res.get("ar_sft", {}).values()):
        if stage and "executed_tflops" in stage:
            stage["mfu"] = stage["executed_tflops"] / peak
    dump()
    print(f"\nGEMM peak {peak:.0f} TFLOP/s (before {res['gemm_before']['tflops']:.0f}, after {res['gemm_after']['tflops']:.0f})")
    print("| stage | rows/step | tokens/step | step | tokens/s | executed TFLOP/s | MFU | peak memory |\n|---|---|---|---|---|---|---|---|")
    rows = ([("AV-SFT", res["av_sft"])] if "av_sft" in res else []) + [(f"AR-SFT {k}", v) for k, v in res.get("ar_sft", {}).items()]
    for name, s in rows:
        print(f"| {name} | {s['rows']} | {s['tokens']} | {s['step_s']:.3f} s | {s['tokens_per_s']:.0f} | "
              f"{s['executed_tflops']:.0f} | {100 * s['mfu']:.1f}% | {s['peak_gib']:.1f} GiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
