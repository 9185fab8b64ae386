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
import threading
import time
from collections.abc import Callable

import msgspec
import pyarrow as pa

from kvtrace.collector.intake import no_gc
from kvtrace.collector.metrics import CollectorMetrics
from kvtrace.collector.spool import Chunk, DurableSpool, SpoolRecord, decode_record
from kvtrace.schema.arrow import arrow_schema, conform, from_arrow, to_arrow
from kvtrace.schema.clickhouse import EMITTER_STATS, EVENTS, QUARANTINE
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import Ending
from kvtrace.schema.records import EmitterStats, Rejection
from kvtrace.store.client import Store

log = logging.getLogger("kvtrace.collector.drain")
_decode_events = msgspec.json.Decoder(Event).decode_lines


class Drain:
    """Runs in its own thread; `stop(drain=True)` empties the spool first (graceful shutdown)."""

    def __init__(self, spool: DurableSpool, store: Store, metrics: CollectorMetrics,
                 on_stored: Callable[[list[Event]], None] | None = None,
                 on_ended: Callable[[list[tuple[str, int]]], None] | None = None,
                 chunk_bytes: int = 32 << 20, max_backoff_s: float = 30.0, idle_s: float = 0.05) -> None:
        self.spool = spool
        self.store = store
        self.metrics = metrics
        self.on_stored = on_stored
        self.on_ended = on_ended  # (instance, source id) of emitters whose stored stats say they ended
        self.chunk_bytes = chunk_bytes
        self.max_backoff_s = max_backoff_s
        self.idle_s = idle_s
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
        while not self._stop.is_set():
            chunk = self.spool.read(max_bytes=self.chunk_bytes)
            if chunk is None:
                self._oldest_ns = 0
                self.metrics.lag.set(0)
                self.metrics.spool_bytes.set(self.spool.pending_bytes)
                if time.monotonic() - self._pinged >= self.ping_every_s:  # idle: is the store still there?
                    self._pinged = time.monotonic()
                    self.store_ok = self.store.ping()
                    self.metrics.store_up.set(int(self.store_ok))
                self._wake.wait(self.idle_s)
                self._wake.clear()
                continue
            try:
                events, ended = self._store(chunk)
            except Exception as exc:  # noqa: BLE001 - store trouble: retry the same chunk later
                attempt += 1
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
            attempt = 0
            self.store_ok = True
            self.metrics.store_up.set(1)
            self.spool.done(chunk)
            self.metrics.spool_bytes.set(self.spool.pending_bytes)
            if self._oldest_ns:
                self.metrics.lag.set((time.monotonic_ns() - self._oldest_ns) / 1e9)
                if not self.spool.pending_bytes:
                    self._oldest_ns = 0
            try:
                if self.on_stored is not None and events:
                    self.on_stored(events)
                if self.on_ended is not None and ended:
                    self.on_ended(ended)
            except Exception:  # noqa: BLE001 - live analysis must never stop ingest
                log.exception("live reconstruction failed on a chunk; ingest continues")

    def _store(self, chunk: Chunk) -> tuple[list[Event], list[tuple[str, int]]]:
        records, tables, rejections = self._records(chunk)
        lines = b"".join(r.lines for r in records)
        columns = pa.concat_tables(tables or [arrow_schema().empty_table()])
        stats: dict[int, EmitterStats] = {}
        for r in records:
            rejections.extend(r.rejections)
            if r.stats is not None:  # cumulative: the latest per source says it all
                stats[r.stats.source_id] = r.stats
        self.store.insert_json_lines(EVENTS.name, lines, dedup_token=chunk.token)
        # A second insert into the same table needs a token of its own, or it would be dropped
        # as a repeat of the first.
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
        ended = [(st.instance, st.source_id) for st in stats.values() if st.ended is not Ending.RUNNING]
        if self.on_stored is None or not (lines or columns.num_rows):
            return [], ended
        with no_gc():
            return _decode_events(lines) + from_arrow(columns), ended

    def _records(self, chunk: Chunk) -> tuple[list[SpoolRecord], list[pa.Table], list[Rejection]]:
        """The chunk's records, and the events of those that came as columns (in the current
        schema, whatever schema version spooled them). One that cannot be read back (a spool
        from another version, a bug) is quarantined whole instead of blocking the drain forever
        (a poison frame)."""
        records: list[SpoolRecord] = []
        tables: list[pa.Table] = []
        bad: list[Rejection] = []
        for i, payload in enumerate(chunk.payloads):
            try:
                record = decode_record(payload)
                table = conform(pa.ipc.open_stream(record.columns).read_all()) if record.columns else None
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
