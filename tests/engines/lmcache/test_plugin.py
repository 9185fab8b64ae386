"""Zero-code enablement: `enable()` instruments every engine built afterwards (one process per
case: the hook is process-wide, as it is in a serving engine), and changes nothing LMCache does:
the same requests, evictions and clears give the same answers with kvtrace on and off, and every
method kvtrace wrapped keeps its original's signature, annotations and name."""

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

    sys.path.insert(0, str(Path(__file__).parents[2]))  # the tests' own helpers
    from transparency import unfaithful

    from kvtrace.instrumentation.hooks import class_patches

    hooked = enable()
    spec = replace(EngineSpec(layers=1, heads=1, head_size=8, chunk_size=64), disk_path=f"{root}/disk")
    engine = build_engine(spec, "plugin")
    driver = Driver(engine, spec)
    tokens = list(range(1, 257))
    served = [driver.serve("r0", tokens), driver.serve("r1", tokens)]
    for i in range(6):  # other prompts, then the first again: some of it from disk now
        served.append(driver.serve(f"o{i}", [(i * 7919 + t) % 30_000 + 1 for t in range(320)]))
    served.append(driver.serve("r2", tokens))
    served.append(driver.serve("t0", tokens, tenant="team-a"))  # another tenant: its own chunks
    engine.clear(tokens)  # an operator's clear of one prefix, then of everything
    served.append(driver.serve("r3", tokens))
    engine.clear()
    served.append(driver.serve("r4", tokens))
    shim = getattr(engine, "_kvtrace_shim", None)
    faces = {**unfaithful(class_patches()), **(unfaithful(shim.hooks.wrapped()) if shim is not None else {})}
    get_emitter().force_flush(timeout_millis=30_000)
    destroy_engine("plugin")  # LMCache's worker threads would otherwise keep the process alive
    print("RESULT " + json.dumps({"hooked": hooked, "shim": shim is not None, "retrieved": served[1].retrieved,
                                  "wrapped": len(shim.hooks) if shim is not None else 0, "faces": faces,
                                  "served": [[s.request_id, s.lookup_hit, s.retrieved, s.exact] for s in served]}))


def run(root: Path, enabled: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, str(root), enabled], capture_output=True, text=True, timeout=120)
    line = next((line for line in proc.stdout.splitlines() if line.startswith("RESULT ")), None)
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(line[7:])


def test_enable_instruments_engines_built_afterwards(tmp_path: Path) -> None:
    out = run(tmp_path, "1")
    assert (out["hooked"], out["shim"], out["retrieved"]) == (True, True, 256)
    events = [e for f in sorted((tmp_path / "spool").iterdir()) for e in iter_file_events(f)]
    assert {e.engine for e in events} == {"lmcache"} and {e.instance for e in events} == {"node-1/lmcache"}
    kinds = {e.kind for e in events}
    assert {EventKind.LOOKUP, EventKind.COMMIT, EventKind.OFFLOAD, EventKind.LOAD, EventKind.ADOPT} <= kinds
    assert {e.engine_version for e in events} == {"0.5.6"}
    assert events[0].kind is EventKind.ATTACH and [e.kind for e in events].count(EventKind.ATTACH) == 1


def test_without_kvtrace_enabled_nothing_is_hooked(tmp_path: Path) -> None:
    out = run(tmp_path, "0")
    assert (out["hooked"], out["shim"], out["retrieved"], out["wrapped"]) == (False, False, 256, 0)
    assert not (tmp_path / "spool").exists() or not any((tmp_path / "spool").iterdir())


def test_lmcache_answers_the_same_with_kvtrace_on_and_every_wrapper_wears_its_face(tmp_path: Path) -> None:
    on, off = run(tmp_path / "on", "1"), run(tmp_path / "off", "0")
    assert on["served"] == off["served"]
    assert on["wrapped"] > 5 and on["faces"] == {}, on["faces"]
    served = {rid: (hit, retrieved, exact) for rid, hit, retrieved, exact in on["served"]}
    # the comparison compared something: reuse, a tenant kept apart, a prefix's clear honoured,
    # and a whole clear that empties the host tier only (r3's chunks come back from disk)
    assert served["r1"] == served["r2"] == served["r4"] == (256, 256, True), served
    assert served["t0"][0] == served["r3"][0] == 0, served


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2])
