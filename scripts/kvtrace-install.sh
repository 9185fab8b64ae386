# Sourced by the other scripts: installs kvtrace into a venv, editable, as a link tree.
#
# setuptools' strict editable mode builds a tree of links to the sources (under build/), which
# static tools (type checkers, code maps) follow like any installed package; the default mode
# maps the namespace with an import hook they cannot see. A link tree does not see a module
# added or removed later, so the install is redone (without dependencies: seconds) whenever the
# list of kvtrace's files (or a C source's content) changes, and redone whole when kvtrace's dependencies or the pins do.

kvtrace_deps_stamp() {
  # What pip resolves for kvtrace: its dependencies and extras, and the constraints.
  "${PYTHON:-python3}" -c 'import json, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
print(json.dumps([project["dependencies"], project["optional-dependencies"]], sort_keys=True))' \
    | cat - constraints.txt | sha256sum | cut -c1-16
}

kvtrace_tree_stamp() {
  { cat setup.py
    find schema store instrumentation collector analysis dashboards cli -type f \
      \( -name '*.py' -o -name '*.c' -o -path 'cli/data/*' \) -not -path '*/__pycache__/*' | LC_ALL=C sort
    # A compiled module is built from its source's content, not linked: a changed source rebuilds.
    find schema store instrumentation collector analysis dashboards cli -type f -name '*.c' | LC_ALL=C sort \
      | xargs -r cat
  } | sha256sum | cut -c1-16
}

# install_kvtrace VENV EXTRAS: kvtrace[EXTRAS] into VENV, or only its links when that is enough.
install_kvtrace() {
  local venv=$1 extras=$2 want tree
  want="$(kvtrace_deps_stamp) $extras"
  tree=$(kvtrace_tree_stamp)
  local pip=("$venv/bin/python" -m pip install --quiet --no-cache-dir -c constraints.txt
             --config-settings editable_mode=strict)
  if [ "$(cat "$venv/.kvtrace-deps" 2>/dev/null)" != "$want" ]; then
    "${pip[@]}" -e ".[$extras]"
    echo "$want" > "$venv/.kvtrace-deps"
  elif [ "$(cat "$venv/.kvtrace-tree" 2>/dev/null)" != "$tree" ]; then
    "${pip[@]}" --no-deps -e .
  fi
  echo "$tree" > "$venv/.kvtrace-tree"
}
