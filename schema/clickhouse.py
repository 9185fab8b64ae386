"""ClickHouse DDL derived from the stored Structs: single-node and replicated cluster variants.

Tables are MergeTree partitioned by day. Events are a ReplacingMergeTree whose sort key ends in
the event id (source_id, seq) and the tenant, so an event delivered twice collapses to one row,
while a row another tenant sends under the same id stays a row of its own: no token can
replace a row of a tenant it may not write. The key starts with instance and time because
reconstruction reads one instance's stream in time order.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from kvtrace.schema.events import SCHEMA_VERSION, Event
from kvtrace.schema.fields import FieldSpec, field_specs
from kvtrace.schema.records import CalibrationSample, EmitterStats, Rejection, StateSnapshot
from kvtrace.schema.verdicts import LookupResult, Verification

DEFAULT_DATABASE = "kvtrace"


@dataclass(frozen=True, slots=True)
class TableSpec:
    """How one Struct is laid out as a table."""

    name: str
    struct: type[msgspec.Struct]
    time_column: str
    order_by: tuple[str, ...]
    shard_key: str
    replacing: bool = False
    indexes: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()


EVENTS = TableSpec(
    name="events",
    struct=Event,
    time_column="ts_ns",
    order_by=("instance", "ts_ns", "source_id", "seq", "tenant"),
    shard_key="cityHash64(instance)",
    replacing=True,
    indexes=(
        "INDEX idx_request request_id TYPE bloom_filter(0.01) GRANULARITY 4",
        "INDEX idx_block block_key TYPE bloom_filter(0.01) GRANULARITY 4",
        "INDEX idx_kind kind TYPE set(16) GRANULARITY 4",
    ),
    aliases=("ts DateTime64(9, 'UTC') ALIAS fromUnixTimestamp64Nano(ts_ns)",),
)
QUARANTINE = TableSpec(
    name="quarantine",
    struct=Rejection,
    time_column="received_ns",
    order_by=("received_ns", "origin", "row"),
    shard_key="rand()",
)
EMITTER_STATS = TableSpec(
    name="emitter_stats",
    struct=EmitterStats,
    time_column="ts_ns",
    order_by=("source_id", "writer", "ts_ns"),
    shard_key="source_id",
    replacing=True,
)
VERDICTS = TableSpec(  # written by the collector's live reconstruction, one row per lookup
    name="verdicts",
    struct=LookupResult,
    time_column="ts_ns",
    order_by=("instance", "ts_ns", "source_id", "seq", "tenant"),
    shard_key="cityHash64(instance)",
    replacing=True,  # a collector rebuilding an instance may write a lookup's row again
)
CALIBRATIONS = TableSpec(  # `kvtrace calibrate`: timings measured on a device, for cost models
    name="calibrations",
    struct=CalibrationSample,
    time_column="ts_ns",
    order_by=("model", "kind", "ts_ns"),
    shard_key="rand()",
)
VERIFICATIONS = TableSpec(  # `kvtrace verify` and engine canaries: requests re-executed without their cache
    name="verifications",
    struct=Verification,
    time_column="ts_ns",
    order_by=("instance", "ts_ns", "request_id", "tenant"),
    shard_key="cityHash64(instance)",
    replacing=True,  # a collector rebuilding an instance may judge a canary's probe again
)
SNAPSHOTS = TableSpec(  # `kvtrace analyze --since`: the streaming state at a position, per recipes + policy
    name="snapshots",
    struct=StateSnapshot,
    time_column="ts_ns",
    order_by=("fingerprint", "ts_ns", "source_id", "seq"),
    shard_key="rand()",  # on a cluster each shard's analysis keeps its own, in its local table
    replacing=True,  # the same range analysed again writes the same snapshot
)
TABLES: tuple[TableSpec, ...] = (EVENTS, QUARANTINE, EMITTER_STATS, VERDICTS, CALIBRATIONS, VERIFICATIONS,
                                 SNAPSHOTS)

# Default factories msgspec omits when empty (with omit_defaults); any other factory's value
# is always encoded.
_OMITTED_WHEN_EMPTY = (list, dict, set, frozenset, tuple, bytearray)


def zero_when_omitted(struct: type[msgspec.Struct]) -> bool:
    """Whether every field msgspec may leave out of a struct's JSON has the zero default its
    ClickHouse type gives, so JSON lines can be inserted with
    `input_format_defaults_for_omitted_fields = 0`: ClickHouse then skips tracking which fields
    each row omitted and evaluating DEFAULT expressions, ~20 % of its JSON parse. A field with a
    non-zero default must be required or always encoded (a default factory)."""
    specs = {s.name: s for s in field_specs(struct)}
    for f in msgspec.structs.fields(struct):
        if f.required and f.default_factory is msgspec.NODEFAULT:
            continue
        if f.default_factory is not msgspec.NODEFAULT and f.default_factory not in _OMITTED_WHEN_EMPTY:
            continue  # always encoded
        if _default_value(specs[f.name]) != _zero(specs[f.name]):
            return False
    return True
META_TABLE = "kvtrace_meta"


@dataclass(frozen=True, slots=True)
class DdlOptions:
    """Choices that change the DDL: where, how long to keep, and single node or cluster."""

    database: str = DEFAULT_DATABASE
    ttl_days: int = 0  # 0 keeps data forever
    cluster: str = ""  # non-empty: ReplicatedMergeTree + Distributed ON CLUSTER
    zk_prefix: str = "/clickhouse/tables/{shard}"

    def __post_init__(self) -> None:
        if not self.database.isidentifier():
            raise ValueError(f"database name {self.database!r} must be a plain identifier")
        if self.ttl_days < 0:
            raise ValueError(f"ttl_days must be >= 0, got {self.ttl_days}")
        if self.cluster and not self.cluster.replace("-", "_").isidentifier():
            raise ValueError(f"cluster name {self.cluster!r} must be a plain identifier")


def _literal(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, list) and not value:
        return "[]"
    raise TypeError(f"no ClickHouse literal for {value!r}")


def _zero(spec: FieldSpec) -> object:
    if spec.depth:
        return []
    if spec.column.clickhouse == "Bool":
        return False
    if "String" in spec.column.clickhouse:
        return ""
    return 0


def _default_value(spec: FieldSpec) -> object:
    """The field's default as stored (an enum member by its value)."""
    return spec.default.value if hasattr(spec.default, "value") else spec.default


def column_definition(spec: FieldSpec) -> str:
    """One column line; a non-zero default is spelled out so later-added columns fill right."""
    parts = [f"`{spec.name}`", spec.clickhouse_type]
    default = _default_value(spec)
    if spec.default is not None and default != _zero(spec):
        parts.append(f"DEFAULT {_literal(default)}")
    codec = "CODEC(Delta, ZSTD(1))" if spec.is_sorted else spec.column.codec
    if codec and spec.depth == 0:
        parts.append(codec)
    if spec.doc:
        parts.append(f"COMMENT {_literal(spec.doc)}")
    return " ".join(parts)


def _day(table: TableSpec) -> str:
    return f"toDate(fromUnixTimestamp64Nano({table.time_column}))"


def _ttl(table: TableSpec, opts: DdlOptions) -> str:
    """When a row expires: `ttl_days` after its own time."""
    return f"toDateTime(fromUnixTimestamp64Nano({table.time_column})) + INTERVAL {opts.ttl_days} DAY"


def _engine(table: TableSpec, opts: DdlOptions) -> str:
    base = "ReplacingMergeTree" if table.replacing else "MergeTree"
    if not opts.cluster:
        return f"{base}()"
    path = f"{opts.zk_prefix}/{opts.database}/{table.name}_local"
    return f"Replicated{base}('{path}', '{{replica}}')"


# Inserts that carry a de-duplication token (the collector's spool ranges) are dropped when
# the same token was inserted recently. Replicated tables keep such a window by default; a
# single-node table keeps none unless asked.
DEDUP_WINDOW = 10_000


# Parts smaller than this (uncompressed) are written compact, all columns in one file, instead
# of wide, a file pair per column: ~180 files per part for the events table, whose creation
# (inode allocation) cost as much CPU as parsing the rows. The collector's inserts (up to 32 MiB
# of JSON lines, ~15 MB in ClickHouse) stay compact; merges turn parts past it into wide ones,
# which column scans prefer. Measured on the collector's drain: ~11.5 -> ~8.3 us of CPU per
# event (docs/design/benchmark-history.md, bench_collector).
WIDE_PART_BYTES = 64 << 20


def table_settings(opts: DdlOptions) -> str:
    out = [f"min_bytes_for_wide_part = {WIDE_PART_BYTES}"]
    if not opts.cluster:
        out.append(f"non_replicated_deduplication_window = {DEDUP_WINDOW}")
    return ", ".join(out)


def _on_cluster(opts: DdlOptions) -> str:
    # Quoted: cluster names may hold '-', which a bare identifier cannot.
    return f" ON CLUSTER `{opts.cluster}`" if opts.cluster else ""


def storage_table(table: TableSpec, opts: DdlOptions) -> str:
    """The table that holds the rows: `<name>_local` on a cluster (its Distributed twin keeps
    the plain name), else the plain name."""
    return f"{table.name}_local" if opts.cluster else table.name


def create_table(table: TableSpec, opts: DdlOptions) -> str:
    """CREATE TABLE for one table (the `_local` one on a cluster)."""
    name = storage_table(table, opts)
    lines = [column_definition(s) for s in field_specs(table.struct)]
    lines += list(table.aliases) + list(table.indexes)
    body = ",\n    ".join(lines)
    ttl = f"\nTTL {_ttl(table, opts)}" if opts.ttl_days else ""
    return (
        f"CREATE TABLE IF NOT EXISTS {opts.database}.{name}{_on_cluster(opts)}\n(\n    {body}\n)\n"
        f"ENGINE = {_engine(table, opts)}\n"
        f"PARTITION BY {_day(table)}\n"
        f"ORDER BY ({', '.join(table.order_by)}){ttl}"
        + (f"\nSETTINGS {table_settings(opts)}" if table_settings(opts) else "")
    )


def create_distributed(table: TableSpec, opts: DdlOptions) -> str:
    """The Distributed table that fronts a cluster's `_local` tables under the plain name."""
    return (
        f"CREATE TABLE IF NOT EXISTS {opts.database}.{table.name}{_on_cluster(opts)}\n"
        f"AS {opts.database}.{table.name}_local\n"
        f"ENGINE = Distributed('{opts.cluster}', {opts.database}, {table.name}_local, {table.shard_key})"
    )


def create_meta(opts: DdlOptions) -> str:
    engine = (
        f"ReplicatedReplacingMergeTree('/clickhouse/tables/{opts.database}/{META_TABLE}', '{{replica}}', updated_ns)"
        if opts.cluster
        else "ReplacingMergeTree(updated_ns)"
    )
    return (
        f"CREATE TABLE IF NOT EXISTS {opts.database}.{META_TABLE}{_on_cluster(opts)}\n"
        "(\n    `key` String,\n    `value` String,\n    `updated_ns` Int64\n)\n"
        f"ENGINE = {engine}\nORDER BY key"
    )


def schema_statements(opts: DdlOptions = DdlOptions()) -> list[str]:
    """Every statement that creates the schema, in order; each is idempotent."""
    out = [f"CREATE DATABASE IF NOT EXISTS {opts.database}{_on_cluster(opts)}", create_meta(opts)]
    for table in TABLES:
        out.append(create_table(table, opts))
        if opts.cluster:
            out.append(create_distributed(table, opts))
    return out


def migration_statements(table: TableSpec, existing: set[str], opts: DdlOptions) -> list[str]:
    """ADD COLUMN for each field the stored table lacks; schema changes are additive."""
    specs = field_specs(table.struct)
    targets = [storage_table(table, opts), table.name] if opts.cluster else [table.name]
    out = []
    for i, spec in enumerate(specs):
        if spec.name in existing:
            continue
        after = f" AFTER `{specs[i - 1].name}`" if i else " FIRST"
        for target in targets:
            out.append(
                f"ALTER TABLE {opts.database}.{target}{_on_cluster(opts)} "
                f"ADD COLUMN IF NOT EXISTS {column_definition(spec)}{after}"
            )
    return out


REKEY_SUFFIX = "__rekey"


def sorting_key(table: TableSpec) -> str:
    """The sort key as `system.tables.sorting_key` spells it."""
    return ", ".join(table.order_by)


def rekey_statements(table: TableSpec, opts: DdlOptions) -> list[str]:
    """Statements that give a single-node table made by an earlier version this version's sort
    key (ClickHouse cannot change the key of a table in place): a new table beside it, every
    row copied, the two swapped atomically, the old one dropped. A crash part-way leaves the
    `__rekey` table, which the next run drops before it starts again."""
    if opts.cluster:
        raise ValueError(f"{opts.database}.{table.name}: changing the sort key of a replicated table is not "
                         "automated; see docs/store.md (re-keying a cluster)")
    name, spare = f"{opts.database}.{table.name}", f"{opts.database}.{table.name}{REKEY_SUFFIX}"
    create = create_table(table, opts).replace(f"{name}\n", f"{spare}\n", 1)
    columns = ", ".join(f"`{s.name}`" for s in field_specs(table.struct))
    return [f"DROP TABLE IF EXISTS {spare}", create,
            f"INSERT INTO {spare} ({columns}) SELECT {columns} FROM {name}",
            f"EXCHANGE TABLES {name} AND {spare}", f"DROP TABLE {spare}"]


def settings_statements(opts: DdlOptions) -> list[str]:
    """ALTERs that give tables made by an earlier version this version's settings (and the TTL,
    when one is asked for): CREATE ... IF NOT EXISTS leaves an existing table as it was."""
    out = []
    for table in TABLES:
        target = f"{opts.database}.{storage_table(table, opts)}{_on_cluster(opts)}"
        out.append(f"ALTER TABLE {target} MODIFY SETTING {table_settings(opts)}")
        if opts.ttl_days:
            out.append(f"ALTER TABLE {target} MODIFY TTL {_ttl(table, opts)}")
    return out


def schema_version_row() -> tuple[str, str]:
    return ("schema_version", str(SCHEMA_VERSION))
