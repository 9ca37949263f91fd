"""Host time the adapted linears cost per micro-batch, whatever the device: the learner's LoRA forward with the
adapter casts made per forward against casts reused across micro-batches (``learner.lora_compute.reusing_casts``).

A stack of PEFT LoRA linears as many as the 8B shape's decoder has (36 layers x 7), bf16 activations over fp32
adapter weights, at a width and a token count so small that the arithmetic is nothing and what is timed is what
the host spends dispatching ops and recording autograd. Each micro-batch is a policy forward + backward and a
reference-like forward without gradients, as the update runs them; the ops dispatched are counted too.

    python3 benchmarks/lora_host_overhead.py --out benchmarks/results/cpu-lora-host-overhead.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build(layers: int, width: int, rank: int, dtype):
    import torch
    from peft import LoraConfig, get_peft_model

    from nla_grpo.learner import lora_compute

    torch.manual_seed(0)
    names = [f"{i}" for i in range(layers)]
    net = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in names]).to(dtype)
    model = get_peft_model(net, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=names, lora_dropout=0.0))
    lora_compute.install(model)
    return model


def micro_batches(model, xs, reuse: bool) -> tuple[float, int]:
    """Seconds and ops for the micro-batches ``xs``: each a forward + backward, then a forward without gradients."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from nla_grpo.learner import lora_compute

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    def run():
        with lora_compute.reusing_casts() if reuse else contextlib.nullcontext():
            for x in xs:
                model(x).float().sum().backward()
                with torch.no_grad():
                    model(x)

    t0 = time.perf_counter()
    run()
    seconds = time.perf_counter() - t0
    Count.n = 0
    with Count():
        run()
    return seconds, Count.n


def main() -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--linears", type=int, default=36 * 7, help="adapted linears (the 8B shape: 36 layers x 7)")
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/cpu-lora-host-overhead.json")
    args = ap.parse_args()
    model = build(args.linears, 32, 8, torch.bfloat16)
    xs = [torch.randn(8, 32, generator=torch.Generator().manual_seed(k)).bfloat16() for k in range(args.micro_batches)]
    res = {"device": "cpu", "torch": torch.__version__, "config": vars(args), "modes": {}}
    for _ in range(2):  # warm-up of both
        micro_batches(model, xs, False), micro_batches(model, xs, True)
    for name, reuse in (("cast_per_forward", False), ("casts_reused", True)):
        runs = [micro_batches(model, xs, reuse) for _ in range(args.repeats)]
        per_mb = [s / args.micro_batches for s, _ in runs]
        res["modes"][name] = {"seconds_per_micro_batch": statistics.median(per_mb), "runs": per_mb,
                              "ops_per_micro_batch": runs[0][1] / args.micro_batches}
        print(f"{name}: {1e3 * statistics.median(per_mb):.1f} ms and {runs[0][1] / args.micro_batches:.0f} ops "
              f"per micro-batch ({args.linears} adapted linears)", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
