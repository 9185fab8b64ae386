#!/usr/bin/env bash
# Installs kvtrace into .venv and runs `kvtrace demo` on the embedded store.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/kvtrace-install.sh
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
[ -f .venv/.kvtrace-deps ] || .venv/bin/python -m pip install --quiet --no-cache-dir --upgrade pip
install_kvtrace .venv all
exec .venv/bin/kvtrace demo "$@"
