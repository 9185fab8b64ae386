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
        events: list[Event] = []
        rejections: list[Rejection] = []
        stats: dict[int, EmitterStats] = {}
        for payload in chunk.payloads:
            batch = _decode(payload)
            events.extend(batch.events)
            rejections.extend(batch.rejections)
            if batch.stats is not None:  # cumulative: the latest per source says it all
                stats[batch.stats.source_id] = batch.stats
        token = chunk.token
        if events:
            self.store.insert_arrow(EVENTS.name, to_arrow(events), dedup_token=token)
        if rejections:
            self.store.insert_arrow(QUARANTINE.name, to_arrow(rejections, Rejection), dedup_token=token)
        if stats:
            self.store.insert_arrow(EMITTER_STATS.name, to_arrow(list(stats.values()), EmitterStats),
                                    dedup_token=token)
        self.stored_events += len(events)
        for tenant, n in Counter(e.tenant for e in events).items():
            self.metrics.stored.labels(tenant).inc(n)
        return events
