"""A shared collector against hostile and careless clients: a real `kvtrace collector` process
with two tenants' tokens (and an operator's), its own embedded store, and raw HTTP.

Invariants checked throughout: no 5xx; nothing of tenant B readable or changed by tenant A; B's
events stored within seconds whatever A sends; a request's cost bounded by its size.
"""

from __future__ import annotations

import gzip
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from kvtrace.collector.bounds import ROW_CAP
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import EventKind
from kvtrace.schema.records import EmitterStats
from kvtrace.schema.wire import CONTENT_TYPE, Batch, encode_batch
from tests.collector_proc import CollectorProcess

TOKENS = "tok-a=alpha;tok-b=beta;tok-op=*"
JSON = {"Content-Type": "application/json"}
MSGPACK = {"Content-Type": CONTENT_TYPE}


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def lookups(n: int, source: int, instance: str, tag: str, t0: int | None = None, first_seq: int = 0) -> list[Event]:
    t0 = time.time_ns() if t0 is None else t0
    return [Event(kind=EventKind.LOOKUP, ts_ns=t0 + i, source_id=source, seq=first_seq + i, instance=instance,
                  model="m", request_id=f"{tag}-{i}", prompt_tokens=64) for i in range(n)]


def batch(events: list[Event], source: int, seq: int = 1, stats: EmitterStats | None = None) -> bytes:
    return encode_batch(Batch(source_id=source, batch_seq=seq, sent_ns=time.time_ns(), events=events, stats=stats))


class Hostile(CollectorProcess):
    """The collector process, with tokens and a helper that fails on any 5xx."""

    def __init__(self, root: Path, *extra: str) -> None:
        super().__init__(root, *extra)
        self.client = httpx.Client(base_url=self.url, timeout=60)

    def env(self) -> dict[str, str]:
        return {**super().env(), "KVTRACE_COLLECTOR_TOKENS": TOKENS}

    def post(self, token: str, body: bytes, headers: dict[str, str] = MSGPACK, path: str = "/v1/batches"
             ) -> httpx.Response:
        r = self.client.post(path, content=body, headers={**headers, **auth(token)})
        assert r.status_code < 500, (r.status_code, r.text)
        return r

    def events(self, token: str, **params: object) -> list[dict]:
        r = self.client.get("/v1/events", params={"limit": 10000, **params}, headers=auth(token))
        assert r.status_code == 200, r.text
        return r.json()

    def rss_kib(self) -> int:
        assert self.proc is not None
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """A kvtrace command on this collector's store (run it while the collector is stopped:
        chDB is one engine per process)."""
        return subprocess.run([sys.executable, "-m", "kvtrace.cli.main", *args],
                              env=self.env(), capture_output=True, text=True, timeout=300)


@pytest.fixture
def collector(tmp_path: Path) -> Hostile:
    proc = Hostile(tmp_path)
    proc.start()
    yield proc
    if proc.proc is not None and proc.proc.poll() is None:
        proc.stop()


def wait_for(check, timeout_s: float = 30.0) -> None:  # noqa: ANN001 - a predicate
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.1)


def test_a_tenant_can_neither_overwrite_nor_read_another_tenants_rows(collector: Hostile) -> None:
    mine = lookups(5, source=0xB, instance="shared", tag="beta")
    assert collector.post("tok-b", batch(mine, 0xB)).json()["accepted"] == 5
    # A re-sends B's event identities (instance, time, source, seq) with its own content
    forged = [msgspec.structs.replace(e, request_id="forged", prompt_tokens=1) for e in mine]
    r = collector.post("tok-a", batch(forged, 0xB))
    assert r.status_code == 200  # stored as A's rows: A's namespace, not B's
    # ...or names B's tenant outright: refused whole, naming the row
    r = collector.post("tok-a", batch([msgspec.structs.replace(e, tenant="beta") for e in forged], 0xB, seq=2))
    assert r.status_code == 403 and r.json()["error"].startswith("row 1: tenant 'beta'")
    collector.wait_drained()
    b_rows = collector.events("tok-b")
    assert sorted((r["request_id"], r["tenant"], r["prompt_tokens"]) for r in b_rows) == \
        sorted((e.request_id, "beta", 64) for e in mine)
    a_rows = collector.events("tok-a")
    assert {(r["request_id"], r["tenant"]) for r in a_rows} == {("forged", "alpha")}
    assert len(collector.events("tok-op")) == 10  # both, side by side
    assert collector.stop()
    (row,) = collector.query("SELECT countIf(tenant = 'beta' AND request_id LIKE 'beta-%') AS b, "
                             "countIf(tenant = 'alpha') AS a FROM kvtrace.events FINAL")
    assert row == {"b": 5, "a": 5}


def test_forged_counters_for_another_tenants_source_are_quarantined(collector: Hostile) -> None:
    honest = EmitterStats(ts_ns=time.time_ns(), source_id=0xB, instance="eng-b", emitted=5)
    assert collector.post("tok-b", batch(lookups(5, 0xB, "eng-b", "b"), 0xB, stats=honest)).status_code == 200
    forged = EmitterStats(ts_ns=time.time_ns() + 1, source_id=0xB, instance="eng-b", emitted=5,
                          dropped_queue_full=10**15)
    r = collector.post("tok-a", batch([], 0xB, seq=7, stats=forged))
    assert r.status_code == 200 and r.json()["quarantined"] == 1
    assert "may not report its counters" in r.json()["problems"][0]["reason"]
    # A's own emitter, reporting its own counters, is welcome (and scoped to A)
    own = EmitterStats(ts_ns=time.time_ns(), source_id=0xA, instance="eng-a", emitted=3, dropped_queue_full=2)
    assert collector.post("tok-a", batch(lookups(3, 0xA, "eng-a", "a"), 0xA, stats=own)).json()["quarantined"] == 0
    assert collector.stop()
    status = collector.cli("db", "status")
    assert status.returncode == 0, status.stderr
    assert "dropped events:  2 (reported by emitters)" in status.stdout, status.stdout
    rows = collector.query("SELECT source_id, writer, dropped_queue_full FROM kvtrace.emitter_stats FINAL "
                           "ORDER BY source_id")
    assert rows == [{"source_id": 0xA, "writer": "alpha", "dropped_queue_full": 2},
                    {"source_id": 0xB, "writer": "beta", "dropped_queue_full": 0}]


def test_implausible_times_are_quarantined_at_the_door_and_never_stall_the_drain(collector: Hostile) -> None:
    now = time.time_ns()
    day = 86400 * 10**9
    # a batch whose rows span 36 years of days (more partitions than one insert may touch)
    span = [msgspec.structs.replace(e, ts_ns=now - i * 3 * 365 * day) for i, e in
            enumerate(lookups(12, 0xA, "a1", "old"))]
    r = collector.post("tok-a", batch(span, 0xA))
    body = r.json()
    assert r.status_code == 200 and body["accepted"] == 1 and body["quarantined"] == 11
    assert all(p["field"] == "ts_ns" and "more than 30 days before" in p["reason"] for p in body["problems"])
    future = lookups(2, 0xA, "a1", "future", t0=now + 2 * day, first_seq=100)
    r = collector.post("tok-a", batch(future, 0xA, seq=2))
    assert r.json()["quarantined"] == 2 and "is the sender's clock right" in r.json()["problems"][0]["reason"]
    sent = time.monotonic()
    collector.post("tok-b", batch(lookups(3, 0xB, "b1", "b"), 0xB))
    wait_for(lambda: len(collector.events("tok-b")) == 3, timeout_s=10)
    assert time.monotonic() - sent < 10


def test_a_store_refusing_rows_costs_only_the_refused_rows(tmp_path: Path) -> None:
    """The store itself refuses a row (here a table constraint an operator added): the drain
    retries the chunk a few times, then splits it until the refusal stands alone, quarantines
    that row with the store's reason, stores the rest, and B's events behind it are stored in
    seconds. (The intake's time rule already keeps out rows spanning more days than one insert
    may touch, the other refusal seen.)"""
    proc = Hostile(tmp_path)
    proc.start()
    assert proc.stop()
    alter = ("from kvtrace.store.client import Store; import sys; s = Store(sys.argv[1]); "
             "s.client.command(\"ALTER TABLE kvtrace.events ADD CONSTRAINT no_poison CHECK request_id != 'poison'\")")
    subprocess.run([sys.executable, "-c", alter, proc.dsn], env=proc.env(), check=True, timeout=120)
    proc = Hostile(tmp_path)
    proc.start()
    try:
        mine = lookups(10, 0xA, "a", "w")
        mine[3] = msgspec.structs.replace(mine[3], request_id="poison")
        assert proc.post("tok-a", batch(mine, 0xA)).json()["accepted"] == 10
        sent = time.monotonic()
        assert proc.post("tok-b", batch(lookups(4, 0xB, "b", "b"), 0xB)).status_code == 200
        wait_for(lambda: len(proc.events("tok-b")) == 4, timeout_s=30)
        waited = time.monotonic() - sent
        wait_for(lambda: len(proc.events("tok-a")) == 9, timeout_s=30)
        assert waited < 15, waited
        metrics = proc.client.get("/metrics", headers=auth("tok-op")).text  # the refused row is not counted stored
        assert 'kvtrace_collector_events_stored_total{tenant="alpha"} 9.0' in metrics, metrics
        assert 'kvtrace_collector_events_stored_total{tenant="beta"} 4.0' in metrics
    finally:
        assert proc.stop()
    (row,) = proc.query("SELECT count() AS n, any(reason) AS reason, any(raw) AS raw FROM kvtrace.quarantine")
    assert row["n"] == 1 and "the store refused this row" in row["reason"] and "469" in row["reason"], row
    assert json.loads(row["raw"])["request_id"] == "poison"


def test_requests_that_cost_more_than_their_size_are_refused_cheaply(collector: Hostile) -> None:
    before = collector.rss_kib()
    # ~2 KB of gzip that inflates to two million empty rows
    bomb = gzip.compress(b'{"wire_version":1,"source_id":1,"batch_seq":1,"sent_ns":1,"events":['
                         + b",".join([b"{}"] * 2_000_000) + b"]}")
    assert len(bomb) < 20_000
    started = time.monotonic()
    r = collector.post("tok-a", bomb, {**JSON, "Content-Encoding": "gzip"})
    assert r.status_code == 413 and f"the limit is {ROW_CAP}" in r.json()["error"]
    msgpack_bomb = gzip.compress(msgspec.msgpack.encode({"wire_version": 1, "source_id": 1, "batch_seq": 1,
                                                         "sent_ns": 1, "events": [{}] * 3_000_000}))
    r = collector.post("tok-a", msgpack_bomb, {**MSGPACK, "Content-Encoding": "gzip"})
    assert r.status_code == 413, r.text
    assert time.monotonic() - started < 10
    assert collector.rss_kib() - before < 400 * 1024  # no gigabyte kept (or taken) for it
    deep_json = b'{"wire_version":1,"source_id":1,"batch_seq":1,"sent_ns":1,"events":[' + b"[" * 1000 + \
        b"]" * 1000 + b"]}"
    r = collector.post("tok-a", deep_json, JSON)
    assert r.status_code == 400 and "nest" in r.json()["error"]
    deep_msgpack = msgspec.msgpack.encode({"wire_version": 1, "source_id": 1, "batch_seq": 1, "sent_ns": 1,
                                           "events": []})[:-1] + b"\x91" * 1000 + b"\x90"
    r = collector.post("tok-a", deep_msgpack)
    assert r.status_code == 400, r.text


def test_otlp_bodies_of_any_value_type_are_answered(collector: Hostile) -> None:
    event = msgspec.to_builtins(lookups(1, 0xA, "otlp", "kv")[0])
    kvlist = {"kvlistValue": {"values": [{"key": k, "value": {"intValue": str(v)} if isinstance(v, int)
                                          else {"stringValue": str(v)}} for k, v in event.items()]}}
    doc = {"resourceLogs": [{"scopeLogs": [{"logRecords": [
        {"eventName": "kvtrace.event", "body": kvlist},
        {"eventName": "kvtrace.event", "body": {"arrayValue": {"values": [{"intValue": "1"}]}}},
        {"eventName": "kvtrace.event", "body": {"bytesValue": "AAEC"}},
        {"eventName": "kvtrace.event", "body": {"doubleValue": 1.5}},
        {"eventName": "kvtrace.event"},
    ]}]}]}
    r = collector.post("tok-a", json.dumps(doc).encode(), JSON, path="/v1/logs")
    assert r.status_code == 200, r.text
    assert r.json()["partialSuccess"]["rejectedLogRecords"] == "4"
    collector.wait_drained()
    assert [e["request_id"] for e in collector.events("tok-a")] == ["kv-0"]


def test_what_can_never_succeed_gets_413_at_once(tmp_path: Path) -> None:
    proc = Hostile(tmp_path, "--max-spool-mib", "1")
    proc.start()
    try:
        big = batch(lookups(20_000, 0xA, "a", "x" * 40), 0xA)
        assert len(big) > 1 << 20
        r = proc.post("tok-a", big)
        assert r.status_code == 413 and "can never fit" in r.json()["error"]
        # a Content-Length far over the limit is refused before the body is sent
        with socket.create_connection(("127.0.0.1", proc.port), timeout=10) as s:
            s.sendall(b"POST /v1/batches HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tok-a\r\n"
                      b"Content-Type: " + CONTENT_TYPE.encode() + b"\r\nContent-Length: 1000000000000\r\n\r\n")
            started = time.monotonic()
            reply = s.recv(4096)
        assert reply.startswith(b"HTTP/1.1 413") and time.monotonic() - started < 5, reply
    finally:
        assert proc.stop()


def test_smaller_faults_are_answered_exactly(collector: Hostile) -> None:
    good = lookups(3, 0xA, "a", "ok")
    rows = [msgspec.to_builtins(e) for e in good]
    rows[0]["seq"] = -1  # invalid: quarantined
    rows[2]["tenant"] = "beta"  # reaches into B: the request is refused, naming its row (3, not 2)
    body = json.dumps({"wire_version": 1, "source_id": 0xA, "batch_seq": 1, "sent_ns": 1, "events": rows}).encode()
    r = collector.post("tok-a", body, JSON)
    assert r.status_code == 403 and r.json()["error"].startswith("row 3:"), r.text
    text = json.dumps({"wire_version": 1, "source_id": 0xA, "batch_seq": 1, "sent_ns": 1,
                       "events": [msgspec.to_builtins(good[0])]}).replace('"a"', '"a\\ud800"').encode()
    r = collector.post("tok-a", text, JSON)
    assert r.status_code == 400 and "lone UTF-16 surrogate" in r.json()["error"]
    r = collector.client.get("/v1/events", params={"since_ns": 2**63}, headers=auth("tok-a"))
    assert r.status_code == 422 and "since_ns" in r.json()["error"]
    assert collector.client.get("/metrics").status_code == 401
    assert collector.client.get("/metrics", headers=auth("tok-a")).status_code == 403
    assert "alpha" in collector.client.get("/metrics", headers=auth("tok-op")).text
    # a client hanging up mid-body: no error logged, the collector goes on
    with socket.create_connection(("127.0.0.1", collector.port), timeout=10) as s:
        s.sendall(b"POST /v1/batches HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tok-a\r\n"
                  b"Content-Type: " + CONTENT_TYPE.encode() + b"\r\nContent-Length: 100000\r\n\r\n" + b"\x00" * 1000)
    time.sleep(0.5)
    assert collector.post("tok-a", batch(good, 0xA)).status_code == 200
    assert collector.stop()
    log = (collector.root / "collector.log").read_text()
    assert '"level": "error"' not in log and "Traceback" not in log, log[-3000:]


def test_export_never_replaces_what_is_not_a_regular_file(collector: Hostile, tmp_path: Path) -> None:
    collector.post("tok-a", batch(lookups(3, 0xA, "a", "x"), 0xA))
    assert collector.stop()
    out = collector.cli("export", "-o", str(tmp_path))
    assert out.returncode == 2 and out.stderr.startswith("error: ") and "is a directory" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    out = collector.cli("export", "-o", "/dev/null")
    assert out.returncode == 0, out.stderr
    assert Path("/dev/null").is_char_device()
    target = tmp_path / "real.parquet"
    target.write_bytes(b"old")
    link = tmp_path / "link.parquet"
    link.symlink_to(target)
    out = collector.cli("export", "-o", str(link))
    assert out.returncode == 0 and link.is_symlink() and target.read_bytes()[:4] == b"PAR1"
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        out = collector.cli("export", "-o", str(locked / "x.parquet"))
        assert out.returncode == 2 and "permission denied" in out.stderr
