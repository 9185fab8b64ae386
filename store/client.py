"""The ClickHouse store behind one DSN: embedded chDB by default, a server in production.

`chdb:///path` runs the real ClickHouse engine in-process through clickhouse-connect's chDB
backend; `http(s)://user:pass@host:8123/db` talks to a server. Everything above this module
uses the same SQL either way. All writes go through Arrow, the columnar hand-off.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import ssl
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import clickhouse_connect
import msgspec
import polars as pl
import pyarrow as pa

from kvtrace.schema.arrow import conform, to_arrow
from kvtrace.schema.clickhouse import (
    CALIBRATIONS,
    EMITTER_STATS,
    EVENTS,
    META_TABLE,
    QUARANTINE,
    REKEY_SUFFIX,
    SNAPSHOTS,
    TABLES,
    VERDICTS,
    VERIFICATIONS,
    DdlOptions,
    migration_statements,
    rekey_statements,
    schema_statements,
    settings_statements,
    sorting_key,
    storage_table,
    zero_when_omitted,
)
from kvtrace.schema.events import SCHEMA_VERSION, Event
from kvtrace.schema.kinds import Ending
from kvtrace.schema.recipes import Recipe, recipe_from_json
from kvtrace.schema.records import CalibrationSample, EmitterStats, Rejection, StateSnapshot
from kvtrace.schema.verdicts import LookupResult, Verification
from kvtrace.store.dsn import StoreError, default_dsn, parse_dsn
from kvtrace.store.owner import in_use_message, lock_holder, read_owner

# The driver logs a warning for each failed HTTP attempt ("Unexpected Http Driver Exception")
# and then raises; the StoreError raised from that says it once, with the cause.
logging.getLogger("clickhouse_connect").setLevel(logging.ERROR)

_ZERO_WHEN_OMITTED = frozenset(t.name for t in TABLES if zero_when_omitted(t.struct))


@dataclass(frozen=True, slots=True)
class TableStatus:
    name: str
    rows: int
    bytes_on_disk: int
    partitions: int


@dataclass(frozen=True, slots=True)
class EmitterEnd:
    """One emitter as its latest stats row says it is, beside what the store holds of it."""

    source_id: int
    instance: str
    engine: str
    ended: Ending
    ended_ns: int
    emitted: int  # events handed to its emit(), as it counted them
    dropped: int  # of those, lost for a reason it counted (buffer full, export failed, invalid, shutdown)
    recovered: int  # shipped from its journal after its process ended
    stored: int  # distinct events of this source in the store
    max_seq: int  # the highest seq stored, -1 when none is
    missing: int  # its sequence gap: events it numbered (by its count, or by a higher seq stored)
    # that the store does not hold
    writer: str = ""  # the tenants of the token that reported it ('' an operator's, or open)

    @property
    def unaccounted(self) -> int:
        """Missing events its own counters do not explain."""
        return max(0, self.missing - self.dropped)


@dataclass(frozen=True, slots=True)
class StoreStatus:
    dsn: str
    server_version: str
    schema_version: int | None  # None: `kvtrace db init` has not run
    code_schema_version: int
    tables: tuple[TableStatus, ...]
    sources: int
    dropped_events: int  # reported by emitters (latest counters per source and writer)
    unclean: tuple[EmitterEnd, ...] = ()  # emitters whose process died before they shut down


@dataclass(frozen=True, slots=True)
class AttachedEngine:
    """An instance's engine as its shim last reported it when it attached (an attach event)."""

    instance: str
    engine: str
    engine_version: str
    model: str
    model_revision: str
    kv_dtype: str
    max_model_len: int
    block_size: int
    recipe: Recipe
    source_id: int  # the attaching process's emitter
    attached_ns: int


def endings_sql(db: str, having: str = "1") -> str:
    """Each emitter as its latest stats row says it is (how it ended, its counters) beside what
    the store holds of its events, with its sequence gap as `missing`: one query, which
    `Store.emitter_endings` and the dashboards' panel both run. `having` filters the emitters
    (`ended`, `ended_ns`, `instance`, ... as of their latest row)."""
    latest = (
        "SELECT source_id, writer, argMax(instance, ts_ns) AS instance, argMax(engine, ts_ns) AS engine, "
        "argMax(ended, ts_ns) AS ended, argMax(ended_ns, ts_ns) AS ended_ns, argMax(emitted, ts_ns) AS emitted, "
        "argMax(dropped_queue_full + dropped_export_failed + dropped_invalid + dropped_shutdown, ts_ns) "
        "AS dropped, argMax(recovered, ts_ns) AS recovered "
        f"FROM {db}.{EMITTER_STATS.name} GROUP BY source_id, writer HAVING {having}"
    )
    return (
        f"WITH latest AS ({latest}) "
        "SELECT l.source_id AS source_id, l.writer AS writer, l.instance AS instance, l.engine AS engine, "
        "l.ended AS ended, "
        "l.ended_ns AS ended_ns, l.emitted AS emitted, l.dropped AS dropped, l.recovered AS recovered, "
        "ifNull(e.stored, 0) AS stored, if(ifNull(e.seen, 0) = 1, assumeNotNull(e.max_seq), -1) AS max_seq, "
        "toInt64(greatest(l.emitted, max_seq + 1)) - toInt64(stored) AS missing "
        "FROM latest AS l LEFT JOIN ("  # an emitter with no event stored: seen is 0 or NULL (join_use_nulls)
        "SELECT source_id, uniqExact(seq) AS stored, toInt64(max(seq)) AS max_seq, 1 AS seen "
        f"FROM {db}.{EVENTS.name} WHERE source_id IN (SELECT source_id FROM latest) GROUP BY source_id"
        ") AS e ON e.source_id = l.source_id"
    )


def _first_line(text: str, limit: int = 300) -> str:
    """The part of a driver or engine message that names the cause: ClickHouse's
    `Code: N. DB::Exception: why. (NAME)` cut to `why`, and no stack."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    line = next((x for x in lines if "DB::Exception:" in x), lines[0] if lines else "no reason given")
    line = re.sub(r"^.*?DB::Exception:\s*", "", line)
    line = re.sub(r"\s*\([A-Z_]+\)\s*$", "", line).rstrip(". ")
    return line[:limit]


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """The exception, what it was raised from, and urllib3's `reason`s, each once."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        reason = getattr(e, "reason", None)
        todo += [e.__cause__, e.__context__, reason if isinstance(reason, BaseException) else None]


def unreachable_cause(exc: BaseException) -> str:
    """Why a ClickHouse server did not answer, in a few words and a way out."""
    for e in _causes(exc):
        if isinstance(e, ConnectionRefusedError):
            return "connection refused (is the server running, and on this port?)"
        if isinstance(e, socket.gaierror):
            return "the host name does not resolve"
        if isinstance(e, ssl.SSLError):
            return f"TLS failed ({e.reason or e}); use http:// for a server without TLS"
        if isinstance(e, (TimeoutError, socket.timeout)) or type(e).__name__.endswith("TimeoutError"):
            return "no answer before the timeout"
        if isinstance(e, OSError) and e.strerror:
            return e.strerror.lower()
    text = str(exc)
    if "Authentication failed" in text or "Code: 516" in text:
        return "the server refused the user name or password"
    return _first_line(text)


def driver_failure(exc: BaseException) -> str | None:
    """One line for an error the driver or engine raised after the store was opened (the
    server went away, a query it refused), None for any other exception."""
    if type(exc).__module__.split(".")[0] not in ("clickhouse_connect", "chdb"):
        return None
    if any(isinstance(e, (ConnectionError, socket.gaierror, TimeoutError)) for e in _causes(exc)):
        return f"the ClickHouse server stopped answering: {unreachable_cause(exc)}"
    return f"the store refused: {_first_line(str(exc))}"


@dataclass
class _Held:
    """stderr written while the embedded engine opened."""

    refused: bool = False
    lines: list[str] = field(default_factory=list)

    def engine_said(self) -> str:
        return "\n".join(line for line in self.lines if "DB::Exception" in line)


@contextlib.contextmanager
def _held_stderr() -> Iterator[_Held]:
    """Send file descriptor 2 to a temporary file while the block runs, then pass on what was
    written there, less the engine's own refusal lines when the open failed (the StoreError
    says it in one line instead)."""
    held = _Held()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to hold
        yield held
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield held
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            held.lines = tmp.read().decode(errors="replace").splitlines()
            rest = [line for line in held.lines if not (held.refused and "DB::Exception" in line)]
            if rest:
                os.write(2, ("\n".join(rest) + "\n").encode())


class Store:
    """Reads and writes kvtrace tables.

    clickhouse-connect clients are not safe for concurrent calls, so one instance's calls are
    serialized. Two instances on the same DSN run side by side: each has its own connection (for
    the embedded store, its own connection to the process's one engine)."""

    def __init__(self, dsn: str | None = None) -> None:
        self.dsn = parse_dsn(dsn or default_dsn())
        self.db = self.dsn.database
        self.last_ping_error = ""
        self._lock = threading.RLock()
        self._client: Any = None

    # -- connection --------------------------------------------------------------------------
    @property
    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = self._connect()
            return self._client

    def _connect(self) -> Any:
        d = self.dsn
        if d.embedded:
            return self._open_embedded()
        try:
            return clickhouse_connect.get_client(
                host=d.host,
                port=d.port,
                username=d.username,
                password=d.password,
                secure=d.scheme == "https",
                compress="lz4",
            )
        except Exception as exc:
            raise StoreError(f"cannot reach the ClickHouse server at {d}: {unreachable_cause(exc)}") from exc

    def _open_embedded(self) -> Any:
        """Open the chDB engine; when it refuses, say why in one line. The engine prints its own
        refusal (ClickHouse internals) on stderr, so stderr is held while it opens and only what
        is not that refusal is passed on."""
        d = self.dsn
        if d.path == ":memory:":
            return clickhouse_connect.get_client(dsn="chdb://memory")
        try:
            Path(d.path).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the embedded store at {d.path}: {exc.strerror}") from None
        with _held_stderr() as held:
            try:
                return clickhouse_connect.get_client(dsn=f"chdb://{d.path}")
            except Exception as exc:
                held.refused = True
                holder = lock_holder(d.path)
                if holder is not None and holder != os.getpid():
                    raise StoreError(in_use_message(d.path, holder, read_owner(d.path))) from None
                said = held.engine_said() or str(exc)
                raise StoreError(f"cannot open the embedded store at {d.path}: {_first_line(said)}") from exc

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ping(self) -> bool:
        """Whether the store answers; when it does not, `last_ping_error` says why."""
        try:
            with self._lock:
                ok = self.client.command("SELECT 1") == 1
            self.last_ping_error = "" if ok else "SELECT 1 did not answer 1"
        except Exception as exc:  # noqa: BLE001 - a health check answers, it does not raise
            self.last_ping_error = f"{type(exc).__name__}: {str(exc).strip() or 'no reason given'}"[:500]
            return False
        return ok

    # -- schema ------------------------------------------------------------------------------
    def stored_schema_version(self) -> int | None:
        with self._lock:
            exists = self.client.command(f"EXISTS TABLE {self.db}.{META_TABLE}")
            if not exists:
                return None
            rows = self.client.query(
                f"SELECT argMax(value, updated_ns) FROM {self.db}.{META_TABLE} WHERE key = 'schema_version'"
            ).result_rows
        value = rows[0][0] if rows else ""
        return int(value) if value else None

    def init(self, ttl_days: int = 0, cluster: str = "") -> list[str]:
        """Create or migrate every table; idempotent. Returns the statements that changed anything.

        Refuses a store written by a newer kvtrace, whose rows this version may not understand.
        """
        opts = DdlOptions(database=self.db, ttl_days=ttl_days, cluster=cluster)
        stored = self.stored_schema_version()
        if stored is not None and stored > SCHEMA_VERSION:
            raise StoreError(
                f"store {self.dsn} has schema version {stored}, newer than this kvtrace "
                f"({SCHEMA_VERSION}); upgrade kvtrace instead of downgrading the store"
            )
        applied: list[str] = []
        with self._lock:
            for stmt in schema_statements(opts):
                self.client.command(stmt)
            for table in TABLES:
                name = storage_table(table, opts)
                existing = {
                    r[0]
                    for r in self.client.query(
                        "SELECT name FROM system.columns WHERE database = {db:String} AND table = {t:String}",
                        parameters={"db": self.db, "t": name},
                    ).result_rows
                }
                for stmt in migration_statements(table, existing, opts):
                    self.client.command(stmt)
                    applied.append(stmt)
            applied += self._rekey(opts)
            for stmt in settings_statements(opts):  # stores made before a setting existed get it too
                self.client.command(stmt)
            if stored != SCHEMA_VERSION:
                self.client.insert(
                    f"{self.db}.{META_TABLE}",
                    [["schema_version", str(SCHEMA_VERSION), time.time_ns()]],
                    column_names=["key", "value", "updated_ns"],
                )
                applied.append(f"schema_version {stored} -> {SCHEMA_VERSION}")
        return applied

    def _rekey(self, opts: DdlOptions) -> list[str]:
        """Give tables an earlier version made this version's sort key (see `rekey_statements`).
        Runs under the store's lock: a collector starting on an old store waits for its copy."""
        rows = self.client.query(
            "SELECT name, sorting_key FROM system.tables WHERE database = {db:String}",
            parameters={"db": self.db}).result_rows
        keys = {name: key.strip("()").replace(" ", "") for name, key in rows}
        applied: list[str] = []
        for table in TABLES:
            name = storage_table(table, opts)
            if f"{name}{REKEY_SUFFIX}" in keys and keys.get(name) == sorting_key(table).replace(" ", ""):
                self.client.command(f"DROP TABLE IF EXISTS {self.db}.{name}{REKEY_SUFFIX}")  # a crash after the swap
            if name not in keys or keys[name] == sorting_key(table).replace(" ", ""):
                continue
            try:
                statements = rekey_statements(table, opts)
            except ValueError as exc:
                raise StoreError(str(exc)) from None
            for stmt in statements:
                self.client.command(stmt)
            applied.append(f"{self.db}.{name}: sort key ({keys[name]}) -> ({sorting_key(table)})")
        return applied

    def require_schema(self) -> None:
        version = self.stored_schema_version()
        if version is None:
            raise StoreError(f"store {self.dsn} has no kvtrace tables; run `kvtrace db init` first")
        if version != SCHEMA_VERSION:
            raise StoreError(
                f"store {self.dsn} is at schema version {version}, this kvtrace writes {SCHEMA_VERSION}; "
                "run `kvtrace db init` to migrate"
            )

    # -- writes ------------------------------------------------------------------------------
    # A backfill (an old trace, a long export) legitimately spans many daily partitions; the
    # server's default cap of 100 per insert would reject it, and only throws the rows away.
    INSERT_SETTINGS = {"max_partitions_per_insert_block": 10000}

    def insert_arrow(self, table: str, data: pa.Table, dedup_token: str = "") -> int:
        """Insert rows; with `dedup_token`, a repeat of the same token's insert is dropped by the
        server (the collector's exactly-once drain)."""
        if data.num_rows:
            with self._lock:
                self.client.insert_arrow(f"{self.db}.{table}", data, settings=self._insert_settings(dedup_token))
        return data.num_rows

    def _insert_settings(self, dedup_token: str, **more: Any) -> dict[str, Any]:
        settings = {**self.INSERT_SETTINGS, **more}
        if dedup_token:
            settings["insert_deduplication_token"] = dedup_token
        return settings

    def insert_arrow_stream(self, table: str, stream: bytes | pa.Buffer, columns: Sequence[str],
                            dedup_token: str = "") -> None:
        """Insert an Arrow IPC stream as it is (its buffers may be LZ4- or zstd-compressed):
        ClickHouse reads it, where `insert_arrow` would first write the table out again."""
        with self._lock:
            self.client.raw_insert(f"{self.db}.{table}", list(columns), insert_block=stream,
                                   settings=self._insert_settings(dedup_token), fmt="ArrowStream")

    def insert_json_lines(self, table: str, lines: bytes, dedup_token: str = "") -> None:
        """Insert rows given as JSON lines (JSONEachRow), parsed by ClickHouse itself: for
        validated events this is about twice as fast as building Arrow columns in Python."""
        if lines:
            # Parse in parallel from 1 MiB pieces (the default waits for 10 MiB): +25 % rows/s.
            settings = self._insert_settings(dedup_token, min_chunk_bytes_for_parallel_parsing=1 << 20)
            if table in _ZERO_WHEN_OMITTED:
                settings["input_format_defaults_for_omitted_fields"] = 0
            with self._lock:
                self.client.raw_insert(f"{self.db}.{table}", insert_block=lines, settings=settings,
                                       fmt="JSONEachRow")

    def insert_events(self, events: Sequence[Event]) -> int:
        return self.insert_arrow(EVENTS.name, to_arrow(events))

    def insert_rejections(self, rejections: Sequence[Rejection]) -> int:
        return self.insert_arrow(QUARANTINE.name, to_arrow(rejections, Rejection))

    def insert_stats(self, stats: Sequence[EmitterStats]) -> int:
        return self.insert_arrow(EMITTER_STATS.name, to_arrow(stats, EmitterStats))

    def insert_verdicts(self, results: pl.DataFrame) -> int:
        """Per-lookup results (`LookupResult` columns, as the analysis paths give them)."""
        return self.insert_arrow(VERDICTS.name, conform(results.to_arrow(), LookupResult))

    def insert_verifications(self, rows: Sequence[Verification]) -> int:
        return self.insert_arrow(VERIFICATIONS.name, to_arrow(rows, Verification))

    def insert_snapshot(self, snapshot: StateSnapshot) -> int:
        """Store an analysis snapshot; a store made before the snapshots table gets it first."""
        if not self.has_table(SNAPSHOTS.name):
            self.init()
        return self.insert_arrow(SNAPSHOTS.name, to_arrow([snapshot], StateSnapshot))

    def latest_snapshot(self, fingerprint: str, before_ns: int) -> StateSnapshot | None:
        """The newest snapshot for these recipes and policy whose position is before `before_ns`
        (None in a store made before the snapshots table)."""
        if not self.has_table(SNAPSHOTS.name):
            return None
        rows = self.query_arrow(
            f"SELECT * FROM {self.db}.{SNAPSHOTS.name} FINAL WHERE fingerprint = {{fp:String}} AND ts_ns < {{t:Int64}}"
            " ORDER BY ts_ns DESC, source_id DESC, seq DESC LIMIT 1",
            parameters={"fp": fingerprint, "t": before_ns},
        ).to_pylist()
        return msgspec.convert(rows[0], StateSnapshot) if rows else None

    def has_table(self, name: str) -> bool:
        """Whether this store's database holds a table of that name."""
        return bool(self.scalar(
            "SELECT count() FROM system.tables WHERE database = {db:String} AND name = {t:String}",
            {"db": self.db, "t": name},
        ))

    def insert_calibrations(self, samples: Sequence[CalibrationSample]) -> int:
        return self.insert_arrow(CALIBRATIONS.name, to_arrow(samples, CalibrationSample))

    # -- reads -------------------------------------------------------------------------------
    def query_arrow(
        self, sql: str, parameters: dict[str, Any] | None = None, settings: dict[str, Any] | None = None
    ) -> pa.Table:
        with self._lock:
            return self.client.query_arrow(sql, parameters=parameters or {}, settings=settings)

    def query_polars(
        self, sql: str, parameters: dict[str, Any] | None = None, settings: dict[str, Any] | None = None
    ) -> pl.DataFrame:
        out = pl.from_arrow(self.query_arrow(sql, parameters, settings))
        if not isinstance(out, pl.DataFrame):
            raise StoreError("query did not return a table")
        return out

    def command(self, sql: str, settings: dict[str, Any] | None = None) -> None:
        with self._lock:
            self.client.command(sql, settings=settings)

    def scalar(self, sql: str, parameters: dict[str, Any] | None = None) -> Any:
        with self._lock:
            rows = self.client.query(sql, parameters=parameters or {}).result_rows
        return rows[0][0] if rows else None

    def events_sql(self, where: str = "1") -> str:
        """SELECT of de-duplicated events in stream order, for readers that need exact rows."""
        return (
            f"SELECT * FROM {self.db}.{EVENTS.name} FINAL WHERE {where} "
            "ORDER BY ts_ns, source_id, seq"
        )

    def iter_event_batches(self, where: str = "1", parameters: dict[str, Any] | None = None) -> Iterator[pa.Table]:
        """Events in stream order as canonical Arrow tables, streamed: memory stays bounded.

        The store is locked while the stream is open (a clickhouse-connect client serves one
        call at a time), so consume it promptly.
        """
        with self._lock, self.client.query_arrow_stream(self.events_sql(where), parameters=parameters or {}) as stream:
            for batch in stream:
                if batch.num_rows:
                    yield conform(pa.Table.from_batches([batch]))

    def engines(self) -> list[AttachedEngine]:
        """Each instance's engine, by its latest attach: what it is and the recipe it caches by."""
        if self.stored_schema_version() is None:
            return []
        rows = self.query_arrow(
            "SELECT instance, engine, engine_version, model, model_revision, kv_dtype, max_model_len, block_size,"
            f" recipe, source_id, ts_ns FROM {self.db}.{EVENTS.name} FINAL WHERE kind = 'attach'"
            " ORDER BY ts_ns DESC LIMIT 1 BY instance, engine").to_pylist()
        return sorted((AttachedEngine(r["instance"], r["engine"], r["engine_version"], r["model"], r["model_revision"],
                                      r["kv_dtype"], int(r["max_model_len"]), int(r["block_size"]),
                                      recipe_from_json(r["recipe"]), int(r["source_id"]), int(r["ts_ns"]))
                       for r in rows), key=lambda e: (e.instance, e.engine))

    def count_events(self) -> int:
        return int(self.scalar(f"SELECT count() FROM {self.db}.{EVENTS.name} FINAL") or 0)

    def emitter_endings(self, ended: Ending | None = Ending.UNCLEAN) -> list[EmitterEnd]:
        """Emitters whose latest stats say they ended so (every emitter with None), oldest end
        first, each with its sequence gap counted from the stored events."""
        having = "1" if ended is None else "ended = {ended:String}"
        rows = self.query_arrow(f"{endings_sql(self.db, having=having)} ORDER BY ended_ns, source_id",
                                {"ended": (ended or Ending.RUNNING).value}).to_pylist()
        return [EmitterEnd(source_id=int(r["source_id"]), instance=r["instance"], engine=r["engine"],
                           ended=Ending(r["ended"]), ended_ns=int(r["ended_ns"]), emitted=int(r["emitted"]),
                           dropped=int(r["dropped"]), recovered=int(r["recovered"]), stored=int(r["stored"]),
                           max_seq=int(r["max_seq"]), missing=int(r["missing"]), writer=r["writer"]) for r in rows]

    def status(self) -> StoreStatus:
        version = self.stored_schema_version()
        tables: list[TableStatus] = []
        sources = dropped = 0
        unclean: list[EmitterEnd] = []
        if version is not None:
            for table in TABLES:
                final = " FINAL" if table.replacing else ""
                rows = int(self.scalar(f"SELECT count() FROM {self.db}.{table.name}{final}") or 0)
                parts = self.query_arrow(
                    "SELECT sum(bytes_on_disk) AS b, uniqExact(partition) AS p FROM system.parts "
                    "WHERE database = {db:String} AND table = {t:String} AND active",
                    {"db": self.db, "t": table.name},
                ).to_pylist()[0]
                tables.append(TableStatus(table.name, rows, int(parts["b"] or 0), int(parts["p"] or 0)))
            sources = int(self.scalar(f"SELECT uniqExact(source_id) FROM {self.db}.{EVENTS.name}") or 0)
            dropped = int(
                self.scalar(
                    "SELECT sum(d) FROM (SELECT argMax(dropped_queue_full + dropped_export_failed + "
                    "dropped_invalid + dropped_shutdown, ts_ns) AS d "
                    f"FROM {self.db}.{EMITTER_STATS.name} GROUP BY source_id, writer)"
                )
                or 0
            )
            if version == SCHEMA_VERSION:  # an older store has no `ended` column yet
                unclean = self.emitter_endings(Ending.UNCLEAN)
        return StoreStatus(
            dsn=str(self.dsn),
            server_version=str(self.client.server_version),
            schema_version=version,
            code_schema_version=SCHEMA_VERSION,
            tables=tuple(tables),
            sources=sources,
            dropped_events=dropped,
            unclean=tuple(unclean),
        )
