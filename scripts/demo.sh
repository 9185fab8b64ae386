#!/usr/bin/env bash
# Installs kvtrace into .venv and runs `kvtrace demo` on the embedded store.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --no-cache-dir -c constraints.txt -e .
exec .venv/bin/kvtrace demo "$@"
