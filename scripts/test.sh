#!/usr/bin/env bash
# Installs everything the tests need and runs them: the linters and the core suite in .venv,
# then each engine's suite in that engine's own venv (.venvs/<engine>, built by
# scripts/engine-venv.sh and reused while its pins are unchanged). Extra arguments go to the
# core pytest run, e.g. `bash scripts/test.sh -k emitter -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/kvtrace-install.sh
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
[ -f .venv/.kvtrace-deps ] || .venv/bin/python -m pip install --quiet --no-cache-dir --upgrade pip
install_kvtrace .venv all,test,torch
# Headless Chromium for the dashboard tests: Debian's package (CI runs as root).
if ! command -v chromium >/dev/null 2>&1; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get install -y -q chromium >/dev/null 2>&1 || { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q chromium >/dev/null; }
fi
# Prometheus and Alertmanager for the alert tests (they scrape and receive from kvtrace alerts).
if ! command -v prometheus >/dev/null 2>&1 || ! command -v prometheus-alertmanager >/dev/null 2>&1; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get install -y -q prometheus prometheus-alertmanager >/dev/null 2>&1 || { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q prometheus prometheus-alertmanager >/dev/null; }
fi
status=0
# Habits: pyflakes, pycodestyle, import order and bugbear (ruff), and imports that run one way
# between the rooms, with no cycles between modules (import-linter's contracts, .importlinter).
.venv/bin/ruff check . || status=1
.venv/bin/lint-imports || status=1
.venv/bin/python -m pytest "$@" || status=$?
for engine in vllm sglang lmcache; do
  bash scripts/engine-venv.sh "$engine"
  ".venvs/$engine/bin/python" -m pytest -o addopts="-ra --strict-markers" "tests/engines/$engine" || status=$?
done
exit $status
