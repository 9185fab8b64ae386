"""Every format derived from the Event Struct agrees with it, and the DDL runs on real ClickHouse."""

from __future__ import annotations

import dataclasses
import re
import time

import pytest

from kvtrace.schema.arrow import arrow_schema, arrow_type, conform, from_arrow, to_arrow
from kvtrace.schema.clickhouse import (
    EMITTER_STATS,
    EVENTS,
    META_TABLE,
    QUARANTINE,
    TABLES,
    DdlOptions,
    create_table,
    migration_statements,
    schema_statements,
    settings_statements,
)
from kvtrace.schema.events import FIELD_NAMES, SCHEMA_VERSION, Event
from kvtrace.schema.fields import field_specs
from kvtrace.schema.jsonschema import batch_json_schema, event_json_schema
from kvtrace.schema.kinds import ComponentKind, EventKind, Reason, Tier, Transform
from kvtrace.schema.records import EmitterStats, Rejection
from kvtrace.store.client import Store
from kvtrace.store.dsn import StoreError

_COLUMN_LINE = re.compile(r"^\s*`([^`]+)` ", re.MULTILINE)


def _ddl_columns(stmt: str) -> list[str]:
    return _COLUMN_LINE.findall(stmt)


def _stored_columns(store: Store, table: str) -> list[tuple[str, str]]:
    """(name, type) of a real table's stored columns, in position order (ALIAS columns left out)."""
    return [
        (r[0], r[1])
        for r in store.client.query(
            "SELECT name, type FROM system.columns WHERE database = {db:String} AND table = {t:String} "
            "AND default_kind != 'ALIAS' ORDER BY position",
            parameters={"db": store.db, "t": table},
        ).result_rows
    ]


def _format_query(store: Store, stmt: str) -> str:
    """ClickHouse's own parser on a statement: raises if the engine cannot parse it.

    (`client.command` would hand the text back TSV-escaped; a query returns it as is.)
    """
    return store.client.query("SELECT formatQuery({q:String})", parameters={"q": stmt}).result_rows[0][0]


# -- one field list everywhere --------------------------------------------------------------------


def test_field_names_are_the_struct_fields():
    assert FIELD_NAMES == Event.__struct_fields__
    assert tuple(s.name for s in field_specs(Event)) == FIELD_NAMES
    assert FIELD_NAMES[:4] == ("kind", "ts_ns", "source_id", "seq")


@pytest.mark.parametrize("cluster", ["", "c1"])
def test_ddl_lists_exactly_the_event_fields_in_order(cluster):
    opts = DdlOptions(database="kv", cluster=cluster, ttl_days=7 if cluster else 0)
    stmt = create_table(EVENTS, opts)
    assert _ddl_columns(stmt) == list(FIELD_NAMES)
    for table in (QUARANTINE, EMITTER_STATS):
        assert _ddl_columns(create_table(table, opts)) == list(table.struct.__struct_fields__)


def test_arrow_schema_lists_exactly_the_event_fields_in_order():
    schema = arrow_schema()
    assert tuple(schema.names) == FIELD_NAMES
    assert schema.metadata[b"kvtrace.schema_version"] == str(SCHEMA_VERSION).encode()
    for field, spec in zip(schema, field_specs(Event), strict=True):
        assert field.type == arrow_type(spec)
        assert not field.nullable
    assert tuple(arrow_schema(Rejection).names) == Rejection.__struct_fields__
    assert tuple(arrow_schema(EmitterStats).names) == EmitterStats.__struct_fields__


def test_json_schema_lists_exactly_the_event_fields_in_order():
    schema = event_json_schema()
    event = schema["$defs"][schema["$ref"].rsplit("/", 1)[1]]
    assert tuple(event["properties"]) == FIELD_NAMES
    assert schema["$schema"].endswith("2020-12/schema")
    assert f"v{SCHEMA_VERSION}" in schema["$id"]


def test_json_schema_requires_the_event_id_and_time():
    event = event_json_schema()["$defs"]["Event"]
    assert sorted(event["required"]) == sorted(["kind", "ts_ns", "source_id", "seq"])
    batch = batch_json_schema()
    assert sorted(batch["$defs"]["Event"]["required"]) == sorted(["kind", "ts_ns", "source_id", "seq"])
    assert "EmitterStats" in batch["$defs"]


@pytest.mark.parametrize("enum_type", [EventKind, ComponentKind, Tier, Transform, Reason])
def test_json_schema_lists_every_enum_value(enum_type):
    defs = event_json_schema()["$defs"]
    assert sorted(defs[enum_type.__name__]["enum"]) == sorted(m.value for m in enum_type)
    # The enum is referenced by each field that uses it, lists included.
    props = defs["Event"]["properties"]
    users = [s.name for s in field_specs(Event) if s.enum_type is enum_type]
    assert users
    for name in users:
        text = repr(props[name])
        assert f"#/$defs/{enum_type.__name__}" in text


def test_integer_bounds_reach_the_json_schema():
    props = event_json_schema()["$defs"]["Event"]["properties"]
    assert props["dp_rank"]["maximum"] == 2**16 - 1
    assert props["token_end"]["maximum"] == 2**32 - 1
    assert props["nbytes"]["minimum"] == 0
    assert props["group_hit_tokens"]["items"]["maximum"] == 2**32 - 1


def test_conform_fills_columns_an_older_writer_lacked():
    e = Event(kind=EventKind.COMMIT, ts_ns=5, source_id=9, seq=1, component=ComponentKind.MAMBA,
              block_key=3, tier=Tier.HOST, transform=Transform.FP8, recomputed_tokens=4)
    full = to_arrow([e])
    old = full.drop_columns(["transform", "recomputed_tokens", "schema_version"])
    back = from_arrow(conform(old))
    assert back == [Event(kind=EventKind.COMMIT, ts_ns=5, source_id=9, seq=1, component=ComponentKind.MAMBA,
                          block_key=3, tier=Tier.HOST)]
    assert back[0].transform is Transform.EXACT
    assert back[0].schema_version == SCHEMA_VERSION


# -- the DDL on the real engine ------------------------------------------------------------------


@pytest.mark.parametrize(("cluster", "spelled"), [("c1", "c1"), ("my-cluster", "`my-cluster`")])
def test_cluster_ddl_is_accepted_by_clickhouse(store, cluster, spelled):
    opts = DdlOptions(database="kvc", cluster=cluster, ttl_days=7)
    stmts = schema_statements(opts)
    # database, meta, and a _local + Distributed pair per table
    assert len(stmts) == 2 + 2 * len(TABLES)
    formatted = [_format_query(store, s) for s in stmts]
    for stmt, text in zip(stmts, formatted, strict=True):
        assert f"ON CLUSTER {spelled}" in text, stmt
    assert formatted[0].startswith("CREATE DATABASE IF NOT EXISTS kvc")
    assert "ReplicatedReplacingMergeTree" in formatted[1]  # meta
    for i, table in enumerate(TABLES):
        local, dist = formatted[2 + 2 * i], formatted[3 + 2 * i]
        assert f"kvc.{table.name}_local" in local
        engine = "ReplicatedReplacingMergeTree" if table.replacing else "ReplicatedMergeTree"
        zk_path = f"/clickhouse/tables/{{shard}}/kvc/{table.name}_local"
        assert f"ENGINE = {engine}('{zk_path}', '{{replica}}')" in local
        assert "toIntervalDay(7)" in local
        assert f"Distributed('{cluster}', kvc, {table.name}_local" in dist
        assert f"AS kvc.{table.name}_local" in dist


def test_cluster_migrations_are_accepted_by_clickhouse(store):
    opts = DdlOptions(database="kvc", cluster="c1")
    stmts = migration_statements(EVENTS, set(FIELD_NAMES) - {"transform", "kind"}, opts)
    # each missing column is added to the _local table and to the Distributed front
    assert len(stmts) == 4
    texts = [_format_query(store, s) for s in stmts]
    assert all("ON CLUSTER c1" in t and "ADD COLUMN IF NOT EXISTS" in t for t in texts)
    assert "kvc.events_local" in texts[0] and "FIRST" in texts[0]
    assert "`transform` LowCardinality(String) DEFAULT 'exact'" in texts[2]
    assert "AFTER tenant" in texts[2]


def test_cluster_settings_statements_are_accepted_by_clickhouse(store):
    """What `Store.init` runs on every start to bring older tables' settings and TTL up to date:
    aimed at the `_local` tables, on the whole cluster."""
    opts = DdlOptions(database="kvc", cluster="my-cluster", ttl_days=3)
    texts = [_format_query(store, s) for s in settings_statements(opts)]
    assert len(texts) == 2 * len(TABLES)
    for table, setting, ttl in zip(TABLES, texts[0::2], texts[1::2], strict=True):
        assert setting.startswith(f"ALTER TABLE kvc.{table.name}_local ON CLUSTER `my-cluster`")
        assert "MODIFY SETTING min_bytes_for_wide_part" in setting
        assert ttl.startswith(f"ALTER TABLE kvc.{table.name}_local ON CLUSTER `my-cluster`")
        assert "MODIFY TTL" in ttl and "toIntervalDay(3)" in ttl
    assert not any("TTL" in s for s in settings_statements(DdlOptions(database="kv")))


def test_single_node_ddl_creates_every_table(store):
    tables = {
        r[0]
        for r in store.client.query(
            "SELECT name FROM system.tables WHERE database = {db:String}", parameters={"db": store.db}
        ).result_rows
    }
    assert tables == {t.name for t in TABLES} | {META_TABLE}
    stored = _stored_columns(store, EVENTS.name)
    assert [n for n, _ in stored] == list(FIELD_NAMES)
    assert [t for _, t in stored] == [s.clickhouse_type for s in field_specs(Event)]
    for table in (QUARANTINE, EMITTER_STATS):
        cols = _stored_columns(store, table.name)
        assert [n for n, _ in cols] == list(table.struct.__struct_fields__)
    engine = store.scalar(
        "SELECT engine FROM system.tables WHERE database = {db:String} AND name = 'events'", {"db": store.db}
    )
    assert engine == "ReplacingMergeTree"
    # the ALIAS column gives readable time without storing it
    store.insert_events([Event(kind=EventKind.INVALIDATE, ts_ns=1_700_000_000_123_456_789, source_id=1, seq=0,
                               reason=Reason.RESET)])
    assert store.scalar(f"SELECT toString(ts) FROM {store.db}.events") == "2023-11-14 22:13:20.123456789"
    assert store.stored_schema_version() == SCHEMA_VERSION


def test_init_is_idempotent(store):
    assert store.init() == []
    assert store.init() == []
    assert store.stored_schema_version() == SCHEMA_VERSION


def test_init_with_ttl_sets_ttl_on_every_table(store):
    assert store.init(ttl_days=7) == []
    for table in TABLES:
        engine_full = store.scalar(
            "SELECT engine_full FROM system.tables WHERE database = {db:String} AND name = {t:String}",
            {"db": store.db, "t": table.name},
        )
        assert "TTL" in engine_full and "toIntervalDay(7)" in engine_full, engine_full


def _event(i: int, **kw: object) -> Event:
    return Event(kind=EventKind.ADOPT, ts_ns=1_750_000_000_000_000_000 + i, source_id=77, seq=i,
                 request_id=f"r{i}", **kw)


@pytest.mark.parametrize("meta", ["keep", "drop"])
def test_init_migrates_a_table_that_lacks_columns(store, meta):
    db = store.db
    # a store written by an earlier kvtrace: no recomputed_tokens, no transform
    store.client.command(f"ALTER TABLE {db}.events DROP COLUMN recomputed_tokens")
    store.client.command(f"ALTER TABLE {db}.events DROP COLUMN transform")
    if meta == "drop":
        store.client.command(f"DROP TABLE {db}.{META_TABLE}")
    old_cols = [n for n, _ in _stored_columns(store, "events")]
    assert "recomputed_tokens" not in old_cols and "transform" not in old_cols
    # a row it stored before the upgrade
    store.client.command(
        f"INSERT INTO {db}.events (kind, ts_ns, source_id, seq, request_id) "
        "VALUES ('adopt', 1750000000000000000, 77, 0, 'r0')"
    )

    applied = store.init()

    added = [s for s in applied if "ADD COLUMN" in s]
    assert len(added) == 2
    assert any("`recomputed_tokens`" in s for s in added)
    assert any("`transform`" in s for s in added)
    assert any(s.startswith("schema_version") for s in applied) == (meta == "drop")
    assert [n for n, _ in _stored_columns(store, "events")] == list(FIELD_NAMES)
    assert store.stored_schema_version() == SCHEMA_VERSION
    assert store.init() == []

    new = [_event(1, recomputed_tokens=123, transform=Transform.INT8, reused_tiers=[Tier.HOST],
                  reused_tokens=[16])]
    store.insert_events(new)
    back = [e for t in store.iter_event_batches() for e in from_arrow(t)]
    # the old row reads the added columns' defaults (transform's is 'exact', not '')
    assert back == [_event(0), *new]
    assert back[0].transform is Transform.EXACT


def _sorting_key(store: Store, table: str) -> str:
    return store.client.query(
        "SELECT sorting_key FROM system.tables WHERE database = {db:String} AND name = {t:String}",
        parameters={"db": store.db, "t": table}).result_rows[0][0]


@pytest.mark.parametrize("crashed", [False, True], ids=["clean", "after-a-crash"])
def test_init_rekeys_a_store_whose_event_identity_lacked_the_tenant(store, crashed):
    """Schema 6 keyed events on (instance, ts_ns, source_id, seq) and stats on (source_id,
    ts_ns): a tenant re-sending another's event id replaced its row. init gives the stored
    tables the new keys, every row kept; a crash that left the copy behind is started over."""
    db, opts = store.db, DdlOptions(database=store.db)
    old_events = dataclasses.replace(EVENTS, order_by=("instance", "ts_ns", "source_id", "seq"))
    old_stats = dataclasses.replace(EMITTER_STATS, order_by=("source_id", "ts_ns"))
    for table in (old_events, old_stats):
        store.client.command(f"DROP TABLE {db}.{table.name}")
        store.client.command(create_table(table, opts))
    store.client.command(f"ALTER TABLE {db}.emitter_stats DROP COLUMN writer")
    rows = [_event(i, tenant="beta") for i in range(50)]
    store.insert_events(rows)
    store.client.command(f"INSERT INTO {db}.emitter_stats (ts_ns, source_id, emitted) VALUES (1, 5, 50)")
    if crashed:  # a run that died after creating (and part-filling) its copy
        store.client.command(create_table(EVENTS, opts).replace(f"{db}.events\n", f"{db}.events__rekey\n", 1))
        store.insert_arrow("events__rekey", to_arrow(rows[:10]))
    applied = store.init()
    assert [a for a in applied if "sort key" in a] == [
        f"{db}.events: sort key (instance,ts_ns,source_id,seq) -> (instance, ts_ns, source_id, seq, tenant)",
        f"{db}.emitter_stats: sort key (source_id,ts_ns) -> (source_id, writer, ts_ns)"]
    assert _sorting_key(store, "events") == "instance, ts_ns, source_id, seq, tenant"
    assert _sorting_key(store, "emitter_stats") == "source_id, writer, ts_ns"
    tables = {r[0] for r in store.client.query(f"SHOW TABLES FROM {db}").result_rows}
    assert not {t for t in tables if t.endswith("__rekey")}
    assert sorted((e for t in store.iter_event_batches() for e in from_arrow(t)), key=lambda e: e.seq) == rows
    assert store.scalar(f"SELECT emitted FROM {db}.emitter_stats") == 50
    # the same event id under another tenant is now a row of its own
    store.insert_events([Event(kind=EventKind.ADOPT, ts_ns=rows[0].ts_ns, source_id=77, seq=0, request_id="forged",
                              tenant="alpha")])
    assert store.scalar(f"SELECT count() FROM {db}.events FINAL") == 51
    assert store.init() == []


def test_init_refuses_a_store_from_a_newer_kvtrace(store):
    store.client.insert(
        f"{store.db}.{META_TABLE}",
        [["schema_version", "999", time.time_ns() + 10**9]],
        column_names=["key", "value", "updated_ns"],
    )
    assert store.stored_schema_version() == 999
    with pytest.raises(StoreError, match="newer") as err:
        store.init()
    assert "999" in str(err.value)
    with pytest.raises(StoreError, match="schema version 999"):
        store.require_schema()


def test_require_schema_on_an_empty_database(store_dsn):
    with Store(store_dsn) as s:
        assert s.stored_schema_version() is None
        with pytest.raises(StoreError, match="kvtrace db init"):
            s.require_schema()
        assert s.status().schema_version is None
