"""Sinks: store, HTTP collector, spool files and OTLP logs, alone and behind a BatchEmitter.

Network tests talk only to a server this file starts on 127.0.0.1 with an ephemeral port.
"""

from __future__ import annotations

import gzip
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import msgspec
import pyarrow as pa
import pytest

from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.sinks.base import ExportStatus
from kvtrace.instrumentation.sinks.http import INGEST_PATH, HttpSink, _retry_after
from kvtrace.instrumentation.sinks.memory import MemorySink
from kvtrace.instrumentation.sinks.otlp import EVENT_NAME, STATS_NAME, OtlpLogSink
from kvtrace.instrumentation.sinks.spool import SpoolSink, SpoolWriter
from kvtrace.instrumentation.sinks.store import StoreSink
from kvtrace.schema.arrow import from_arrow
from kvtrace.schema.arrow_wire import ARROW_TYPE, Envelope, read_stream
from kvtrace.schema.events import SCHEMA_VERSION, Event
from kvtrace.schema.kinds import ComponentKind, EventKind, Reason, Tier
from kvtrace.schema.records import EmitterStats
from kvtrace.schema.validation import event_from_json
from kvtrace.schema.wire import (
    CONTENT_TYPE,
    SPOOL_HEADER,
    SPOOL_SUFFIX,
    Batch,
    RawBatch,
    decode_batch,
    encode_batch,
    read_spool,
)
from kvtrace.store.client import Store

QUIET = dict(max_queue_size=10_000, max_export_batch_size=1_000, schedule_delay_millis=60_000)


def ev(key: int, **extra: object) -> Event:
    fields: dict[str, object] = dict(
        kind=EventKind.COMMIT,
        ts_ns=0,
        source_id=0,
        seq=0,
        component=ComponentKind.FULL_ATTENTION,
        block_key=key,
        tier=Tier.DEVICE,
    )
    fields.update(extra)
    return Event(**fields)  # type: ignore[arg-type]


def stamped(n: int, source_id: int = 0xABCDEF, start_key: int = 1) -> list[Event]:
    """Events as the emitter would hand them to a sink."""
    return [
        ev(start_key + i, ts_ns=1_700_000_000_000_000_000 + i, source_id=source_id, seq=i) for i in range(n)
    ]


def make(sink: object, instance: str = "", engine: str = "", **config: int) -> BatchEmitter:
    return BatchEmitter(  # type: ignore[arg-type]
        sink, BatchConfig(**config), instance=instance, engine=engine, register_atexit=False
    )


def decode_events(batch: RawBatch) -> list[Event]:
    return [msgspec.msgpack.decode(raw, type=Event) for raw in batch.events]


def spool_batches(directory: Path, pattern: str = "*") -> list[RawBatch]:
    out: list[RawBatch] = []
    for path in sorted(directory.glob(f"{pattern}{SPOOL_SUFFIX}")):
        with path.open("rb") as f:
            scan = read_spool(f, path.name)
        assert scan.torn_tail_bytes == 0, path
        out += [decode_batch(p) for p in scan.payloads]
    return out


# --------------------------------------------------------------------------------------------
# MemorySink knobs
# --------------------------------------------------------------------------------------------


def test_memory_sink_knobs() -> None:
    sink = MemorySink()
    batch = Batch(source_id=1, batch_seq=1, sent_ns=1, events=stamped(2, source_id=1))
    assert sink.export(batch).status is ExportStatus.SUCCESS
    sink.fail_with = ExportStatus.RETRY
    assert sink.export(batch).status is ExportStatus.RETRY
    sink.fail_with = None
    sink.raise_error = OSError("disk")
    with pytest.raises(OSError):
        sink.export(batch)
    assert sink.calls == 3 and len(sink.events) == 2 and sink.last_stats is None
    sink.shutdown()
    sink.shutdown()
    assert sink.shutdowns == 2


# --------------------------------------------------------------------------------------------
# StoreSink (embedded chDB through the conftest fixture)
# --------------------------------------------------------------------------------------------


def _count(store: Store, table: str) -> int:
    return int(store.scalar(f"SELECT count() FROM {store.db}.{table}") or 0)


def test_store_sink_writes_events_and_stats(store: Store) -> None:
    sink = StoreSink(store)
    em = make(sink, max_queue_size=1000, max_export_batch_size=50, schedule_delay_millis=10)
    big = ev(2**64 - 1)
    em.emit(big)
    for i in range(119):
        em.emit(ev(i + 1))
    assert em.force_flush(30_000) is True
    assert em.shutdown() is True

    assert store.count_events() == 120
    assert _count(store, "quarantine") == 0
    seqs = store.query_arrow(f"SELECT seq FROM {store.db}.events ORDER BY seq").column("seq").to_pylist()
    assert seqs == list(range(120))
    assert store.scalar(f"SELECT block_key FROM {store.db}.events WHERE seq = 0") == 2**64 - 1

    assert _count(store, "emitter_stats") >= 2  # one per batch plus the final one
    last = store.query_arrow(
        f"SELECT emitted, exported, source_id FROM {store.db}.emitter_stats ORDER BY ts_ns DESC, exported DESC LIMIT 1"
    ).to_pylist()[0]
    assert last == {"emitted": 120, "exported": 120, "source_id": em.source_id}


def test_store_sink_quarantines_a_malformed_event(store: Store) -> None:
    good = stamped(3, source_id=0x1234)
    bad = Event(
        kind=EventKind.COMMIT,
        ts_ns=1,
        source_id=0x1234,
        seq=3,
        component=ComponentKind.FULL_ATTENTION,
        block_key="not-an-int",  # type: ignore[arg-type]
        tier=Tier.DEVICE,
    )
    batch = Batch(source_id=0x1234, batch_seq=7, sent_ns=5, events=[good[0], bad, *good[1:]])
    result = StoreSink(store).export(batch)
    assert result.status is ExportStatus.SUCCESS
    assert result.rejected == 1
    assert store.count_events() == 3
    rows = store.query_arrow(f"SELECT origin, row, reason, raw FROM {store.db}.quarantine").to_pylist()
    assert len(rows) == 1
    row = rows[0]
    assert row["row"] == 2
    assert row["reason"]
    assert "not-an-int" in row["raw"]
    assert f"{0x1234:016x}" in row["origin"] and row["origin"].endswith(":7")


def test_store_sink_rejections_are_counted_by_the_emitter(store: Store) -> None:
    em = make(StoreSink(store), **QUIET)
    em.emit(ev(1))
    em.emit(ev("not-an-int"))  # type: ignore[arg-type]
    em.emit(ev(3))
    assert em.force_flush(30_000) is True
    st = em.stats()
    assert st.exported == 2 and st.dropped_invalid == 1 and st.emitted == 3
    assert em.shutdown() is True
    assert store.count_events() == 2
    assert _count(store, "quarantine") == 1


def test_store_sink_store_trouble_is_transient(store: Store) -> None:
    store.client.command(f"DROP TABLE {store.db}.events")
    result = StoreSink(store).export(Batch(source_id=1, batch_seq=1, sent_ns=1, events=stamped(1)))
    assert result.status is ExportStatus.RETRY
    assert "store insert failed" in result.detail


# --------------------------------------------------------------------------------------------
# HttpSink against a real local HTTP server
# --------------------------------------------------------------------------------------------


@dataclass
class Received:
    at: float
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Collector:
    url: str
    script: list[tuple[int, dict[str, str]]] = field(default_factory=list)  # answers, in order; then 200
    requests: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def batches(self) -> list[RawBatch]:
        out = []
        for r in self.requests:
            body = gzip.decompress(r.body) if r.headers.get("Content-Encoding") == "gzip" else r.body
            out.append(decode_batch(body))
        return out


@pytest.fixture
def collector() -> Iterator[Collector]:
    state = Collector(url="")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            with state.lock:
                state.requests.append(Received(time.monotonic(), self.path, dict(self.headers), body))
                code, headers = state.script.pop(0) if state.script else (200, {})
            payload = b"{}" if code < 400 else b"nope"
            self.send_response(code)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: object) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_http_sink_posts_gzip_msgpack_with_auth(collector: Collector) -> None:
    sink = HttpSink(collector.url, token="s3cret", timeout_s=5)
    events = stamped(5)
    events[0].block_key = 2**63 + 5
    stats = EmitterStats(ts_ns=9, source_id=0xABCDEF, emitted=5, instance="node-3:4242\n\u00e9")
    result = sink.export(Batch(source_id=0xABCDEF, batch_seq=3, sent_ns=11, events=events, stats=stats))
    assert result.status is ExportStatus.SUCCESS
    assert len(collector.requests) == 1
    req = collector.requests[0]
    assert req.path == INGEST_PATH
    assert req.headers["Content-Type"] == CONTENT_TYPE
    assert req.headers["Content-Encoding"] == "gzip"
    assert req.headers["Authorization"] == "Bearer s3cret"
    assert req.headers["User-Agent"] == "kvtrace-emitter"
    assert req.headers["X-Kvtrace-Instance"] == "node-3:4242"  # for routing; unsafe characters dropped
    batch = decode_batch(gzip.decompress(req.body))
    assert (batch.source_id, batch.batch_seq, batch.sent_ns) == (0xABCDEF, 3, 11)
    assert decode_events(batch) == events
    assert batch.stats == stats


def test_http_sink_posts_columns_zstd_compressed(collector: Collector) -> None:
    sink = HttpSink(collector.url, timeout_s=5, wire="columns")
    events = stamped(5)
    events[0].block_key = 2**64 - 1
    stats = EmitterStats(ts_ns=9, source_id=0xABCDEF, emitted=5)
    assert sink.export(Batch(source_id=0xABCDEF, batch_seq=3, sent_ns=11, events=events,
                             stats=stats)).status is ExportStatus.SUCCESS
    req = collector.requests[0]
    assert req.headers["Content-Type"] == ARROW_TYPE and req.headers["Content-Encoding"] == "zstd"
    envelope, table = read_stream(pa.CompressedInputStream(pa.BufferReader(req.body), "zstd").read())
    assert msgspec.json.decode(envelope, type=Envelope) == Envelope(source_id=0xABCDEF, batch_seq=3, sent_ns=11,
                                                                   stats=stats)
    assert from_arrow(table) == events
    with pytest.raises(ValueError, match="wire 'arrow' is not one of rows, columns"):
        HttpSink(collector.url, wire="arrow")


def test_http_sink_sends_a_batch_columns_cannot_hold_as_rows(collector: Collector) -> None:
    """A shim bug (a value its column cannot hold) must cost that event, not the batch: rows
    carry it to the collector, which quarantines it alone."""
    events = stamped(3)
    events[1].dp_rank = 70_000  # past uint16
    sink = HttpSink(collector.url, timeout_s=5, wire="columns")
    assert sink.export(Batch(source_id=1, batch_seq=1, sent_ns=1, events=events)).status is ExportStatus.SUCCESS
    req = collector.requests[0]
    assert req.headers["Content-Type"] == CONTENT_TYPE and req.headers["Content-Encoding"] == "zstd"
    rows = [msgspec.msgpack.decode(r) for r in decode_batch(pa.CompressedInputStream(pa.BufferReader(req.body),
                                                                                      "zstd").read()).events]
    assert [r["seq"] for r in rows] == [0, 1, 2] and rows[1]["dp_rank"] == 70_000


def test_http_sink_without_token_or_compression(collector: Collector) -> None:
    sink = HttpSink(collector.url + INGEST_PATH, compress=False, timeout_s=5)
    assert sink.url == collector.url + INGEST_PATH
    assert sink.export(Batch(source_id=1, batch_seq=1, sent_ns=1, events=stamped(2, source_id=1))).status is (
        ExportStatus.SUCCESS
    )
    req = collector.requests[0]
    assert "Authorization" not in req.headers and "Content-Encoding" not in req.headers
    assert len(decode_batch(req.body).events) == 2


def test_http_sink_rejects_non_http_urls() -> None:
    with pytest.raises(ValueError):
        HttpSink("ftp://127.0.0.1/x")
    assert HttpSink("http://127.0.0.1:1/").url == "http://127.0.0.1:1" + INGEST_PATH


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (400, ExportStatus.FAILURE),
        (401, ExportStatus.FAILURE),
        (413, ExportStatus.FAILURE),
        (429, ExportStatus.RETRY),
        (500, ExportStatus.RETRY),
        (503, ExportStatus.RETRY),
    ],
)
def test_http_sink_classifies_answers(collector: Collector, code: int, status: ExportStatus) -> None:
    collector.script.append((code, {"Retry-After": "2"}))
    result = HttpSink(collector.url, timeout_s=5).export(Batch(source_id=1, batch_seq=1, sent_ns=1))
    assert result.status is status
    assert f"HTTP {code}" in result.detail
    assert result.retry_after_s == 2.0


def test_retry_after_parsing() -> None:
    assert _retry_after("3") == 3.0
    assert _retry_after("0.5") == 0.5
    assert _retry_after(None) == 0.0
    assert _retry_after("-4") == 0.0
    assert _retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0


def test_emitter_waits_out_429_then_delivers(collector: Collector) -> None:
    collector.script.append((429, {"Retry-After": "1"}))
    em = make(HttpSink(collector.url, timeout_s=5), max_export_attempts=5, retry_backoff_millis=10, **QUIET)
    for i in range(20):
        em.emit(ev(i + 1))
    assert em.force_flush(15_000) is True
    assert len(collector.requests) == 2
    assert collector.requests[1].at - collector.requests[0].at >= 0.95  # Retry-After: 1 honoured
    first, second = collector.batches()
    assert decode_events(first) == decode_events(second)
    assert [e.seq for e in decode_events(second)] == list(range(20))
    st = em.stats()
    assert st.exported == 20 and st.export_errors == 1 and st.dropped == 0
    assert em.shutdown() is True
    assert len(collector.requests) == 3  # the final stats-only batch
    final = collector.batches()[-1]
    assert final.events == [] and final.stats is not None and final.stats.exported == 20


def test_emitter_does_not_retry_a_400(collector: Collector) -> None:
    collector.script.append((400, {}))
    em = make(HttpSink(collector.url, timeout_s=5), max_export_attempts=5, retry_backoff_millis=10, **QUIET)
    for i in range(20):
        em.emit(ev(i + 1))
    em.force_flush(15_000)
    assert len(collector.requests) == 1  # exactly one call for the batch
    for i in range(5):
        em.emit(ev(100 + i))
    assert em.force_flush(15_000) is True
    assert len(collector.requests) == 2  # the next batch is sent on its own, once
    st = em.stats()
    assert st.dropped_export_failed == 20 and st.export_errors == 1 and st.exported == 5
    em.shutdown()


def _refused_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_connection_refused_is_retry() -> None:
    sink = HttpSink(f"http://127.0.0.1:{_refused_port()}", timeout_s=2)
    result = sink.export(Batch(source_id=1, batch_seq=1, sent_ns=1, events=stamped(1, source_id=1)))
    assert result.status is ExportStatus.RETRY
    assert "cannot reach" in result.detail

    em = make(sink, max_export_attempts=3, retry_backoff_millis=1, **QUIET)
    for i in range(8):
        em.emit(ev(i + 1))
    em.force_flush(15_000)
    st = em.stats()
    assert st.export_errors == 3 and st.dropped_export_failed == 8
    em.shutdown()


def test_silent_server_times_out_as_retry() -> None:
    # a listening socket that never answers: the TCP handshake completes, no response comes
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        sink = HttpSink(f"http://127.0.0.1:{server.getsockname()[1]}", timeout_s=0.3)
        result = sink.export(Batch(source_id=1, batch_seq=1, sent_ns=1, events=stamped(1, source_id=1)))
    assert result.status is ExportStatus.RETRY
    assert "cannot reach" in result.detail


# --------------------------------------------------------------------------------------------
# spool files
# --------------------------------------------------------------------------------------------


def test_spool_writer_rotates_and_keeps_every_frame(tmp_path: Path) -> None:
    w = SpoolWriter(tmp_path, "p", max_file_bytes=1000, max_total_bytes=1_000_000)
    payloads = [bytes([i]) * (150 + i) for i in range(40)]
    assert all(w.append(p) for p in payloads)
    w.close()
    files = w.files()
    assert len(files) > 3
    assert all(f.stat().st_size <= 1000 for f in files)
    read: list[bytes] = []
    for f in files:
        with f.open("rb") as s:
            scan = read_spool(s, f.name)
        assert scan.torn_tail_bytes == 0
        read += scan.payloads
    assert read == payloads
    assert w.total_bytes() == sum(f.stat().st_size for f in files)

    # a new writer on the same directory continues numbering and never rewrites a file
    sizes = {f.name: f.stat().st_size for f in files}
    w2 = SpoolWriter(tmp_path, "p", max_file_bytes=1000, max_total_bytes=1_000_000)
    assert w2.append(b"again")
    w2.close()
    assert {f.name: f.stat().st_size for f in files} == sizes
    assert len(w2.files()) == len(files) + 1


def test_spool_writer_respects_total_bound(tmp_path: Path) -> None:
    w = SpoolWriter(tmp_path, "p", max_file_bytes=500, max_total_bytes=2000)
    results = [w.append(b"x" * 100) for _ in range(40)]
    w.close()
    assert True in results and False in results
    assert results.index(False) > 0 and not any(results[results.index(False):])
    assert w.total_bytes() <= 2000
    frames = 0
    for f in w.files():
        with f.open("rb") as s:
            frames += len(read_spool(s).payloads)
    assert frames == results.count(True)


@pytest.mark.parametrize(("file_bytes", "total_bytes"), [(len(SPOOL_HEADER), 100), (1000, 999)])
def test_spool_writer_rejects_bad_bounds(tmp_path: Path, file_bytes: int, total_bytes: int) -> None:
    with pytest.raises(ValueError):
        SpoolWriter(tmp_path, "p", max_file_bytes=file_bytes, max_total_bytes=total_bytes)


def test_torn_spool_tail_loses_only_the_last_frame(tmp_path: Path) -> None:
    w = SpoolWriter(tmp_path, "p")
    for i in range(3):
        w.append(encode_batch(Batch(source_id=1, batch_seq=i + 1, sent_ns=1, events=stamped(2, source_id=1))))
    w.close()
    (path,) = w.files()
    data = path.read_bytes()
    path.write_bytes(data[:-5])
    with path.open("rb") as f:
        scan = read_spool(f)
    assert len(scan.payloads) == 2 and scan.torn_tail_bytes > 0
    assert [decode_batch(p).batch_seq for p in scan.payloads] == [1, 2]


def test_spool_sink_behind_emitter_rotates_and_holds_every_event(tmp_path: Path) -> None:
    sink = SpoolSink(tmp_path, max_file_bytes=4096)
    em = make(sink, max_queue_size=2000, max_export_batch_size=25, schedule_delay_millis=5)
    for i in range(500):
        em.emit(ev(i + 1, request_id=f"req-{i}"))
    assert em.force_flush(15_000) is True
    assert em.shutdown() is True
    files = sorted(tmp_path.glob(f"*{SPOOL_SUFFIX}"))
    assert len(files) > 2
    assert all(f.name.startswith(f"kvtrace-{em.source_id:016x}-") for f in files)
    batches = spool_batches(tmp_path)
    events = [e for b in batches for e in decode_events(b)]
    assert [e.seq for e in events] == list(range(500))
    assert [e.request_id for e in events] == [f"req-{i}" for i in range(500)]
    assert all(b.source_id == em.source_id for b in batches)
    final = batches[-1]
    assert final.events == [] and final.stats is not None
    assert final.stats.emitted == final.stats.exported == 500


def test_full_spool_fails_exports_and_is_counted(tmp_path: Path) -> None:
    sink = SpoolSink(tmp_path, max_file_bytes=2048, max_total_bytes=4096)
    em = make(sink, max_queue_size=5000, max_export_batch_size=20, schedule_delay_millis=5,
              max_export_attempts=5, retry_backoff_millis=1)
    for i in range(1000):
        em.emit(ev(i + 1))
    em.force_flush(15_000)
    st = em.stats()
    assert st.dropped_export_failed > 0
    assert st.exported > 0
    assert st.exported + st.dropped_export_failed == 1000
    # Whole batches are refused, once each (FAILURE is not retried): one error per refused batch of
    # at most 20 events. (Batches may be smaller when the worker's timer fires mid-burst.)
    assert -(-st.dropped_export_failed // 20) <= st.export_errors <= st.dropped_export_failed
    assert em.shutdown() is False
    assert sum(f.stat().st_size for f in tmp_path.glob(f"*{SPOOL_SUFFIX}")) <= 4096
    stored = [e for b in spool_batches(tmp_path) for e in decode_events(b)]
    assert len(stored) == st.exported
    assert len({e.seq for e in stored}) == st.exported


# --------------------------------------------------------------------------------------------
# OTLP log records
# --------------------------------------------------------------------------------------------


def test_otlp_sink_one_record_per_event_round_trips() -> None:
    from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter

    exporter = InMemoryLogRecordExporter()
    sink = OtlpLogSink(exporter=exporter)
    em = make(sink, max_queue_size=1000, max_export_batch_size=10, schedule_delay_millis=5,
              instance="inst-7", engine="sim")
    events = [
        ev(2**64 - 1, engine="sim", instance="inst-7", model="m", tenant="t"),
        ev(2**63, engine="sim", instance="inst-7", model="m", tenant="t"),
        ev(2**63 + 12345, engine="sim", instance="inst-7", model="m", tenant="t"),
    ] + [ev(i + 1, engine="sim", instance="inst-7", model="m", tenant="t") for i in range(20)]
    events.append(
        Event(
            kind=EventKind.EVICT,
            ts_ns=0,
            source_id=0,
            seq=0,
            component=ComponentKind.SLIDING_WINDOW,
            block_key=2**64 - 2,
            tier=Tier.HOST,
            reason=Reason.CAPACITY,
            engine="sim",
            instance="inst-7",
        )
    )
    for e in events:
        em.emit(e)
    assert em.force_flush(15_000) is True
    assert sink.flush(15_000) is True

    records = [r.log_record for r in exporter.get_finished_logs()]
    event_records = [r for r in records if r.event_name == EVENT_NAME]
    assert len(event_records) == len(events)
    by_seq = {}
    for r in event_records:
        decoded = event_from_json(r.body)
        by_seq[decoded.seq] = decoded
        assert r.timestamp == decoded.ts_ns
        attrs = dict(r.attributes)
        assert attrs["kvtrace.kind"] == decoded.kind.value
        assert attrs["kvtrace.schema_version"] == SCHEMA_VERSION
        assert attrs["kvtrace.engine"] == "sim" and attrs["kvtrace.instance"] == "inst-7"
    assert sorted(by_seq) == list(range(len(events)))
    for e in events:
        assert by_seq[e.seq] == e  # exact, 64-bit keys included
    assert by_seq[0].block_key == 2**64 - 1
    assert by_seq[len(events) - 1].kind is EventKind.EVICT

    assert em.shutdown() is True  # shuts the provider down, flushing the final stats record
    stats_records = [r for r in (x.log_record for x in exporter.get_finished_logs()) if r.event_name == STATS_NAME]
    assert stats_records
    final = msgspec.json.decode(stats_records[-1].body, type=EmitterStats)
    assert final.exported == final.emitted == len(events)
    assert final.source_id == em.source_id
    assert dict(stats_records[-1].attributes)["kvtrace.instance"] == "inst-7"
