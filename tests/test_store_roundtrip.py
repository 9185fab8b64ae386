"""Events written to the real embedded ClickHouse come back exactly, once, in stream order."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from strategies import event_key, seeded_events, stored_events

from kvtrace.schema.arrow import arrow_schema, conform, from_arrow, to_arrow
from kvtrace.schema.clickhouse import DEFAULT_DATABASE, zero_when_omitted
from kvtrace.schema.columns import I64, U32
from kvtrace.schema.events import SCHEMA_VERSION, Event
from kvtrace.schema.kinds import ComponentKind, EventKind, Reason, Tier
from kvtrace.schema.records import EmitterStats, Rejection
from kvtrace.store.client import Store
from kvtrace.store.dsn import Dsn, StoreError, parse_dsn


def read_all(store: Store, where: str = "1", parameters: dict | None = None) -> list[Event]:
    out: list[Event] = []
    for table in store.iter_event_batches(where, parameters):
        assert table.schema.equals(arrow_schema(), check_metadata=False)
        out += from_arrow(table)
    return out


def encoded(events: list[Event]) -> set[bytes]:
    # Every field, defaults included: omit_defaults drops a float only when it is the default's
    # own object, and a decoded 0.0 is another object of equal value.
    return {msgspec.msgpack.encode(msgspec.structs.asdict(e)) for e in events}


def test_thousands_of_events_round_trip_in_stream_order(store):
    events = seeded_events(4000, seed=11)
    assert store.insert_events(events) == len(events)
    back = read_all(store)
    assert len(back) == len(events)
    assert encoded(back) == encoded(events)
    assert back == sorted(events, key=event_key)
    assert store.count_events() == len(events)
    # what ClickHouse itself sees agrees with what went in
    sql = f"SELECT kind, count() FROM {store.db}.events GROUP BY kind"
    by_kind = dict(store.client.query(sql).result_rows)
    expected: dict[str, int] = {}
    for e in events:
        expected[e.kind.value] = expected.get(e.kind.value, 0) + 1
    assert by_kind == expected
    max_key = store.scalar(f"SELECT max(block_key) FROM {store.db}.events")
    assert max_key == max(e.block_key for e in events)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(events=stored_events(max_size=150))
def test_any_valid_events_round_trip(store, events):
    store.client.command(f"TRUNCATE TABLE {store.db}.events")
    store.insert_events(events)
    assert read_all(store) == sorted(events, key=event_key)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(events=stored_events(max_size=150))
def test_json_lines_round_trip_with_omitted_fields_as_zeros(store, events):
    """The collector's insert path: JSON lines without default fields, parsed by ClickHouse
    with omitted fields as the type's zero. Non-zero defaults (an exact transform, the schema
    version) are always encoded, so they come back too."""
    assert zero_when_omitted(Event)
    store.client.command(f"TRUNCATE TABLE {store.db}.events")
    store.insert_json_lines("events", msgspec.json.Encoder().encode_lines(events))
    back = read_all(store)
    assert back == sorted(events, key=event_key)
    assert [e.transform for e in back] == [e.transform for e in sorted(events, key=event_key)]


class _PlainDefault(msgspec.Struct, omit_defaults=True, kw_only=True):
    ts_ns: I64
    weight: U32 = 3


class _FactoryDefault(msgspec.Struct, omit_defaults=True, kw_only=True):
    ts_ns: I64
    weight: U32 = msgspec.field(default_factory=lambda: 3)


def test_zero_when_omitted_refuses_a_plain_non_zero_default():
    assert not zero_when_omitted(_PlainDefault)  # an omitted 3 would be stored as 0
    assert zero_when_omitted(_FactoryDefault)
    assert msgspec.json.encode(_FactoryDefault(ts_ns=1)) == b'{"ts_ns":1,"weight":3}'


def test_inserting_twice_stores_each_event_once(store):
    events = seeded_events(1500, seed=5)
    store.insert_events(events)
    store.insert_events(events)
    # a re-sent half-batch (the emitter retrying) de-duplicates too
    store.insert_events(events[: len(events) // 2])
    assert store.count_events() == len(events)
    assert store.scalar(f"SELECT count() FROM {store.db}.events") >= len(events)  # before merges
    assert read_all(store) == sorted(events, key=event_key)
    store.client.command(f"OPTIMIZE TABLE {store.db}.events FINAL")
    assert store.scalar(f"SELECT count() FROM {store.db}.events") == len(events)


def test_filtered_reads_use_parameters(store):
    events = seeded_events(600, seed=2)
    store.insert_events(events)
    instance = events[0].instance
    got = read_all(store, "instance = {i:String}", {"i": instance})
    assert got == sorted((e for e in events if e.instance == instance), key=event_key)
    assert read_all(store, "kind = 'lookup' AND prompt_tokens > {p:UInt32}", {"p": 100}) == sorted(
        (e for e in events if e.kind is EventKind.LOOKUP and e.prompt_tokens > 100), key=event_key
    )


def test_empty_store_reads_nothing(store):
    assert read_all(store) == []
    assert store.count_events() == 0
    assert store.insert_events([]) == 0


def test_status_shows_row_counts(store):
    events = seeded_events(300, seed=9)
    store.insert_events(events)
    store.insert_events(events[:10])  # duplicates do not count
    store.insert_rejections(
        [Rejection(received_ns=1_750_000_000_000_000_000, origin="f.jsonl", row=i, field="kind", reason="bad")
         for i in (1, 2)]
    )
    sid = events[0].source_id
    store.insert_stats(
        [
            EmitterStats(ts_ns=1_750_000_000_000_000_000, source_id=sid, emitted=10, dropped_queue_full=1),
            # later counters for the same source replace the earlier ones in the drop total
            EmitterStats(ts_ns=1_750_000_000_000_000_001, source_id=sid, emitted=20, dropped_queue_full=3,
                         dropped_shutdown=2, dropped_sampled_out=100),
            EmitterStats(ts_ns=1_750_000_000_000_000_000, source_id=sid + 1, dropped_export_failed=4),
        ]
    )
    status = store.status()
    assert status.schema_version == SCHEMA_VERSION == status.code_schema_version
    assert status.dsn == str(store.dsn)
    assert status.server_version
    rows = {t.name: t.rows for t in status.tables}
    assert rows == {"events": 300, "quarantine": 2, "emitter_stats": 3, "verdicts": 0, "calibrations": 0,
                    "verifications": 0, "snapshots": 0}
    events_table = next(t for t in status.tables if t.name == "events")
    assert events_table.bytes_on_disk > 0 and events_table.partitions >= 1
    assert status.sources == len({e.source_id for e in events})
    assert status.dropped_events == 3 + 2 + 4  # sampling is not loss


def test_rejections_and_stats_round_trip(store):
    rejections = [
        Rejection(received_ns=5, origin="x.jsonl", row=3, field="nbytes", reason="Expected `int`",
                  raw='{"a": 1}'),
        Rejection(received_ns=6, origin="spool#é", row=1, field="", reason="not valid JSON", raw="\x00\n"),
    ]
    stats = [EmitterStats(ts_ns=7, source_id=2**64 - 1, instance="i", engine="e", emitted=2**64 - 1,
                          batches=3)]
    store.insert_rejections(rejections)
    store.insert_stats(stats)
    q = conform(store.query_arrow(f"SELECT * FROM {store.db}.quarantine ORDER BY received_ns"), Rejection)
    assert [msgspec.convert(r, Rejection) for r in q.to_pylist()] == rejections
    s = conform(store.query_arrow(f"SELECT * FROM {store.db}.emitter_stats FINAL"), EmitterStats)
    assert [msgspec.convert(r, EmitterStats) for r in s.to_pylist()] == stats


def test_extreme_values_survive_the_store(store):
    top = 2**64 - 1
    events = [
        Event(kind=EventKind.OFFLOAD, ts_ns=2**63 - 1, source_id=top, seq=top, component=ComponentKind.OTHER,
              block_key=top, parent_key=top, checksum=top, epoch=top, nbytes=top, src_tier=Tier.DEVICE,
              dst_tier=Tier.REMOTE, duration_ns=2**63 - 1, lease_expiry_ns=2**63 - 1, token_start=2**32 - 1,
              token_end=2**32 - 1, dp_rank=2**16 - 1, group_id=2**16 - 1, in_flight=True,
              engine="漢字\x00'\"\\", request_id="\n\t", group_block_keys=[[top, 0], [], [1]],
              group_hit_tokens=[2**32 - 1], reused_tiers=list(Tier)[1:], reused_tokens=[0, 1, 2, 2**32 - 1]),
        Event(kind=EventKind.INVALIDATE, ts_ns=1, source_id=1, seq=0, reason=Reason.ROLLBACK),
    ]
    store.insert_events(events)
    assert read_all(store) == sorted(events, key=event_key)


def test_insert_arrow_with_a_table_from_to_arrow(store):
    events = seeded_events(50, seed=4)
    assert store.insert_arrow("events", to_arrow(events)) == 50
    assert store.query_polars(f"SELECT count() AS n FROM {store.db}.events FINAL")["n"][0] == 50


# -- DSNs --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dsn", "path", "database"),
    [
        ("chdb:///var/lib/kv", "/var/lib/kv", DEFAULT_DATABASE),
        ("chdb:///var/lib/kv?database=traces_1", "/var/lib/kv", "traces_1"),
        ("chdb:///tmp/with%20space?database=x", "/tmp/with space", "x"),
        ("chdb://memory", ":memory:", DEFAULT_DATABASE),
        ("chdb://:memory:?database=m", ":memory:", "m"),
    ],
)
def test_parse_chdb_dsn(dsn, path, database):
    d = parse_dsn(dsn)
    assert (d.scheme, d.path, d.database, d.embedded) == ("chdb", path, database, True)
    assert parse_dsn(str(d)) == d  # str() is itself a DSN for the same store


def test_parse_http_dsn_hides_the_password():
    d = parse_dsn("https://alice:s3cr%40t%2Fx@ch.example.com:9443/prod_kv")
    assert d == Dsn("https", host="ch.example.com", port=9443, username="alice", password="s3cr@t/x",
                    database="prod_kv")
    assert not d.embedded
    assert "s3cr" not in str(d) and "s3cr" not in repr(d)
    assert str(d) == "https://alice@ch.example.com:9443/prod_kv"


def test_parse_http_dsn_defaults():
    assert parse_dsn("http://ch") == Dsn("http", host="ch", port=8123, database=DEFAULT_DATABASE)
    assert parse_dsn("https://ch").port == 8443
    assert parse_dsn("http://ch:1234?database=other").database == "other"
    assert parse_dsn("http://bob@ch/db").username == "bob"


@pytest.mark.parametrize(
    ("dsn", "message"),
    [
        ("postgres://u@h/db", "scheme must be chdb, http or https"),
        ("kvtrace.db", "scheme must be chdb, http or https"),
        ("chdb://relative/path", "absolute path"),
        ("chdb:relative/path", "absolute path"),
        ("chdb:///tmp/x?database=bad-name", "plain identifier"),
        ("chdb:///tmp/x?database=a;DROP", "plain identifier"),
        ("http://h:8123/x.y", "plain identifier"),
        ("http:///db", "no host"),
    ],
)
def test_bad_dsn_is_a_clear_store_error(dsn, message):
    with pytest.raises(StoreError, match=message) as err:
        parse_dsn(dsn)
    assert repr(dsn) in str(err.value)
    with pytest.raises(StoreError):
        Store(dsn)


def test_unreachable_server_is_a_store_error():
    s = Store("http://127.0.0.1:9/kv")
    assert not s.ping()
    cause = "cannot reach the ClickHouse server at http://default@127.0.0.1:9/kv: connection refused"
    with pytest.raises(StoreError, match=cause):
        _ = s.client
