#!/usr/bin/env bash
# Idempotent GPU environment for one node: a venv with CUDA torch, vLLM, bitsandbytes, Ray and this package
# (editable, with its vLLM plugin), then `nla-grpo doctor` on it. On a Ray cluster, run it on every node at the
# same path (or bake it into the nodes' image): the actors import this package from each node's environment.
#   bash deploy/setup-gpu.sh                      # .venv here
#   NLA_VENV=/opt/nla PYTHON=python3.12 NLA_RUN_ROOT=/shared/runs bash deploy/setup-gpu.sh
NAME="-gpu" IMPORTS="vllm, ray, peft, bitsandbytes, shared"
. "$(dirname "$0")/venv-lib.sh"
if venv_is_current; then
  echo "setup: $VENV is up to date"
else
  echo "setup: building $VENV (several minutes the first time: vLLM brings its CUDA torch)"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q -U pip
  "$VENV/bin/python" -m pip install -q -e '.[gpu,test]'
  venv_stamp
fi
"$VENV/bin/python" -m nla_grpo.orchestrator.cli doctor --run-dir "${NLA_RUN_ROOT:-runs}"
