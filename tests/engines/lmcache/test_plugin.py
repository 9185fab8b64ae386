"""Zero-code enablement: `enable()` instruments every engine built afterwards (one process per
case: the hook is process-wide, as it is in a serving engine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvtrace.schema import EventKind
from kvtrace.store.ingest import iter_file_events


def child(root: str, enabled: str) -> None:
    os.environ.update({"KVTRACE_ENABLED": enabled, "KVTRACE_SINK": "spool", "KVTRACE_SPOOL_DIR": f"{root}/spool",
                       "KVTRACE_INSTANCE": "node-1"})
    from dataclasses import replace

    from kvtrace.instrumentation.api import get_emitter
    from kvtrace.instrumentation.lmcache.cpu import EngineSpec, build_engine, destroy_engine
    from kvtrace.instrumentation.lmcache.driver import Driver
    from kvtrace.instrumentation.lmcache.plugin import enable

    hooked = enable()
    spec = replace(EngineSpec(layers=1, heads=1, head_size=8, chunk_size=64), disk_path=f"{root}/disk")
    engine = build_engine(spec, "plugin")
    driver = Driver(engine, spec)
    tokens = list(range(1, 257))
    served = [driver.serve("r0", tokens), driver.serve("r1", tokens)]
    get_emitter().force_flush(timeout_millis=30_000)
    destroy_engine("plugin")  # LMCache's worker threads would otherwise keep the process alive
    print("RESULT " + json.dumps({"hooked": hooked, "shim": hasattr(engine, "_kvtrace_shim"),
                                  "retrieved": served[1].retrieved}))


def run(root: Path, enabled: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, str(root), enabled], capture_output=True, text=True, timeout=120)
    line = next((line for line in proc.stdout.splitlines() if line.startswith("RESULT ")), None)
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(line[7:])


def test_enable_instruments_engines_built_afterwards(tmp_path: Path) -> None:
    out = run(tmp_path, "1")
    assert out == {"hooked": True, "shim": True, "retrieved": 256}
    events = [e for f in sorted((tmp_path / "spool").iterdir()) for e in iter_file_events(f)]
    assert {e.engine for e in events} == {"lmcache"} and {e.instance for e in events} == {"node-1/lmcache"}
    kinds = {e.kind for e in events}
    assert {EventKind.LOOKUP, EventKind.COMMIT, EventKind.OFFLOAD, EventKind.LOAD, EventKind.ADOPT} <= kinds
    assert {e.engine_version for e in events} == {"0.5.6"}
    assert events[0].kind is EventKind.ATTACH and [e.kind for e in events].count(EventKind.ATTACH) == 1


def test_without_kvtrace_enabled_nothing_is_hooked(tmp_path: Path) -> None:
    out = run(tmp_path, "0")
    assert out == {"hooked": False, "shim": False, "retrieved": 256}
    assert not (tmp_path / "spool").exists() or not any((tmp_path / "spool").iterdir())


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2])
