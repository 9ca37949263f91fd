# Sourced by deploy/setup-*.sh: the venv each builds, and whether it is already what its inputs describe.
# The caller sets NAME (the stamp's suffix) and IMPORTS (modules that must import) before sourcing.
set -euo pipefail
caller="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"  # before the cd below: $0 may be relative
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${NLA_VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.nla-grpo-setup$NAME"
want=$(cat pyproject.toml "$caller" deploy/venv-lib.sh | sha256sum | cut -c1-16)

venv_is_current() {  # the stamp matches the inputs and the venv imports what it must
  [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VENV/bin/python" -c "import $IMPORTS" 2>/dev/null
}

venv_stamp() { echo "$want" > "$stamp"; }
