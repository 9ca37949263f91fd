"""The learner's update alone on the 8B shape: the packed path against the padded one, in one run.

No rollout engine is needed (no vLLM): the samples are synthetic, ``--prompts`` × ``--group``
responses of ``--new-tokens`` tokens (``--lengths uniform``: 20 to ``--new-tokens``, as real
explanations vary), on the same model, tokenizer and prompts as ``step_benchmark.py``. Each variant
builds its own ``Learner`` on the same weights and times ``--steps`` updates (the first warms up).
FLOPs are counted two ways (``learner.update_metrics``): ``tflops_effective``, 6·N per logical token
(every sample's prompt + response, what the update is asked to do, whatever it skips), and
``tflops_executed``, 6·N per token the rows actually ran (a group's prompt once, no padding), N the
base model's parameters. ``mfu`` divides the executed figure by a bf16 GEMM peak measured on the
same GPU in the same run (the higher of a reading before and one after the variants).

    python benchmarks/learner_benchmark.py --prompts 64 --group 8 --out benchmarks/results/h200-learner-64x8.json
    python benchmarks/learner_benchmark.py --profile benchmarks/results/h200-learner-profile.txt
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_timeline  # noqa: E402
from gpu_monitor import SmiPoll  # noqa: E402
import step_benchmark  # noqa: E402  (the shared workload)

VARIANTS = {
    "padded": {"forward": "padded", "micro_batch": 8, "kernels": "none", "attention": "sdpa"},
    "packed": {"forward": "packed", "micro_batch": "auto", "kernels": "none", "attention": "sdpa"},
    # every sample its own row (no shared prompt): what bf16 LoRA + the chunked head give alone
    "packed_unshared": {"forward": "packed", "micro_batch": "auto", "kernels": "none", "attention": "sdpa",
                        "unshared": True},
    # learner.kernels: the decoder's elementwise chains fused
    "liger": {"forward": "packed", "micro_batch": "auto", "kernels": "liger", "attention": "sdpa"},
    "compile": {"forward": "packed", "micro_batch": "auto", "kernels": "compile", "attention": "sdpa"},
    # learner.attention: flex, FlexAttention's block mask instead of the dense one
    "flex": {"forward": "packed", "micro_batch": "auto", "kernels": "none", "attention": "flex"},
    "liger_flex": {"forward": "packed", "micro_batch": "auto", "kernels": "liger", "attention": "flex"},
    # learner.attention: varlen, flash-attention's variable-length kernel, a segment per response
    "varlen": {"forward": "packed", "micro_batch": "auto", "kernels": "none", "attention": "varlen"},
    "liger_varlen": {"forward": "packed", "micro_batch": "auto", "kernels": "liger", "attention": "varlen"},
    # the earlier LoRA order: base GEMM, then an out-of-place addmm of the LoRA term (learner.lora_compute)
    "liger_flex_addmm": {"forward": "packed", "micro_batch": "auto", "kernels": "liger", "attention": "flex",
                         "accumulate_in_base": False},
    # grpo.kl_beta 0: no reference forward
    "packed_no_reference": {"forward": "packed", "micro_batch": "auto", "kernels": "none", "attention": "sdpa",
                            "kl_beta": 0.0},
    "liger_flex_no_reference": {"forward": "packed", "micro_batch": "auto", "kernels": "liger", "attention": "flex",
                                "kl_beta": 0.0},
}


def synthetic_samples(job, prompts: int, group: int, new_tokens: int, lengths: str, seed: int):
    import torch

    from nla_grpo.shared.types import Sample

    gen = torch.Generator().manual_seed(seed)
    vocab = 256  # the small benchmark tokenizer's byte range: plain text tokens
    samples = []
    for p in range(prompts):
        ids, site = job.prompt_ids[int(job.prompt_index_train[p])]
        for g in range(group):
            n = new_tokens if lengths == "fixed" else int(torch.randint(20, new_tokens + 1, (1,), generator=gen))
            resp = torch.randint(3, vocab, (n,), generator=gen).tolist()
            samples.append(Sample(row_id=p, group_index=g, prompt_ids=list(ids), site=site, response_ids=resp,
                                  logprobs=[-5.0] * n, text="", finish_reason="length", adapter_version=1))
    return samples


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    step_benchmark.add_workload_args(ap, steps=3)
    ap.add_argument("--lengths", choices=["fixed", "uniform"], default="fixed")
    ap.add_argument("--variants", default="padded,packed,packed_unshared")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--profile", help="write a torch-profiler table of one update of each packed variant here "
                    "(PATH-<variant>.txt), and the GPU's idle time with the host ops it went to (PATH-<variant>-timeline.txt)")
    ap.add_argument("--profile-prompts", type=int, default=8, help="prompts (groups) in the profiled update")
    ap.add_argument("--gemm-n", type=int, default=8192, help="size of the square bf16 matmul that measures the GEMM peak")
    ap.add_argument("--kl-beta", type=float, default=0.04, help="grpo.kl_beta (0: no reference forward)")
    ap.add_argument("--gemm-seconds", type=float, default=10.0,
                    help="how long the sustained GEMM rate runs (matmuls back to back, the clock a long load holds)")
    args = step_benchmark.parse_with_dry_run(ap, "benchmarks/results/h200-learner.json")
    dev = step_benchmark.DEVICE
    import torch

    from nla_grpo.learner import lora_compute
    from nla_grpo.learner.grpo import group_advantages
    from nla_grpo.orchestrator.job import prepare_job
    from nla_grpo.learner.learner import Learner
    from nla_grpo.shared.config import build_config

    root = step_benchmark.build_workdir(Path(args.workdir), step_benchmark.SMALL if args.dry_run_cpu else step_benchmark.QWEN3_8B,
                                        args.layers, args.prompts, args.prompt_len, seed=0)
    base_cfg = {
        "model": {"path": str(root / "model"), "dtype": "bfloat16" if dev == "cuda" else "float32"},
        "data": {"parquet": str(root / "rl.parquet"), "eval_fraction": 0.0, "fve_baseline_rows": 8},
        "rollout": {"group_size": args.group, "max_new_tokens": args.new_tokens, "sleep_during_update": False},
        "learner": {"lora_r": args.lora_r, "lora_alpha": 16, "use_rslora": True, "lr": 1e-6, "optimizer": "adamw",
                    "gradient_checkpointing": args.gradient_checkpointing,
                    "mismatch_mask_k3": 1e9},  # synthetic rollout logprobs: nothing may be masked out of the loss
        "grpo": {"prompts_per_step": args.prompts, "kl_beta": args.kl_beta},
        # the learner alone: on a GPU as one colocated learner would run (no critic step, no engine to wake)
        "placement": {"mode": "colocated" if dev == "cuda" else "cpu"},
        "critic": {"train": False},
        "logging": {"eval_every": 0},
    }
    job = prepare_job(build_config(base_cfg, "benchmark"), log=lambda m: None)
    samples = synthetic_samples(job, args.prompts, args.group, args.new_tokens, args.lengths, seed=0)
    vectors = torch.from_numpy(job.train.activations[: args.prompts]).repeat_interleave(args.group, 0)
    adv = group_advantages(torch.randn(len(samples), generator=torch.Generator().manual_seed(1)),
                           torch.arange(args.prompts).repeat_interleave(args.group)).tolist()
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    res: dict = {"config": vars(args), "device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu",
                 "torch": torch.__version__, "samples": len(samples), "tokens": tokens, "variants": {}}

    res["gemm_before"] = step_benchmark.gemm_peak(args.gemm_n)
    print(f"[gemm] {args.gemm_n}^3: {res['gemm_before']['tflops']:.0f} TFLOP/s", flush=True)

    def dump():
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))

    for name in args.variants.split(","):
        spec = dict(VARIANTS[name])
        unshared = spec.pop("unshared", False)
        lora_compute.ACCUMULATE_IN_BASE = spec.pop("accumulate_in_base", True)
        if spec["forward"] == "packed":
            spec["micro_batch"] = args.micro_batch
        grpo = {**base_cfg["grpo"], **({"kl_beta": spec.pop("kl_beta")} if "kl_beta" in spec else {})}
        cfg = build_config({**base_cfg, "learner": {**base_cfg["learner"], **spec}, "grpo": grpo}, "benchmark")
        learner = Learner(cfg, job.spec, dev)
        vecs = vectors
        if unshared:  # a distinct activation per sample: no two samples share a row
            vecs = vectors + 1e-3 * torch.arange(len(samples)).unsqueeze(1)
        n_base = learner.base_params
        times, peaks, executed, metrics, clocks = [], [], [], None, []
        for k in range(args.steps):
            step_benchmark.reset_peak()
            with SmiPoll(("clocks.sm", "power.draw")) as smi:
                metrics, t = step_benchmark.timed(lambda: learner.update(samples, adv, vecs))
            times.append(t)
            peaks.append(step_benchmark.peak_gb())
            executed.append(metrics["learner/tflops_executed"])
            clocks.append(smi.summary())
            print(f"[{name} {k}] {t:.2f}s peak {peaks[-1]:.1f} GB executed {metrics['learner/tflops_executed']:.0f} "
                  f"TFLOP/s effective {metrics['learner/tflops_effective']:.0f} mb tokens "
                  f"{metrics['learner/micro_batch_tokens']}", flush=True)
        warm = times[1:] or times
        med = statistics.median(warm)
        res["variants"][name] = {
            "learner": spec, "unshared": unshared, "update_s": med, "times": times, "peak_gb": max(peaks),
            "learner_tflops": 6 * n_base * tokens / med / 1e12, "tokens_per_s": tokens / med,
            "executed_tokens": metrics["learner/executed_tokens"],
            "tflops_executed": statistics.median(executed[1:] or executed),
            "micro_batch_tokens": learner.micro_batch_tokens, "base_params": n_base,
            "last_metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))},
            "gpu_poll": clocks,  # per update: SM clock (MHz) and board power (W) while it ran
        }
        dump()
        if args.profile and spec["forward"] == "packed" and not unshared:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
            few = args.profile_prompts * args.group  # a shorter trace of the same kernels
            with profile(activities=acts) as prof:
                learner.update(samples[:few], adv[:few], vecs[:few])
                step_benchmark.sync()
            key = "cuda_time_total" if dev == "cuda" else "cpu_time_total"
            out = Path(f"{args.profile.removesuffix('.txt')}-{name}.txt")
            out.write_text(prof.key_averages().table(sort_by=key, row_limit=45))
            # what the kernel table cannot show: the time no kernel ran, and the host ops it went to
            timeline = gpu_timeline.timeline_report(*gpu_timeline.spans_from_profiler(prof))
            res["variants"][name]["timeline"] = {"prompts": args.profile_prompts, **timeline}
            out.with_name(out.stem + "-timeline.txt").write_text(gpu_timeline.format_report(timeline) + "\n")
            print(f"[{name} profile] GPU busy {timeline['busy']:.1%} of {timeline['window_ms']:.0f} ms", flush=True)
            dump()
        learner = None  # free the GPU before the next variant
        if dev == "cuda":
            torch.cuda.empty_cache()
    res["gemm_after"] = step_benchmark.gemm_peak(args.gemm_n)
    res["gemm_peak_tflops"] = max(res["gemm_before"]["tflops"], res["gemm_after"]["tflops"])
    with SmiPoll(("clocks.sm", "power.draw")) as smi:
        res["gemm_sustained"] = step_benchmark.gemm_sustained(args.gemm_n, args.gemm_seconds)
    res["gemm_sustained"]["gpu_poll"] = smi.summary()
    for v in res["variants"].values():
        v["mfu"] = v["tflops_executed"] / res["gemm_peak_tflops"]
        # against the rate matmuls hold under a long load: what is left to the kernels and the host
        v["mfu_sustained"] = v["tflops_executed"] / res["gemm_sustained"]["tflops"]
    print(f"[gemm] peak {res['gemm_peak_tflops']:.0f} TFLOP/s (after: {res['gemm_after']['tflops']:.0f}); "
          f"sustained {res['gemm_sustained']['tflops']:.0f} over {args.gemm_seconds:.0f} s, SM clock "
          f"{res['gemm_sustained']['gpu_poll']['clocks.sm']['median']:.0f} MHz", flush=True)
    base = res["variants"].get("padded")
    for name, v in res["variants"].items():
        ratio = base["update_s"] / v["update_s"] if base else float("nan")
        print(f"| {name} | {v['update_s']:.2f} s | {v['tflops_executed']:.0f} TFLOP/s executed, MFU {v['mfu']:.1%} "
              f"({v['mfu_sustained']:.1%} of sustained) | "
              f"{v['learner_tflops']:.0f} effective | {v['peak_gb']:.1f} GB | {ratio:.2f}x |")
    dump()
    return 0


if __name__ == "__main__":
    sys.exit(main())
