#!/usr/bin/env bash
# The tiny CPU demo end to end: environment, tiny model and dataset, data check, then the GRPO job
# (real vLLM on the CPU, Ray actors). About 3–5 minutes on 2 cores; the reward and FVE rise.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup-cpu.sh
. "${NLA_VENV:-.venv}/bin/activate"
[ -f tiny/rl.parquet ] || nla-grpo data tiny tiny
nla-grpo data check tiny/rl.parquet
run="runs/tiny-demo-$(date +%Y%m%d-%H%M%S)"
nla-grpo train deploy/tiny.yaml --run-dir "$run" "$@"
echo "demo: metrics in $run/metrics.jsonl, curves in $run/plots/curves.png"
