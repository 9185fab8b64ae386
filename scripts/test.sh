#!/usr/bin/env bash
# Installs everything the tests need into .venv (reused while the pins are unchanged) and runs
# the test suite. Extra arguments go to pytest, e.g. `bash scripts/test.sh -k emitter -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
stamp=.venv/.kvtrace-pins
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -c constraints.txt -e '.[test]'
  echo "$want" > "$stamp"
fi
exec .venv/bin/python -m pytest "$@"
