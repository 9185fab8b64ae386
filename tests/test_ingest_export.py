"""Files into the store (JSONL, Parquet, spool) and back out (Parquet, JSONL), on real ClickHouse."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import duckdb
import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from strategies import STORE_TS_BASE, event_key, seeded_events

from kvtrace.instrumentation.sinks.base import ExportStatus
from kvtrace.instrumentation.sinks.spool import SpoolSink
from kvtrace.schema.arrow import conform, from_arrow, to_arrow
from kvtrace.schema.events import FIELD_NAMES, Event
from kvtrace.schema.kinds import ComponentKind, EventKind, Reason, Tier
from kvtrace.schema.records import EmitterStats, Rejection
from kvtrace.schema.wire import SPOOL_HEADER, Batch, WireError, encode_batch, frame
from kvtrace.store.client import Store
from kvtrace.store.export import EventFilter, ExportFormat, export_events
from kvtrace.store.ingest import FileFormat, detect_format, ingest_file, iter_file_events


def stored(store: Store) -> list[Event]:
    return [e for t in store.iter_event_batches() for e in from_arrow(t)]


def quarantined(store: Store) -> list[Rejection]:
    table = conform(store.query_arrow(f"SELECT * FROM {store.db}.quarantine ORDER BY origin, row"), Rejection)
    return [msgspec.convert(r, Rejection) for r in table.to_pylist()]


@pytest.fixture
def second_store(chdb_path: Path):
    """Another fresh database on the session's engine (chDB allows one engine per process)."""
    s = Store(f"chdb://{chdb_path}?database=t2_{uuid.uuid4().hex[:12]}")
    s.init()
    yield s
    s.client.command(f"DROP DATABASE IF EXISTS {s.db}")
    s.close()


def _ev(i: int, kind: EventKind = EventKind.COMMIT, **kw: object) -> Event:
    base: dict[str, object] = {"component": ComponentKind.FULL_ATTENTION, "block_key": 1000 + i,
                               "tier": Tier.DEVICE}
    if kind in (EventKind.LOOKUP, EventKind.ADOPT):
        base = {"request_id": f"r{i}", "prompt_tokens": 32}
    base.update(kw)
    return Event(kind=kind, ts_ns=STORE_TS_BASE + i, source_id=0xABC, seq=i + 1, **base)


# -- JSONL --------------------------------------------------------------------------------------


def test_jsonl_ingest_stores_good_lines_and_quarantines_bad_ones(store, tmp_path):
    good = [_ev(0), _ev(1, EventKind.LOOKUP), _ev(2, EventKind.EVICT, reason=Reason.CAPACITY), _ev(3)]
    enc = [msgspec.json.encode(e).decode() for e in good]
    lines = [
        enc[0],  # 1
        "",  # 2 blank
        "{not json",  # 3
        enc[1],  # 4
        "   ",  # 5 blank (spaces)
        '{"kind": "teleport", "ts_ns": 1, "source_id": 1, "seq": 1}',  # 6 unknown kind
        enc[2],  # 7
        enc[3].replace('"block_key":1003', '"block_key":"1003"'),  # 8 wrong type
        '{"kind": "evict", "ts_ns": 5, "source_id": 1, "seq": 2, "component": "mamba", "block_key": 1, '
        '"tier": "host"}',  # 9 evict without reason
        enc[3],  # 10
    ]
    assert '"block_key":"1003"' in lines[7]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert detect_format(path) is FileFormat.JSONL

    report = ingest_file(store, path)

    assert report.format is FileFormat.JSONL
    assert (report.rows, report.stored, report.rejected, report.torn_bytes) == (8, 4, 4, 0)
    assert stored(store) == sorted(good, key=event_key)
    q = quarantined(store)
    assert [(r.row, r.field) for r in q] == [(3, ""), (6, "kind"), (8, "block_key"), (9, "reason")]
    assert all(r.origin == str(path) for r in q)
    assert q[0].raw.strip() == "{not json" and "JSON" in q[0].reason
    assert "teleport" in q[1].reason
    assert [(r.row, r.field) for r in report.first_rejections] == [(r.row, r.field) for r in q]
    assert report.first_rejections[2].message().startswith(f"{path} row 8: block_key: ")


def test_jsonl_ingest_is_idempotent(store, tmp_path):
    events = seeded_events(200, seed=8)
    path = tmp_path / "e.jsonl"
    path.write_bytes(b"".join(msgspec.json.encode(e) + b"\n" for e in events))
    assert ingest_file(store, path).stored == 200
    assert ingest_file(store, path).stored == 200
    assert store.count_events() == 200
    assert stored(store) == sorted(events, key=event_key)


def test_jsonl_without_trailing_newline_and_crlf(store, tmp_path):
    a, b = _ev(1), _ev(2)
    path = tmp_path / "crlf.jsonl"
    path.write_bytes(msgspec.json.encode(a) + b"\r\n\r\n" + msgspec.json.encode(b))
    report = ingest_file(store, path)
    assert (report.stored, report.rejected) == (2, 0)
    assert stored(store) == [a, b]


# -- Parquet ------------------------------------------------------------------------------------


def test_parquet_export_reads_in_duckdb_and_reingests_identically(store, second_store, tmp_path):
    events = seeded_events(2500, seed=21)
    store.insert_events(events)
    store.insert_events(events[:100])  # duplicates are not exported
    out = tmp_path / "nested" / "events.parquet"

    assert export_events(store, out) == len(events)
    assert out.is_file() and not (out.parent / "events.parquet.partial").exists()
    assert detect_format(out) is FileFormat.PARQUET

    # DuckDB reads the file on its own and agrees with the store
    con = duckdb.connect()
    n, kinds, sources, max_key = con.execute(
        f"SELECT count(*), count(DISTINCT kind), count(DISTINCT source_id), max(block_key) FROM '{out}'"
    ).fetchone()
    assert n == store.count_events() == len(events)
    assert kinds == len({e.kind for e in events})
    assert sources == store.status().sources
    assert max_key == store.scalar(f"SELECT max(block_key) FROM {store.db}.events")
    per_kind = dict(con.execute(f"SELECT kind, count(*) FROM '{out}' GROUP BY kind").fetchall())
    assert per_kind == dict(
        store.client.query(f"SELECT kind, count() FROM {store.db}.events FINAL GROUP BY kind").result_rows
    )
    reader = con.sql(f"SELECT * FROM '{out}' ORDER BY ts_ns, source_id, seq").arrow()
    duck = reader if isinstance(reader, pa.Table) else reader.read_all()
    assert tuple(duck.column_names) == FIELD_NAMES
    assert from_arrow(duck) == stored(store) == sorted(events, key=event_key)

    # and the file loads into a fresh database with every event intact
    report = ingest_file(second_store, out)
    assert (report.format, report.rows, report.stored, report.rejected) == (FileFormat.PARQUET, n, n, 0)
    assert stored(second_store) == stored(store)
    assert list(iter_file_events(out)) == sorted(events, key=event_key)


def test_parquet_export_filters(store, tmp_path):
    events = seeded_events(400, seed=3)
    store.insert_events(events)
    instance = events[1].instance
    since, until = STORE_TS_BASE + 50_000, STORE_TS_BASE + 80_000
    out = tmp_path / "f.parquet"
    n = export_events(store, out, flt=EventFilter(since_ns=since, until_ns=until, instance=instance))
    want = sorted((e for e in events if since <= e.ts_ns < until and e.instance == instance), key=event_key)
    assert want and n == len(want)
    assert from_arrow(pq.read_table(out)) == want


def test_parquet_export_of_an_empty_store_is_a_valid_empty_file(store, tmp_path):
    out = tmp_path / "empty.parquet"
    assert export_events(store, out) == 0
    table = pq.read_table(out)
    assert table.num_rows == 0 and tuple(table.column_names) == FIELD_NAMES
    assert duckdb.connect().execute(f"SELECT count(*) FROM '{out}'").fetchone() == (0,)


def test_parquet_from_an_older_writer_ingests_with_defaults(store, tmp_path):
    events = [_ev(i, transform=e) for i, e in enumerate(["fp8", "int8"])]
    old = to_arrow(events).drop_columns(["transform", "recomputed_tokens", "schema_version"])
    path = tmp_path / "old.parquet"
    pq.write_table(old, path)
    report = ingest_file(store, path)
    assert (report.stored, report.rejected) == (2, 0)
    assert [e.transform.value for e in stored(store)] == ["exact", "exact"]


def test_parquet_rows_are_validated_and_numbered(store, tmp_path):
    events = [_ev(i) for i in range(5)]
    table = to_arrow(events)
    # row 2 loses its block_key, row 4 gets token_end < token_start
    keys = table.column("block_key").to_pylist()
    keys[1] = 0
    ends = [0] * 5
    starts = [0, 0, 0, 10, 0]
    table = table.set_column(FIELD_NAMES.index("block_key"), "block_key", pa.array(keys, pa.uint64()))
    table = table.set_column(FIELD_NAMES.index("token_start"), "token_start", pa.array(starts, pa.uint32()))
    table = table.set_column(FIELD_NAMES.index("token_end"), "token_end", pa.array(ends, pa.uint32()))
    path = tmp_path / "bad.parquet"
    pq.write_table(table, path)
    report = ingest_file(store, path)
    assert (report.rows, report.stored, report.rejected) == (5, 3, 2)
    assert [(r.row, r.field) for r in quarantined(store)] == [(2, "block_key"), (4, "token_end")]
    assert stored(store) == [events[0], events[2], events[4]]


# -- JSONL export --------------------------------------------------------------------------------


def test_jsonl_export_round_trip(store, second_store, tmp_path):
    events = seeded_events(800, seed=13)
    store.insert_events(events)
    out = tmp_path / "events.jsonl"
    assert export_events(store, out, ExportFormat.JSONL) == len(events)
    lines = out.read_bytes().splitlines()
    assert len(lines) == len(events)
    assert [msgspec.json.decode(line, type=Event) for line in lines] == sorted(events, key=event_key)
    report = ingest_file(second_store, out)
    assert (report.format, report.stored, report.rejected) == (FileFormat.JSONL, len(events), 0)
    assert stored(second_store) == stored(store)


# -- spool files --------------------------------------------------------------------------------

SOURCE = 0x1234_5678_9ABC_DEF0


def _spool(tmp_path: Path, batches: list[Batch]) -> Path:
    sink = SpoolSink(tmp_path / "spool")
    for b in batches:
        assert sink.export(b).status is ExportStatus.SUCCESS
    sink.shutdown()
    files = sorted((tmp_path / "spool").glob("*.kvspool"))
    assert len(files) == 1
    return files[0]


def _batches(n_batches: int = 3, per_batch: int = 40) -> tuple[list[Batch], list[Event]]:
    generated = seeded_events(n_batches * per_batch, seed=4, sources=1)
    events = [msgspec.structs.replace(e, source_id=SOURCE) for e in generated]
    batches = []
    for b in range(n_batches):
        chunk = events[b * per_batch : (b + 1) * per_batch]
        stats = EmitterStats(ts_ns=STORE_TS_BASE + b, source_id=SOURCE, instance="i0", engine="sim",
                             emitted=(b + 1) * per_batch, exported=b * per_batch, batches=b,
                             dropped_queue_full=b)
        batches.append(Batch(source_id=SOURCE, batch_seq=b + 1, sent_ns=STORE_TS_BASE + b, events=chunk,
                             stats=stats))
    return batches, events


def test_spool_file_ingests_events_and_emitter_stats(store, tmp_path):
    batches, events = _batches()
    path = _spool(tmp_path, batches)
    assert path.name == f"kvtrace-{SOURCE:016x}-000001.kvspool"
    assert detect_format(path) is FileFormat.SPOOL

    report = ingest_file(store, path)

    assert (report.format, report.rows, report.stored, report.rejected, report.torn_bytes) == (
        FileFormat.SPOOL, len(events), len(events), 0, 0)
    assert stored(store) == sorted(events, key=event_key)
    stats = conform(store.query_arrow(f"SELECT * FROM {store.db}.emitter_stats FINAL ORDER BY ts_ns"),
                    EmitterStats)
    assert [msgspec.convert(r, EmitterStats) for r in stats.to_pylist()] == [b.stats for b in batches]
    assert store.status().dropped_events == batches[-1].stats.dropped


def test_spool_with_invalid_events_quarantines_them_by_batch_and_row(store, tmp_path):
    ok = [_ev(i) for i in range(3)]
    # built in-process, so not validated until the collector reads it
    bad = Event(kind=EventKind.EVICT, ts_ns=STORE_TS_BASE, source_id=0xABC, seq=99,
                component=ComponentKind.MAMBA, block_key=7, tier=Tier.HOST)
    batch = Batch(source_id=0xABC, batch_seq=4, sent_ns=1, events=[ok[0], bad, ok[1], ok[2]])
    path = _spool(tmp_path, [batch])
    report = ingest_file(store, path)
    assert (report.stored, report.rejected) == (3, 1)
    assert stored(store) == ok
    (r,) = quarantined(store)
    assert (r.row, r.field) == (2, "reason")
    assert r.origin == f"{path}#source={0xABC:016x},batch=4"
    # the row is kept as readable JSON, not as an opaque object
    raw = msgspec.json.decode(r.raw)
    assert (raw["kind"], raw["seq"], raw["block_key"]) == ("evict", 99, 7)


def test_spool_with_torn_last_frame_keeps_intact_frames(store, tmp_path):
    batches, events = _batches(n_batches=3)
    path = _spool(tmp_path, batches)
    last_frame = len(frame(encode_batch(batches[-1])))
    size = path.stat().st_size
    assert size == len(SPOOL_HEADER) + sum(len(frame(encode_batch(b))) for b in batches)
    os.truncate(path, size - 5)  # the crash came mid-write

    report = ingest_file(store, path)

    kept = [e for b in batches[:-1] for e in b.events]
    assert report.torn_bytes == last_frame - 5 > 0
    assert (report.stored, report.rejected) == (len(kept), 0)
    assert stored(store) == sorted(kept, key=event_key)
    assert store.scalar(f"SELECT count() FROM {store.db}.emitter_stats") == 2


def test_spool_with_a_corrupt_frame_stops_there(store, tmp_path):
    batches, _ = _batches(n_batches=3)
    path = _spool(tmp_path, batches)
    data = bytearray(path.read_bytes())
    second = len(SPOOL_HEADER) + len(frame(encode_batch(batches[0])))
    data[second + 20] ^= 0xFF  # flip a byte inside the second frame's payload
    path.write_bytes(bytes(data))
    report = ingest_file(store, path)
    assert report.stored == len(batches[0].events)
    assert report.torn_bytes == len(data) - second


# -- unreadable inputs ---------------------------------------------------------------------------


def test_missing_file_is_file_not_found_naming_the_path(store, tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        ingest_file(store, missing)
    with pytest.raises(FileNotFoundError):
        ingest_file(store, tmp_path)  # a directory is not a file either


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03" + bytes(range(256)) * 4,
         "not JSONL, Parquet or a kvtrace spool"),
        (b"PAR1" + b"\x00garbage" * 10, "not a readable Parquet file"),
        (b"KVTSPOOL", "truncated spool header"),
        (b"KVTSPOOL\x00\x09" + b"\x00" * 16, "spool version 9 not supported"),
        (SPOOL_HEADER + frame(b"\x93\x01\x02\x03"), "not a kvtrace batch"),
    ],
    ids=["gzip", "parquet", "spool-header", "spool-version", "spool-payload"],
)
def test_unreadable_file_is_a_wire_error_naming_the_path(store, tmp_path, content, message):
    path = tmp_path / "input.bin"
    path.write_bytes(content)
    with pytest.raises(WireError, match=message) as err:
        ingest_file(store, path)
    assert str(path) in str(err.value)
    assert store.count_events() == 0
    assert quarantined(store) == []
