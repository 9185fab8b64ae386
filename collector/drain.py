"""Moves spooled batches into the store in large inserts, retrying with backoff until it can.

One thread, one chunk at a time, in spool order. A chunk's events, quarantined rows and emitter
stats are inserted with the chunk's de-duplication token, then the spool checkpoint moves past
it; a crash between the two is harmless (see `spool`). While the store is down the chunk is
retried with capped exponential backoff and the spool keeps accepting until its bound.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable

import msgspec
import pyarrow as pa

from kvtrace.collector.metrics import CollectorMetrics
from kvtrace.collector.spool import Chunk, DurableSpool
from kvtrace.collector.store import Store
from kvtrace.schema.arrow import to_arrow
from kvtrace.schema.clickhouse import EMITTER_STATS, EVENTS, QUARANTINE
from kvtrace.schema.events import Event
from kvtrace.schema.records import EmitterStats, Rejection
from kvtrace.schema.wire import Batch

log = logging.getLogger("kvtrace.collector.drain")
_decode = msgspec.msgpack.Decoder(Batch).decode
_json_lines = msgspec.json.Encoder().encode_lines


class Drain:
    """Runs in its own thread; `stop(drain=True)` empties the spool first (graceful shutdown)."""

    def __init__(self, spool: DurableSpool, store: Store, metrics: CollectorMetrics,
                 on_stored: Callable[[list[Event]], None] | None = None,
                 chunk_bytes: int = 32 << 20, max_backoff_s: float = 30.0, idle_s: float = 0.05) -> None:
        self.spool = spool
        self.store = store
        self.metrics = metrics
        self.on_stored = on_stored
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
                events = self._store(chunk)
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
            if self.on_stored is not None and events:
                try:
                    self.on_stored(events)
                except Exception:  # noqa: BLE001 - live analysis must never stop ingest
                    log.exception("live reconstruction failed on a chunk; ingest continues")

    def _store(self, chunk: Chunk) -> list[Event]:
        events, tables = self._tables(chunk)
        for table, data in tables:
            if isinstance(data, bytes):
                self.store.insert_json_lines(table, data, dedup_token=chunk.token)
            else:
                self.store.insert_arrow(table, data, dedup_token=chunk.token)
        self.stored_events += len(events)
        for tenant, n in Counter(e.tenant for e in events).items():
            self.metrics.stored.labels(tenant).inc(n)
        return events

    def _tables(self, chunk: Chunk) -> tuple[list[Event], list[tuple[str, pa.Table | bytes]]]:
        """The chunk as Arrow tables. Intake validated every row, so this cannot fail on data;
        if it ever does, the batch that fails is quarantined whole instead of blocking the
        drain forever (a poison batch), and the rest of the chunk is stored."""
        events: list[Event] = []
        rejections: list[Rejection] = []
        stats: dict[int, EmitterStats] = {}
        converted: list[bytes] = []
        try:
            for payload in chunk.payloads:
                batch = _decode(payload)
                events.extend(batch.events)
                rejections.extend(batch.rejections)
                if batch.stats is not None:  # cumulative: the latest per source says it all
                    stats[batch.stats.source_id] = batch.stats
            converted = [_json_lines(events)] if events else []
            stats_table = to_arrow(list(stats.values()), EmitterStats) if stats else None
        except Exception:  # noqa: BLE001 - sort it out batch by batch
            return self._tables_one_by_one(chunk)
        out: list[tuple[str, pa.Table | bytes]] = [(EVENTS.name, t) for t in converted]
        if rejections:
            out.append((QUARANTINE.name, to_arrow(rejections, Rejection)))
        if stats_table is not None:
            out.append((EMITTER_STATS.name, stats_table))
        return events, out

    def _tables_one_by_one(self, chunk: Chunk) -> tuple[list[Event], list[tuple[str, pa.Table | bytes]]]:
        events: list[Event] = []
        good: list[pa.Table] = []
        rejections: list[Rejection] = []
        for i, payload in enumerate(chunk.payloads):
            try:
                batch = _decode(payload)
                table = to_arrow(batch.events)
                good.append(table)
                events.extend(batch.events)
                rejections.extend(batch.rejections)
            except Exception as exc:  # noqa: BLE001
                log.error("spooled batch %s#%d cannot be stored; quarantined: %s", chunk.token, i, exc)
                rejections.append(Rejection(received_ns=time.time_ns(), origin=f"spool:{chunk.token}", row=i + 1, field="",
                                            reason=f"cannot store this batch: {type(exc).__name__}: {exc}",
                                            raw=payload[:32768].hex()))
        out: list[tuple[str, pa.Table | bytes]] = [(EVENTS.name, pa.concat_tables(good))] if good else []
        if rejections:
            out.append((QUARANTINE.name, to_arrow(rejections, Rejection)))
        return events, out
