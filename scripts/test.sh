#!/usr/bin/env bash
# Installs everything the tests need and runs them: the core suite in .venv, then each engine's
# suite in that engine's own venv (.venvs/<engine>, built by scripts/engine-venv.sh and reused
# while its pins are unchanged). Extra arguments go to the core pytest run, e.g.
# `bash scripts/test.sh -k emitter -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
stamp=.venv/.kvtrace-pins
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --no-cache-dir --upgrade pip
  .venv/bin/python -m pip install --quiet --no-cache-dir -c constraints.txt -e '.[test,torch]'
  echo "$want" > "$stamp"
fi
# Headless Chromium for the dashboard tests: Debian's package (CI runs as root).
if ! command -v chromium >/dev/null 2>&1; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get install -y -q chromium >/dev/null 2>&1 || { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q chromium >/dev/null; }
fi
status=0
.venv/bin/python -m pytest "$@" || status=$?
for engine in vllm sglang lmcache; do
  bash scripts/engine-venv.sh "$engine"
  ".venvs/$engine/bin/python" -m pytest -o addopts="-ra --strict-markers" "tests/engines/$engine" || status=$?
done
exit $status
