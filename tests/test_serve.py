"""`kvtrace serve` in its own process: the collector, the dashboard and the alert rules over the
one embedded store it holds; a second command on that store is told, in one line, whose it is."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from collector_proc import CollectorProcess, commits, send_until_acked

from kvtrace.store.owner import OWNER_FILE


class ServeProcess(CollectorProcess):
    command = "serve"


def _log(proc: ServeProcess) -> str:
    return (proc.root / "collector.log").read_text()


def _cli(proc: ServeProcess, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtrace.cli.main", *argv], env=proc.env(), capture_output=True,
                          text=True, timeout=120)



def _stop(proc: ServeProcess, sig: int) -> int:
    proc.proc.send_signal(sig)
    code = proc.proc.wait(120)
    proc.log.close()
    return code


def _stopped_cleanly(proc: ServeProcess, tmp_path: Path, code: int, expected: int) -> None:
    """The exit status an operator's signal asks for, the spool drained, the owner file gone."""
    assert code == expected, _log(proc)[-3000:]
    assert "stopped: spool drained into the store" in _log(proc)
    assert not (tmp_path / "db" / OWNER_FILE).exists()

def test_serve_ingests_shows_the_dashboard_alerts_and_owns_the_store(tmp_path: Path) -> None:
    proc = ServeProcess(tmp_path, "--alert-interval-s", "1")
    proc.start()
    try:
        owner = json.loads((tmp_path / "db" / OWNER_FILE).read_text())
        assert owner["pid"] == proc.proc.pid and owner["command"] == "kvtrace serve" and owner["url"] == proc.url

        # Ingest: a batch with a sequence gap (seq 10..19 never sent), stored through the spool.
        events = commits(0, 10, time.time_ns()) + commits(20, 10, time.time_ns())
        send_until_acked(proc.url, 1, events)
        proc.wait_drained()
        stored = httpx.get(proc.url + "/v1/events", params={"instance": "crash-test"}, timeout=30).json()
        assert sorted(r["seq"] for r in stored) == [*range(10), *range(20, 30)]

        # The dashboard, under /dashboard/ on the same port, over the same store.
        page = httpx.get(proc.url + "/dashboard/", timeout=60)
        assert page.status_code == 200 and "Hit funnel" in page.text
        assert httpx.get(proc.url + "/dashboard", timeout=30).status_code == 307
        health = httpx.get(proc.url + "/dashboard/health", timeout=60)
        assert health.status_code == 200 and "Event streams" in health.text
        assert httpx.get(proc.url + "/dashboard/no-such-page", timeout=30).status_code == 404

        # The alert thread evaluates the built-in rules: the gap fires.
        deadline = time.monotonic() + 60
        while "FIRING   event-stream-gaps instance=crash-test value=10" not in _log(proc):
            assert time.monotonic() < deadline, _log(proc)[-3000:]
            time.sleep(0.5)
        assert "alert evaluation failed" not in _log(proc)

        # Another command on the store: one line, naming the holder and the way out.
        out = _cli(proc, "db", "status")
        assert out.returncode == 1 and out.stdout == ""
        assert out.stderr == (f"error: the embedded store at {tmp_path / 'db'} is in use by another process "
                              f"(pid {proc.proc.pid}, `kvtrace serve` on {proc.url}); stop it, or use that "
                              "process's dashboard/collector, or point --dsn at a ClickHouse server\n")
        # ... and so is a second `serve` on it, before it binds anything.
        out = _cli(proc, "serve", "--port", "1")
        assert out.returncode == 1 and out.stderr.count("\n") == 1 and "is in use by another process" in out.stderr
    finally:
        code = _stop(proc, signal.SIGTERM)
    _stopped_cleanly(proc, tmp_path, code, 0)
    assert proc.query("SELECT count() AS n FROM kvtrace.events FINAL") == [{"n": 20}]
    out = _cli(proc, "db", "status")  # the store is free again
    assert out.returncode == 0 and "events                   20 rows" in out.stdout, out


def test_ctrl_c_stops_serve_with_130(tmp_path: Path) -> None:
    proc = ServeProcess(tmp_path, "--no-alerts")
    proc.start()
    _stopped_cleanly(proc, tmp_path, _stop(proc, signal.SIGINT), 130)


def test_serve_refuses_a_bad_rule_file_before_serving(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - name: x\n    kind: nonsense\n")
    out = _cli(ServeProcess(tmp_path), "serve", "--rules", str(rules))
    assert out.returncode == 2 and out.stderr.startswith("error: ") and out.stderr.count("\n") == 1, out.stderr
    assert not (tmp_path / "db" / OWNER_FILE).exists()
