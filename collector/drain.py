"""Moves spooled batches into the store in large inserts, retrying with backoff until it can.

One thread, one chunk at a time, in spool order. A chunk's events (JSON lines and Arrow
streams, parsed by ClickHouse, which releases the GIL while it does), quarantined rows and
emitter stats are inserted with de-duplication tokens named by the chunk (the chunk's token,
and for its Arrow events that token + ":columns"), then the spool checkpoint moves past it; a
crash between the two is harmless (see `spool`). While the store is down the chunk is
retried with capped exponential backoff and the spool keeps accepting until its bound.
"""

from __future__ import annotations

import logging
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
import pyarrow as pa

from kvtrace.collector.intake import no_gc
from kvtrace.collector.metrics import CollectorMetrics
from kvtrace.collector.spool import Chunk, DurableSpool, SpoolRecord, decode_record, joined_columns
from kvtrace.schema.arrow import arrow_schema, conform, to_arrow
from kvtrace.schema.clickhouse import EMITTER_STATS, EVENTS, QUARANTINE
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import Ending
from kvtrace.schema.records import EmitterStats, Rejection
from kvtrace.schema.wire import FRAME_OVERHEAD
from kvtrace.store.client import Store

log = logging.getLogger("kvtrace.collector.drain")
_SCHEMA = arrow_schema()
_decode_events = msgspec.json.Decoder(Event).decode_lines


# ClickHouse error codes that blame the rows of an insert, not the store's state: what cannot be
# parsed or converted, a value out of range, a table constraint violated.
DATA_ERRORS = frozenset({6, 26, 27, 38, 41, 53, 69, 70, 72, 117, 131, 469})
_CODE = re.compile(r"\bCode: (\d+)")


def _tenant_of(raw: str) -> str:
    """The tenant of a refused row, from the JSON the quarantine keeps of it."""
    try:
        row = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return ""
    return str(row.get("tenant", "")) if isinstance(row, dict) else ""


@dataclass(frozen=True, slots=True)
class StoredEvents:
    """The events of a chunk just stored, for live verdicts, as the drain had them: the JSON
    lines, and the Arrow records' columns as the one stream the store read (still compressed)
    or as tables. Read into one table by `table()`, on the live thread. Why not by the drain:
    the drain is the ingest's bottleneck, and the reading (the LZ4 inflated, rows decoded and
    made columns) was ~0.2 us per event more of its path with live verdicts on."""

    num_rows: int
    lines: bytes = b""
    stream: pa.Buffer | None = None
    tables: tuple[pa.Table, ...] = ()

    def table(self) -> pa.Table:
        """The events as one table in the stored schema: the columns first, then the rows."""
        tables = list(self.tables)
        if self.stream is not None:
            tables.append(conform(pa.ipc.open_stream(self.stream).read_all()))
        if self.lines.strip():
            with no_gc():
                tables.append(to_arrow(_decode_events(self.lines)))
        return pa.concat_tables(tables) if tables else _SCHEMA.empty_table()


def refuses_data(exc: BaseException) -> bool:
    """Whether an insert's error blames its rows (see DATA_ERRORS)."""
    found = _CODE.search(str(exc))
    return found is not None and int(found.group(1)) in DATA_ERRORS


class Drain:
    """Runs in its own thread; `stop(drain=True)` empties the spool first (graceful shutdown)."""

    def __init__(self, spool: DurableSpool, store: Store, metrics: CollectorMetrics,
                 on_stored: Callable[[StoredEvents], None] | None = None,
                 on_ended: Callable[[list[tuple[str, int]]], None] | None = None,
                 on_drained: Callable[[Counter[str]], None] | None = None,
                 chunk_bytes: int = 16 << 20, max_backoff_s: float = 30.0, idle_s: float = 0.05,
                 refusals_before_isolating: int = 3) -> None:
        # A chunk is counted in spool bytes; the Arrow records' LZ4 roughly halves those, so 16 MiB
        # holds the events 32 MiB held before it (~60k of the collector benchmark's): at 32 MiB the
        # collector's peak RSS was ~200-250 MiB higher at the same throughput.
        self.spool = spool
        self.store = store
        self.metrics = metrics
        self.on_stored = on_stored
        self.on_ended = on_ended  # (instance, source id) of emitters whose stored stats say they ended
        self.on_drained = on_drained  # spool bytes stored per writer (the grant named in each record's origin)
        self._sizes: Counter[str] = Counter()
        self.chunk_bytes = chunk_bytes
        self.max_backoff_s = max_backoff_s
        self.idle_s = idle_s
        self.refusals_before_isolating = refusals_before_isolating
        self.isolated_rows = 0  # rows the store refused on their own, quarantined with its reason
        self.store_ok = True
        self.last_error = ""
        self.stored_events = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtrace-drain", daemon=True)
        self._oldest_ns = 0  # monotonic time the spool became non-empty (for the lag gauge)
        self._pinged = 0.0
        self.ping_every_s = 5.0

    def start(self) -> None:
        self._thread.start()

    def poke(self) -> None:
        """A batch was spooled: drain it now instead of at the next idle tick."""
        if not self._oldest_ns:
            self._oldest_ns = time.monotonic_ns()
        self._wake.set()

    def stop(self, drain: bool = True, timeout_s: float = 30.0) -> bool:
        """Stop the thread, first emptying the spool when `drain` (within the timeout).
        Returns True when nothing was left behind."""
        deadline = time.monotonic() + timeout_s
        if drain:
            while self.spool.pending_bytes and time.monotonic() < deadline and self._thread.is_alive():
                self._wake.set()
                time.sleep(0.02)
        self._stop.set()
        self._wake.set()
        self._thread.join(max(0.1, deadline - time.monotonic()))
        return self.spool.pending_bytes == 0

    def _run(self) -> None:
        attempt = 0
        refusals = 0  # failed attempts on this chunk while the store answered a ping
        while not self._stop.is_set():
            chunk = self.spool.read(max_bytes=self.chunk_bytes)
            if chunk is None:
                self._oldest_ns = 0
                self.metrics.lag.set(0)
                self.metrics.spool_bytes.set(self.spool.pending_bytes)
                if time.monotonic() - self._pinged >= self.ping_every_s:  # idle: is the store still there?
                    self._pinged = time.monotonic()
                    self.store_ok = self.store.ping()
                    if not self.store_ok:
                        self.last_error = self.store.last_ping_error
                    self.metrics.store_up.set(int(self.store_ok))
                self._wake.wait(self.idle_s)
                self._wake.clear()
                continue
            try:
                if refusals >= self.refusals_before_isolating:
                    # The store answers, yet refused this chunk again and again: find the rows it
                    # refuses and quarantine them, so no one's rows wait behind them any longer.
                    events, ended = self._isolate(chunk)
                else:
                    events, ended = self._store(chunk)
            except Exception as exc:  # noqa: BLE001 - store trouble: retry the same chunk later
                attempt += 1
                refusals = refusals + 1 if self.store.ping() else 0  # it answers, yet does not store
                self.store_ok = False
                self.last_error = f"{type(exc).__name__}: {exc}"
                self.metrics.store_up.set(0)
                self.metrics.store_errors.inc()
                wait = min(self.max_backoff_s, 0.1 * 2 ** min(attempt, 16)) * (0.5 + random.random() / 2)
                if attempt == 1 or attempt % 20 == 0:
                    log.warning("store insert failed (attempt %d), retrying in %.1fs: %s", attempt, wait,
                                self.last_error)
                self._stop.wait(wait)
                continue
            if attempt:
                log.info("store reachable again after %d failed attempts", attempt)
            attempt = refusals = 0
            self.store_ok = True
            self.metrics.store_up.set(1)
            self.spool.done(chunk)
            if self.on_drained is not None:
                self.on_drained(self._sizes)
            self.metrics.spool_bytes.set(self.spool.pending_bytes)
            if self._oldest_ns:
                self.metrics.lag.set((time.monotonic_ns() - self._oldest_ns) / 1e9)
                if not self.spool.pending_bytes:
                    self._oldest_ns = 0
            try:
                if self.on_stored is not None and events is not None and events.num_rows:
                    self.on_stored(events)
                if self.on_ended is not None and ended:
                    self.on_ended(ended)
            except Exception:  # noqa: BLE001 - live analysis must never stop ingest
                log.exception("live reconstruction failed on a chunk; ingest continues")

    def _store(self, chunk: Chunk) -> tuple[StoredEvents | None, list[tuple[str, int]]]:
        # The columns go to the store as they were spooled (`joined_columns`); they are read into
        # tables here only where a record's stream cannot pass as it is (read one by one then,
        # so one that cannot be read at all is quarantined). Live verdicts read them later.
        records, tables, rejections = self._records(chunk, read=False)
        streams = [r.columns for r in records if r.columns]
        joined = joined_columns(streams, _SCHEMA) if streams else None
        if streams and joined is None:
            records, tables, rejections = self._records(chunk, read=True)
        lines = b"".join(r.lines for r in records)
        columns = pa.concat_tables(tables or [_SCHEMA.empty_table()])
        stats: dict[int, EmitterStats] = {}
        for r in records:
            rejections.extend(r.rejections)
            if r.stats is not None:  # cumulative: the latest per source says it all
                stats[r.stats.source_id] = r.stats
        self.store.insert_json_lines(EVENTS.name, lines, dedup_token=chunk.token)
        # A second insert into the same table needs a token of its own, or it would be dropped
        # as a repeat of the first.
        if joined is not None:
            self.store.insert_arrow_stream(EVENTS.name, joined, _SCHEMA.names, dedup_token=f"{chunk.token}:columns")
        else:
            self.store.insert_arrow(EVENTS.name, columns, dedup_token=f"{chunk.token}:columns")
        if rejections:
            self.store.insert_arrow(QUARANTINE.name, to_arrow(rejections, Rejection), dedup_token=chunk.token)
        if stats:
            self.store.insert_arrow(EMITTER_STATS.name, to_arrow(list(stats.values()), EmitterStats),
                                    dedup_token=chunk.token)
        n = 0
        for r in records:
            n += r.events
            for tenant, count in r.tenants.items():
                self.metrics.stored.labels(tenant).inc(count)
        self.stored_events += n
        ended = _finished(stats.values())
        if self.on_stored is None or not n:
            return None, ended
        return StoredEvents(n, lines, joined, tuple(tables)), ended

    def _isolate(self, chunk: Chunk) -> tuple[StoredEvents | None, list[tuple[str, int]]]:
        """Store a chunk the store keeps refusing, a record at a time, halving any insert it
        refuses until the refused rows stand alone; those are quarantined with the store's own
        reason. Every insert's de-duplication token is named by its place in the chunk, so a
        crash part-way and the retry that follows store nothing twice. Raises (and the chunk is
        retried whole) when the store stops answering meanwhile: that is an outage, not a
        refusal, and no row is quarantined for it."""
        records, tables, rejections = self._records(chunk)
        self._stored_any, self._unblamed = False, 0
        refused: list[Rejection] = []
        lines_kept: list[bytes] = []
        tables_kept: list[pa.Table] = []
        stats: dict[int, EmitterStats] = {}
        columns = iter(tables)
        for i, r in enumerate(records):
            origin = f"spool:{chunk.token}#{i + 1}"
            rows = [line for line in r.lines.split(b"\n") if line]
            kept, bad = self._split_insert(rows, f"{chunk.token}:{i}", origin, self._insert_lines)
            lines_kept += kept
            refused += bad
            if r.columns:
                table = next(columns)
                kept_tables, bad = self._split_insert(table, f"{chunk.token}:{i}:columns", origin, self._insert_table)
                tables_kept += kept_tables
                refused += bad
            rejections.extend(r.rejections)
            if r.stats is not None:
                stats[r.stats.source_id] = r.stats
        if self._unblamed:
            # Rows refused alone by an error that does not blame their data (a full or read-only
            # disk, a store coming back part-way): the chunk is retried whole (what was stored
            # is not stored twice: the tokens repeat), and only after rounds of the same do the
            # rows refused that way go to quarantine, where their content is kept.
            if self._isolating != chunk.token:
                self._isolating, self._unblamed_rounds = chunk.token, 0
            self._unblamed_rounds += self._stored_any  # a round counts when the store took the other rows
            rounds = self._unblamed_rounds
            if rounds < self.unblamed_rounds_before_quarantine:
                raise RuntimeError(f"the store refused {self._unblamed} rows alone, not for their data "
                                   f"(round {rounds}): {refused[0].reason}")
        self.isolated_rows += len(refused)
        if refused:
            log.error("the store refused %d rows of spooled chunk %s on their own; quarantined with its reason, "
                      "the rest stored (first: %s)", len(refused), chunk.token, refused[0].reason)
        rejections += refused
        if rejections:
            self.store.insert_arrow(QUARANTINE.name, to_arrow(rejections, Rejection), dedup_token=chunk.token)
        if stats:
            self.store.insert_arrow(EMITTER_STATS.name, to_arrow(list(stats.values()), EmitterStats),
                                    dedup_token=chunk.token)
        stored = len(lines_kept) + sum(t.num_rows for t in tables_kept)
        self.stored_events += stored
        per_tenant: Counter[str] = Counter()
        for r in records:
            per_tenant.update(r.tenants)
        per_tenant.subtract(_tenant_of(r.raw) for r in refused)  # quarantined, not stored
        for tenant, count in per_tenant.items():
            if count > 0:
                self.metrics.stored.labels(tenant).inc(count)
        ended = _finished(stats.values())
        if self.on_stored is None or not stored:
            return None, ended
        return StoredEvents(stored, b"\n".join(lines_kept), None, tuple(tables_kept)), ended

    def _insert_lines(self, rows: list[bytes], token: str) -> None:
        self.store.insert_json_lines(EVENTS.name, b"\n".join(rows) + b"\n", dedup_token=token)

    def _insert_table(self, table: pa.Table, token: str) -> None:
        self.store.insert_arrow(EVENTS.name, table, dedup_token=token)

    def _split_insert(self, rows: Any, token: str, origin: str, insert: Callable[[Any, str], None],
                      first: int = 1) -> tuple[list[Any], list[Rejection]]:
        """Insert `rows` (JSON lines or a table); when the store refuses, insert each half on its
        own. Returns what was stored (lines, or tables) and the rows refused alone."""
        n = len(rows)
        if not n:
            return [], []
        try:
            insert(rows, token)
            self._stored_any = True
            return (list(rows) if isinstance(rows, list) else [rows]), []
        except Exception as exc:  # noqa: BLE001
            if not self.store.ping():
                raise  # an outage: retry the chunk whole later
            if n == 1:
                self._unblamed += not refuses_data(exc)
                raw = rows[0].decode("utf-8", "replace") if isinstance(rows, list) else \
                    msgspec.json.encode(rows.to_pylist()[0]).decode()
                return [], [Rejection(received_ns=time.time_ns(), origin=origin, row=first, field="",
                                      reason=f"the store refused this row: {type(exc).__name__}: {exc}"[:4096],
                                      raw=raw[:65536])]
        half = n // 2
        head = rows[:half] if isinstance(rows, list) else rows.slice(0, half)
        tail = rows[half:] if isinstance(rows, list) else rows.slice(half)
        kept, bad = self._split_insert(head, f"{token}:0", origin, insert, first)
        kept2, bad2 = self._split_insert(tail, f"{token}:1", origin, insert, first + half)
        return kept + kept2, bad + bad2

    _stored_any = False  # an insert of the chunk being isolated succeeded
    _isolating = ""  # the token of the chunk isolated last
    _unblamed_rounds = 0  # isolations of it that stored rows and refused others, not for their data
    unblamed_rounds_before_quarantine = 10
    _unblamed = 0  # rows of it refused alone by an error that does not blame their data

    def _records(self, chunk: Chunk, read: bool = True) -> tuple[list[SpoolRecord], list[pa.Table], list[Rejection]]:
        """The chunk's records, and (when `read`) the events of those that came as columns, in
        the current schema, whatever schema version spooled them. One that cannot be read back
        (a spool from another version, a bug) is quarantined whole instead of blocking the drain
        forever (a poison frame)."""
        records: list[SpoolRecord] = []
        tables: list[pa.Table] = []
        bad: list[Rejection] = []
        self._sizes = Counter()
        for i, payload in enumerate(chunk.payloads):
            try:
                record = decode_record(payload)
                self._sizes[record.origin.split(":", 1)[0]] += len(payload) + FRAME_OVERHEAD
                table = conform(pa.ipc.open_stream(record.columns).read_all()) if read and record.columns else None
            except Exception as exc:  # noqa: BLE001
                log.error("spooled record %s#%d cannot be stored; quarantined: %s", chunk.token, i, exc)
                bad.append(Rejection(received_ns=time.time_ns(), origin=f"spool:{chunk.token}", row=i + 1, field="",
                                     reason=f"cannot store this record: {type(exc).__name__}: {exc}",
                                     raw=payload[:32768].hex()))
                continue
            records.append(record)
            if table is not None:
                tables.append(table)
        return records, tables, bad


def _finished(stats: Iterable[EmitterStats]) -> list[tuple[str, int]]:
    """(instance, source id) of the emitters whose stats say they ended with nothing left to
    send. Why the depth too: a dead emitter's journal is shipped in as many batches as it takes,
    each with the stats (ended unclean) and the depth still to go; closing its lookups at the
    first batch judged those whose adopt was in the next without it."""
    return [(st.instance, st.source_id) for st in stats if st.ended is not Ending.RUNNING and not st.queue_depth]
