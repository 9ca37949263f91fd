#!/usr/bin/env bash
# The tiny CPU demo end to end: environment, tiny model and dataset, data check, then the job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup-cpu.sh
. "${NLA_VENV:-.venv}/bin/activate"
[ -f tiny/rl.parquet ] || nla-grpo data tiny tiny
nla-grpo data check tiny/rl.parquet
if nla-grpo train deploy/tiny.yaml; then exit 0; else rc=$?; fi
if [ "$rc" = 3 ]; then
  echo "demo: data and config are ready; the GRPO job itself is not built yet (rollout, critic and learner services come next)."
  exit 0
fi
exit "$rc"
