"""The one batcher every shim emits through: O(1) on the caller, bounded, never raising.

`emit()` stamps the event with its id, appends it to a bounded deque and returns; when the
deque is full the event is dropped and counted. A background thread wakes when a batch is
ready (or the schedule delay passes), exports through the sink with bounded retries, and
counts whatever it could not deliver. The model is OpenTelemetry's batch processor; the
difference from vLLM's ZMQ publisher (a blocking put) is deliberate: a stalled sink must never
stall the scheduler.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import logging
import os
import random
import threading
import time
import weakref
from dataclasses import dataclass

from kvtrace.instrumentation.api import key_sampled
from kvtrace.instrumentation.sinks.base import ExportResult, ExportStatus, Sink
from kvtrace.schema.events import Event
from kvtrace.schema.records import EmitterStats
from kvtrace.schema.wire import Batch

log = logging.getLogger("kvtrace.emitter")


@dataclass(frozen=True, slots=True)
class BatchConfig:
    """Bounds of the batcher; validated when built, never re-read at run time."""

    max_queue_size: int = 65536
    max_export_batch_size: int = 8192
    schedule_delay_millis: int = 200
    max_export_attempts: int = 5
    retry_backoff_millis: int = 100
    max_retry_wait_millis: int = 10000
    shutdown_timeout_millis: int = 10000

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"BatchConfig.{name} must be a non-negative int, got {value!r}")
        if self.max_queue_size < 1 or self.max_export_batch_size < 1 or self.max_export_attempts < 1:
            raise ValueError("max_queue_size, max_export_batch_size and max_export_attempts must be >= 1")
        if self.max_export_batch_size > self.max_queue_size:
            raise ValueError(
                f"max_export_batch_size ({self.max_export_batch_size}) exceeds "
                f"max_queue_size ({self.max_queue_size})"
            )


class _FlushMarker:
    """Placed in the queue by force_flush; the worker sets it once everything before it is out."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = threading.Event()


def _new_source_id() -> int:
    return random.SystemRandom().getrandbits(64) or 1


class BatchEmitter:
    """Batches events from any number of threads to one sink."""

    enabled = True

    def __init__(
        self,
        sink: Sink,
        config: BatchConfig = BatchConfig(),
        *,
        instance: str = "",
        engine: str = "",
        register_atexit: bool = True,
    ) -> None:
        self._sink = sink
        self._config = config
        self._instance = instance
        self._engine = engine
        self._lock = threading.Lock()  # guards counters touched off the fast path
        self._shutdown_done = False
        self._init_state()
        self._start_worker()
        if register_atexit:
            ref = weakref.ref(self)
            atexit.register(lambda: (e := ref()) is not None and e.shutdown())
        if hasattr(os, "register_at_fork"):
            ref2 = weakref.ref(self)
            os.register_at_fork(after_in_child=lambda: (e := ref2()) is not None and e._after_fork())

    # -- state ---------------------------------------------------------------------------------
    def _init_state(self) -> None:
        self.source_id = _new_source_id()
        self._seq = itertools.count()
        self._queue: collections.deque[Event | _FlushMarker] = collections.deque()
        self._wake = threading.Event()
        self._stopping = False
        self._deadline: float | None = None
        self._batch_seq = 0
        self._markers = 0  # flush markers in the queue: not events, so not counted as queued
        self._drained = 0
        self._exported = 0
        self._batches = 0
        self._export_errors = 0
        self._dropped_queue_full = 0
        self._dropped_export_failed = 0
        self._emit_errors = 0
        self._rejected = 0
        self._dropped_shutdown = 0
        self._dropped_sampled_out = 0
        self._last_error_log = 0.0

    def _start_worker(self) -> None:
        self._worker = threading.Thread(target=self._run, name="kvtrace-emitter", daemon=True)
        self._worker.start()

    def _after_fork(self) -> None:
        """A forked child gets a fresh identity and queue, and its own worker thread."""
        self._lock = threading.Lock()
        self._init_state()
        self._stopping = self._shutdown_done  # a shut-down emitter stays shut: no worker, no queue
        if not self._shutdown_done:
            self._start_worker()

    # -- hot path ------------------------------------------------------------------------------
    def emit(self, event: Event) -> None:
        """Queue one event; O(1), never blocks, never raises.

        The event is stamped with this emitter's source id and the next sequence number even
        when it is then dropped, so downstream sees the drop as a gap in `seq`.
        """
        try:
            if not isinstance(event, Event):
                # Not an event: refuse it here, where it costs one count, rather than let it
                # fail the encoding of a whole batch of good events in the worker.
                raise TypeError(f"not an Event: {type(event).__name__}")
            event.source_id = self.source_id
            event.seq = next(self._seq)
            if not event.ts_ns:
                event.ts_ns = time.time_ns()
            queue = self._queue
            if len(queue) >= self._config.max_queue_size or self._stopping:
                with self._lock:
                    if self._stopping:
                        self._dropped_shutdown += 1
                    else:
                        self._dropped_queue_full += 1
                return
            queue.append(event)
            if len(queue) >= self._config.max_export_batch_size:
                self._wake.set()
        except Exception:  # noqa: BLE001 - the engine must never see our failure
            with self._lock:
                self._emit_errors += 1

    def sampled(self, key: int, rate: float) -> bool:
        """Deterministic per-key sampling (a request or prefix hash), counted when it says no.

        Sampling whole requests keeps each sampled request's picture complete; sampling single
        events would make every reconstruction wrong.
        """
        if key_sampled(key, rate):
            return True
        with self._lock:
            self._dropped_sampled_out += 1
        return False

    # -- worker --------------------------------------------------------------------------------
    def _take_batch(self) -> tuple[list[Event], list[_FlushMarker]]:
        batch: list[Event] = []
        markers: list[_FlushMarker] = []
        queue = self._queue
        limit = self._config.max_export_batch_size
        while queue and len(batch) < limit:
            item = queue.popleft()
            if isinstance(item, _FlushMarker):
                with self._lock:
                    self._markers -= 1
                markers.append(item)
                break
            batch.append(item)
            self._drained += 1  # per item: stats() never misses a whole batch in transit
        return batch, markers

    def _run(self) -> None:
        delay = self._config.schedule_delay_millis / 1000
        while True:
            self._wake.wait(delay)
            self._wake.clear()
            stopping = self._stopping
            self._drain(self._deadline if stopping else None)
            if stopping:
                return

    def _drain(self, deadline: float | None) -> None:
        """Export until the queue is empty, or until the deadline when shutting down."""
        while True:
            batch, markers = self._take_batch()
            if batch:
                self._export(batch, deadline)
            for marker in markers:
                marker.done.set()
            if not self._queue or (deadline is not None and time.monotonic() > deadline):
                return

    def _export(self, events: list[Event], deadline: float | None) -> None:
        backoff = self._config.retry_backoff_millis / 1000
        result = ExportResult(ExportStatus.RETRY, detail="not attempted")
        for attempt in range(self._config.max_export_attempts):
            self._batch_seq += 1
            batch = Batch(
                source_id=self.source_id,
                batch_seq=self._batch_seq,
                sent_ns=time.time_ns(),
                events=events,
                stats=self.stats(),
            )
            try:
                result = self._sink.export(batch)
            except Exception as exc:  # noqa: BLE001 - a sink bug must not kill the worker
                result = ExportResult(ExportStatus.RETRY, detail=f"{type(exc).__name__}: {exc}")
            if result.status is ExportStatus.SUCCESS:
                with self._lock:
                    self._exported += len(events) - result.rejected
                    self._rejected += result.rejected
                    self._batches += 1
                return
            with self._lock:
                self._export_errors += 1
            if result.status is ExportStatus.FAILURE or attempt + 1 == self._config.max_export_attempts:
                break
            # Jitter spreads our own backoff; a server's Retry-After is a floor, never shortened.
            wait = max(result.retry_after_s, backoff * (2**attempt) * (0.5 + random.random() / 2))
            wait = min(wait, self._config.max_retry_wait_millis / 1000)
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - time.monotonic()))
                if wait <= 0:
                    break
            time.sleep(wait)
        with self._lock:
            self._dropped_export_failed += len(events)
        self._log_error(f"dropped {len(events)} events after export failed: {result.detail}")

    def _log_error(self, message: str) -> None:
        """Loud once, then at most every 30 s: run-time trouble must not flood the engine's log."""
        now = time.monotonic()
        if now - self._last_error_log >= 30.0:
            self._last_error_log = now
            log.warning("kvtrace emitter: %s", message)

    # -- control -------------------------------------------------------------------------------
    def stats(self) -> EmitterStats:
        """Counters so far; `emitted` counts every event handed to emit()."""
        with self._lock:
            depth = len(self._queue) - self._markers
            return EmitterStats(
                ts_ns=time.time_ns(),
                source_id=self.source_id,
                instance=self._instance,
                engine=self._engine,
                emitted=(
                    self._drained + depth + self._dropped_queue_full + self._emit_errors + self._dropped_shutdown
                ),
                exported=self._exported,
                dropped_queue_full=self._dropped_queue_full,
                dropped_export_failed=self._dropped_export_failed,
                dropped_invalid=self._emit_errors + self._rejected,
                dropped_shutdown=self._dropped_shutdown,
                dropped_sampled_out=self._dropped_sampled_out,
                queue_depth=depth,
                batches=self._batches,
                export_errors=self._export_errors,
            )

    def force_flush(self, timeout_millis: int = 10000) -> bool:
        """Export everything emitted before this call; True if it all went out in time."""
        if self._shutdown_done or not self._worker.is_alive():
            return not self._queue
        marker = _FlushMarker()
        with self._lock:
            self._markers += 1
            self._queue.append(marker)
        self._wake.set()
        return marker.done.wait(timeout_millis / 1000)

    def shutdown(self) -> bool:
        """Flush within the shutdown deadline, stop the worker, close the sink; safe twice.

        Returns True when nothing was left behind. Events still queued at the deadline are
        counted as dropped_shutdown, and a last stats-only batch reports the final counters.
        """
        if self._shutdown_done:
            return True
        self._shutdown_done = True
        timeout = self._config.shutdown_timeout_millis / 1000
        deadline = time.monotonic() + timeout
        self._deadline = deadline
        self._stopping = True
        self._wake.set()
        self._worker.join(timeout)  # a stalled sink leaves the worker behind; we move on
        with self._lock:
            leftover = sum(1 for item in list(self._queue) if isinstance(item, Event))
            self._queue.clear()
            self._markers = 0
            self._dropped_shutdown += leftover
        self._send_final_stats(deadline)
        try:
            self._sink.shutdown()
        except Exception as exc:  # noqa: BLE001
            self._log_error(f"sink shutdown failed: {exc}")
        # A worker still inside the sink holds a batch that has not been delivered.
        return leftover == 0 and self._dropped_export_failed == 0 and not self._worker.is_alive()

    def _send_final_stats(self, deadline: float) -> None:
        if self._worker.is_alive() or time.monotonic() > deadline:
            return
        self._batch_seq += 1
        batch = Batch(source_id=self.source_id, batch_seq=self._batch_seq, sent_ns=time.time_ns(), stats=self.stats())
        try:
            self._sink.export(batch)
        except Exception as exc:  # noqa: BLE001
            self._log_error(f"final stats not exported: {exc}")
