#!/usr/bin/env bash
# Builds (or reuses) the virtual environment of one engine: .venvs/<engine>, with the engine's
# pins from scripts/engines/<engine>.txt, the CPU torch from constraints.txt, and kvtrace itself
# (editable, with the extras the engine tests use) so the shims run inside the engine's process.
# Rebuilt only when the pins, or kvtrace's own dependencies, change.
#   bash scripts/engine-venv.sh vllm
# An engine that runs inside another (LMCache is vLLM's KV connector) names that engine in
# scripts/engines/<engine>.base: its venv holds only its own packages and sees the base venv's
# site-packages behind them, as it would in the base engine's process, so the several GB of
# vLLM, torch and triton sit on disk once.
# pip keeps no cache (--no-cache-dir): the wheels would double the disk the venvs take.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/kvtrace-install.sh
engine=${1:?usage: engine-venv.sh ENGINE}
pins=scripts/engines/$engine.txt
[ -f "$pins" ] || { echo "no pins for engine '$engine' ($pins)" >&2; exit 2; }
venv=.venvs/$engine
stamp=$venv/.kvtrace-pins
nodeps=scripts/engines/$engine.nodeps.txt
basefile=scripts/engines/$engine.base
base=""
if [ -f "$basefile" ]; then
  base=$(tr -d '[:space:]' < "$basefile")
  bash "$0" "$base"
fi
want=$( { cat "$pins" $( [ -f "$nodeps" ] && echo "$nodeps" ) constraints.txt; kvtrace_deps_stamp;
          [ -n "$base" ] && cat ".venvs/$base/.kvtrace-pins"; true; } | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  # A layered venv (LMCache over vLLM) uses its base's kvtrace; any other is linked again
  # when modules came or went.
  [ -n "$base" ] || install_kvtrace "$venv" all
  echo "$venv: up to date"
  exit 0
fi
PYTHON=${PYTHON:-python3}
pip=(-m pip install --quiet --no-cache-dir -c constraints.txt)
if [ -n "$base" ]; then
  # A fresh venv each time: what an earlier build put here must not shadow the base.
  rm -rf "$venv"
  "$PYTHON" -m venv "$venv"
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  base_site=$(".venvs/$base/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  # Processed at start-up: the base's packages (and its .pth files, kvtrace's editable install
  # among them) come after this venv's own.
  echo "import site; site.addsitedir('$(cd "$base_site" && pwd)')" > "$site/_kvtrace_base_$base.pth"
  "$venv/bin/python" "${pip[@]}" -r "$pins"
  [ -f "$nodeps" ] && "$venv/bin/python" "${pip[@]}" --no-deps -r "$nodeps"
  echo "$want" > "$stamp"
  echo "$venv: built (over .venvs/$base)"
  exit 0
fi
[ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
py=("$venv/bin/python" "${pip[@]}")
"${py[@]}" --upgrade pip
"${py[@]}" torch==2.13.0
"${py[@]}" -r "$pins"
# Packages whose metadata pins accelerator builds go in without their dependencies.
[ -f "$nodeps" ] && "${py[@]}" --no-deps -r "$nodeps"
# PyPI's torchvision / torchaudio / torchcodec are CUDA builds that fail to import here; the
# engines' text paths run without them.
"$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
# kvtrace itself (what the engine tests read events with: the store and the analysis too) and
# the test runner; the collector's test tools (schemathesis and its dependencies) stay out of
# the engine's environment.
rm -f "$venv/.kvtrace-deps"
install_kvtrace "$venv" all
"${py[@]}" "pytest>=8" "hypothesis>=6.100"
echo "$want" > "$stamp"
echo "$venv: built"
