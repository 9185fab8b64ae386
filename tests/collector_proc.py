"""A `kvtrace collector` in its own process (its own embedded store), for crash and outage tests,
and a sender that keeps re-sending a batch until the collector acknowledges it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvtrace.schema.arrow_wire import ARROW_TYPE, Envelope, encode_columns
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import ComponentKind, EventKind, Tier
from kvtrace.schema.wire import CONTENT_TYPE, Batch, encode_batch

SOURCE = 0x5EED


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class CollectorProcess:
    command = "collector"  # `serve` runs the same collector, with the dashboard and alerts beside it

    def __init__(self, root: Path, *extra: str) -> None:
        self.root = root
        self.dsn = f"chdb://{root / 'db'}"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = open(root / "collector.log", "ab")  # noqa: SIM115 - closed in stop()

    def env(self) -> dict[str, str]:
        return {**os.environ, "KVTRACE_HOME": str(self.root), "KVTRACE_DSN": self.dsn,
                "KVTRACE_COLLECTOR_SPOOL_DIR": str(self.root / "spool")}

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvtrace.cli.main", self.command, "--port", str(self.port), *self.extra],
            env=self.env(), stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, (self.root / "collector.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "collector did not come up"
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> bool:
        """SIGTERM: the collector drains its spool into the store, then exits (uvicorn re-raises
        the signal once shut down, so the exit status is -SIGTERM). True when it says it drained."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(120)
        self.log.close()
        return code in (0, -signal.SIGTERM) and "stopped: spool drained" in (self.root / "collector.log").read_text()

    def ready(self) -> dict:
        return httpx.get(self.url + "/readyz", timeout=5).json()

    def wait_drained(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while self.ready()["spool_pending_bytes"]:
            assert time.monotonic() < deadline, "spool did not drain"
            time.sleep(0.2)

    def query(self, sql: str) -> list:
        """Run SQL on the collector's store from a fresh process (chDB: one engine per process);
        call it while the collector is stopped."""
        code = ("import json,sys; from kvtrace.store.client import Store; s = Store(sys.argv[1]); "
                "print(json.dumps(s.query_arrow(sys.argv[2]).to_pylist()))")
        out = subprocess.run([sys.executable, "-c", code, self.dsn, sql], env=self.env(), capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        import json

        return json.loads(out.stdout)


def commits(start: int, n: int, t0: int) -> list[Event]:
    return [Event(kind=EventKind.COMMIT, ts_ns=t0 + i, source_id=SOURCE, seq=i, instance="crash-test", model="m",
                  component=ComponentKind.FULL_ATTENTION, block_key=i + 1, tier=Tier.DEVICE, token_start=0,
                  token_end=16, nbytes=4096, block_size=16) for i in range(start, start + n)]


def send_until_acked(url: str, batch_seq: int, events: list[Event], timeout_s: float = 120) -> int:
    """At-least-once, as the emitter does it: re-send until a 200. Returns attempts made.
    Odd batches go as columns, even ones as msgpack rows: both wire formats cross the crash."""
    if batch_seq % 2:
        body = encode_columns(Envelope(source_id=SOURCE, batch_seq=batch_seq, sent_ns=time.time_ns()), events)
        content_type = ARROW_TYPE
    else:
        body = encode_batch(Batch(source_id=SOURCE, batch_seq=batch_seq, sent_ns=time.time_ns(), events=events))
        content_type = CONTENT_TYPE
    deadline = time.monotonic() + timeout_s
    attempts = 0
    while True:
        attempts += 1
        try:
            r = httpx.post(url + "/v1/batches", content=body, headers={"Content-Type": content_type}, timeout=30)
            if r.status_code == 200:
                assert r.json()["accepted"] == len(events)
                return attempts
            assert r.status_code in (429, 503), r.text
            time.sleep(float(r.headers.get("Retry-After", "1")))
        except httpx.HTTPError:
            time.sleep(0.1)
        assert time.monotonic() < deadline, "batch never acknowledged"
