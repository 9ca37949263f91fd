#!/usr/bin/env bash
# The GPU checks on a CUDA node: install this package into the interpreter that runs the tests (the
# karvonen classes reach vLLM's own processes only through the package's plugin entry point), check
# that vLLM sees the plugin, then run `pytest tests/test_gpu.py` RUNS times in a row, stopping at the
# first run that is not green. Each run's JUnit XML (per-test times) and log go to OUT_DIR.
#
#   bash benchmarks/gpu_checks.sh [RUNS] [OUT_DIR]        # defaults: 3, /tmp/nla-gpu-checks
#
# The whole file takes 9-13 minutes on an H200 and more on an H100, longer than one device call may run:
# SHARD=K/N runs the K-th of N shares of the collected tests, dealt in turn so the long job tests spread
# (SHARD=1/3, 2/3, 3/3 in three calls, about 5 minutes each on an H100); PYTEST_ARGS passes a selection
# on instead, e.g. PYTEST_ARGS='-k job'.
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:-3}
out=${2:-/tmp/nla-gpu-checks}
py=${PYTHON:-python3}
mkdir -p "$out"
"$py" -c "import torch, vllm; assert torch.cuda.is_available()" 2>/dev/null || { echo "gpu-checks: $py sees no CUDA device or no vLLM"; exit 2; }
"$py" -m pip install -q --no-deps --no-build-isolation -e . || { echo "gpu-checks: installing the package failed"; exit 2; }
"$py" -c "from rollout.vllm.plugin import registered; assert registered()" 2>/dev/null \
  || { echo "gpu-checks: vLLM does not see this package's plugin (entry point vllm.general_plugins) after the install"; exit 2; }
eval "select=(${PYTEST_ARGS:-})"  # shell words, so a quoted -k expression stays one argument
if [ -n "${SHARD:-}" ]; then
  k=${SHARD%/*}; n=${SHARD#*/}
  [[ "$k" =~ ^[0-9]+$ && "$n" =~ ^[0-9]+$ && "$k" -ge 1 && "$k" -le "$n" ]] \
    || { echo "gpu-checks: SHARD: expected K/N with 1 <= K <= N, found '$SHARD'"; exit 2; }
  mapfile -t ids < <("$py" -m pytest tests/test_gpu.py "${select[@]}" --collect-only -q -p no:cacheprovider 2>/dev/null \
    | grep '::')
  select=()
  for j in "${!ids[@]}"; do
    (( j % n == k - 1 )) && select+=("${ids[$j]}")
  done
  [ "${#select[@]}" -gt 0 ] || { echo "gpu-checks: SHARD $SHARD: no test in this share of ${#ids[@]}"; exit 2; }
  echo "gpu-checks: shard $SHARD: ${#select[@]} of ${#ids[@]} tests"
fi
for i in $(seq 1 "$runs"); do
  t0=$(date +%s)
  files=(tests/test_gpu.py); [ -n "${SHARD:-}" ] && files=()  # a shard names its tests by id
  PYTHONUNBUFFERED=1 "$py" -m pytest "${files[@]}" "${select[@]}" -v -s -p no:cacheprovider \
    --junitxml="$out/run$i.xml" > "$out/run$i.log" 2>&1
  rc=$?
  echo "gpu-checks: run $i of $runs: exit $rc in $(( $(date +%s) - t0 )) s; $(grep -E '^=+ .*(passed|failed).* =+$' "$out/run$i.log" | tail -1 | tr -d '=')"
  [ "$rc" = 0 ] || { echo "gpu-checks: run $i is not green; its log: $out/run$i.log"; exit 1; }
done
echo "gpu-checks: $runs runs in a row green"
