#!/usr/bin/env bash
# Builds (or reuses) the virtual environment of one engine: .venvs/<engine>, with the engine's
# pins from scripts/engines/<engine>.txt, the CPU torch from constraints.txt, and kvtrace itself
# (editable) so the shims run inside the engine's process. Rebuilt only when the pins change.
#   bash scripts/engine-venv.sh vllm
set -euo pipefail
cd "$(dirname "$0")/.."
engine=${1:?usage: engine-venv.sh ENGINE}
pins=scripts/engines/$engine.txt
[ -f "$pins" ] || { echo "no pins for engine '$engine' ($pins)" >&2; exit 2; }
venv=.venvs/$engine
stamp=$venv/.kvtrace-pins
nodeps=scripts/engines/$engine.nodeps.txt
want=$(cat "$pins" $( [ -f "$nodeps" ] && echo "$nodeps" ) constraints.txt pyproject.toml | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  echo "$venv: up to date"
  exit 0
fi
PYTHON=${PYTHON:-python3}
[ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet -c constraints.txt)
"${pip[@]}" --upgrade pip
"${pip[@]}" torch==2.13.0
"${pip[@]}" -r "$pins"
# Packages whose metadata pins accelerator builds go in without their dependencies.
[ -f "$nodeps" ] && "${pip[@]}" --no-deps -r "$nodeps"
# PyPI's torchvision / torchaudio / torchcodec are CUDA builds that fail to import here; the
# engines' text paths run without them.
"$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
# kvtrace itself and the test runner; the collector's test tools (schemathesis and its
# dependencies) stay out of the engine's environment.
"${pip[@]}" -e . "pytest>=8" "hypothesis>=6.100"
echo "$want" > "$stamp"
echo "$venv: built"
