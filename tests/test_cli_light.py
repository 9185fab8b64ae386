"""The `kvtrace` parser is light: `--help` loads no store, DataFrame or web stack and works with
kvtrace's core alone; a command whose extra is missing names it in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("polars", "pyarrow", "clickhouse_connect", "chdb", "duckdb", "numpy", "fastapi", "uvicorn", "plotly",
         "torch", "yaml", "zmq", "prometheus_client", "opentelemetry")

# Runs `main(argv)` in a fresh interpreter where the heavy modules cannot be imported (as with
# only the core installed), then reports the exit code and which heavy modules were loaded.
_PROBE = """
import importlib.abc, json, sys
HEAVY = set(json.loads(sys.argv[1]))

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HEAVY:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

if sys.argv[2] == "absent":
    sys.meta_path.insert(0, Absent())
from kvtrace.cli.main import main
try:
    code = main(json.loads(sys.argv[3]))
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "loaded": sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)}),
      file=sys.stderr)
"""


def run(argv: list[str], absent: bool) -> tuple[int, str, list[str]]:
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(HEAVY), "absent" if absent else "present",
                           json.dumps(argv)], capture_output=True, text=True, timeout=120)
    *err, last = proc.stderr.strip().splitlines()
    report = json.loads(last)
    return report["code"], proc.stdout + "\n".join(err), report["loaded"]


COMMANDS = ["demo", "db", "ingest", "export", "replay", "verify", "experiment", "analyze", "costs", "capacity",
            "report", "calibrate", "collector", "dashboard", "grafana", "alerts", "schema", "serve"]


@pytest.mark.parametrize("absent", [False, True], ids=["installed", "core-only"])
def test_help_loads_nothing_heavy(absent: bool) -> None:
    code, out, loaded = run(["--help"], absent)
    assert code == 0 and loaded == [], out
    for command in COMMANDS:
        assert f"    {command}" in out, command
    for command in COMMANDS:
        code, out, loaded = run([command, "--help"], absent)
        assert code == 0 and loaded == [] and f"usage: kvtrace {command}" in out, (command, out)


def test_a_missing_extra_is_named_in_one_line(tmp_path) -> None:  # noqa: ANN001
    # Each command names the extra that makes the whole command work, not the extra of the first
    # module it found missing (a collector without pyarrow needs `collector`, not `arrow`).
    for argv, extra in ((["export", "-o", str(tmp_path / "x.parquet")], "store"),
                        (["replay", str(tmp_path / "t.jsonl")], "store"),
                        (["analyze", "--recipe", "dense"], "analysis"),
                        (["report", "--recipe", "dense"], "dashboards"),
                        (["collector"], "collector"),
                        (["dashboard"], "dashboards"),
                        (["alerts", "--once"], "dashboards"),
                        (["serve"], "all")):
        code, out, _ = run(["--dsn", f"chdb://{tmp_path}/db", *argv], absent=True)
        assert code == 1, (argv, out)
        assert f"error: kvtrace {argv[0]}: this command needs kvtrace's {extra!r} extra" in out, (argv, out)
