"""Run-to-run spread of the tiny job on one GPU: how reliably it learns, to size the GPU test's margins.

Runs ``nla-grpo train deploy/tiny.yaml`` colocated (the GPU test's job) once per seed, all at once on
the one GPU (the tiny model needs a sliver of it), and writes each run's first/last 25-step means of
reward and FVE and its held-out eval FVE. vLLM sleep stays off: it checks the whole device's free
memory and asserts when another job allocates meanwhile (sleep restores the same weights, so the
learning is the same):

    python benchmarks/tiny_spread.py TINY_DIR --seeds 0,1,2 --steps 250 --out benchmarks/results/h200-tiny-spread.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nla_grpo.dataprep.tiny import GPU_OVERRIDES, learning_summary  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tiny_dir", type=Path, help="output of `nla-grpo data tiny`")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    work = Path(tempfile.mkdtemp(prefix="nla-spread-"))
    procs = {}
    t0 = time.time()
    for seed in seeds:
        sets = [f"model.path={args.tiny_dir / 'model'}", f"data.parquet={args.tiny_dir / 'rl.parquet'}", *GPU_OVERRIDES,
                "placement.mode=colocated", "logging.eval_every=50", f"seed={seed}"]
        cmd = [sys.executable, "-m", "nla_grpo.orchestrator.cli", "train", str(ROOT / "deploy/tiny.yaml"), "--run-dir",
               str(work / f"seed{seed}"), "--steps", str(args.steps)] + [a for s in sets for a in ("--set", s)]
        log = open(work / f"seed{seed}.log", "w")
        procs[seed] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=str(ROOT))), log)
    runs = {}
    for seed, (p, log) in procs.items():
        rc = p.wait()
        log.close()
        if rc != 0:
            tail = (work / f"seed{seed}.log").read_text()[-3000:]
            raise SystemExit(f"seed {seed}: exit {rc}\n{tail}")
        rows = [json.loads(l) for l in (work / f"seed{seed}" / "metrics.jsonl").read_text().splitlines()]
        runs[seed] = learning_summary(rows)
        print(f"seed {seed}: {json.dumps(runs[seed])}", flush=True)
    gains = {k: [runs[s][f"{k}_last"] - runs[s][f"{k}_first"] for s in seeds] for k in ("reward", "fve")}
    out = {"steps": args.steps, "seeds": seeds, "wall_s": time.time() - t0, "runs": runs,
           "gain_min": {k: min(v) for k, v in gains.items()}, "gain_max": {k: max(v) for k, v in gains.items()}}
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] for k in ("gain_min", "gain_max", "wall_s")}))


if __name__ == "__main__":
    main()
