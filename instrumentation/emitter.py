"""The one batcher every shim emits through: O(1) on the caller, bounded, never raising.

`emit()` stamps the event with its id, appends it to a bounded buffer and returns; when the
buffer is full the event is dropped and counted. A background thread wakes when a batch is
ready (or the schedule delay passes), exports through the sink with bounded retries, and
counts whatever it could not deliver. The model is OpenTelemetry's batch processor; the
difference from vLLM's ZMQ publisher (a blocking put) is deliberate: a stalled sink must never
stall the scheduler.

The buffer is a deque in memory, or, given a `JournalConfig`, the emitter's journal
(`kvtrace.instrumentation.journal`): a ring in a memory-mapped file that `emit()` encodes each
event into, which outlives the process. The worker then exports straight from the journal and
frees what the sink acknowledged (at least once: downstream de-duplicates by (source, seq)). If
the process dies, whoever claims the journal ships the rest under the dead emitter's own source
id and batch numbering, then its final stats, marked unclean (`BatchEmitter(..., adopt=...)`):
the detached shipper process the emitter started, or the next emitter to start with the same
journal directory.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import itertools
import logging
import os
import random
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import msgspec

from kvtrace.instrumentation.api import key_sampled
from kvtrace.instrumentation.journal import Journal, JournalError, State, journals
from kvtrace.instrumentation.sinks.base import ExportResult, ExportStatus, Sink, takes_encoded
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import Ending
from kvtrace.schema.records import EmitterStats
from kvtrace.schema.wire import WIRE_VERSION, Batch, RawBatch

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


@dataclass(frozen=True, slots=True)
class JournalConfig:
    """An emitter's journal: where, how big, and who ships it when the process dies first.

    `shipper`: called with the path of each journal the emitter makes (before the constructor
    returns; a forked child's, made at its first emit, on its worker), to start a process that
    ships it if this one dies first (`kvtrace.instrumentation.shipper`); None starts none, and
    the next emitter to start in the directory ships what is left.
    `ship_leftovers`: this emitter's worker first ships the journals of dead emitters it finds
    in the directory, through its own sink.
    """

    directory: str
    size_bytes: int = 64 << 20
    shipper: Callable[[Path], object] | None = None
    ship_leftovers: bool = True

    def __post_init__(self) -> None:
        from kvtrace.instrumentation.journal import MIN_DATA_BYTES

        if not isinstance(self.size_bytes, int) or self.size_bytes < MIN_DATA_BYTES:
            raise ValueError(f"JournalConfig.size_bytes must be an int >= {MIN_DATA_BYTES}, got {self.size_bytes!r}")
        if not self.directory:
            raise ValueError("JournalConfig.directory must be set")


class _Sent(Enum):
    """How an export ended."""

    DELIVERED = "delivered"
    FAILED = "failed"  # refused for good, or still failing after every attempt: dropped
    OUT_OF_TIME = "out_of_time"  # the shutdown deadline came first


_event_decoder = msgspec.msgpack.Decoder(Event)


def _decoded(payloads: list[bytes]) -> list[Event]:
    """Events from their journal records, leaving out any that does not decode."""
    try:
        return [_event_decoder.decode(p) for p in payloads]
    except (msgspec.DecodeError, msgspec.ValidationError):
        out = []
        for p in payloads:
            try:
                out.append(_event_decoder.decode(p))
            except (msgspec.DecodeError, msgspec.ValidationError):
                pass
        return out


class _FlushMarker:
    """Placed in the queue by force_flush; the worker sets it once everything before it is out."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = threading.Event()


def _new_source_id() -> int:
    return random.SystemRandom().getrandbits(64) or 1


class BatchEmitter:
    """Batches events from any number of threads to one sink.

    With `journal`, events wait in the emitter's journal instead of in memory (see the module's
    doc). With `adopt`, a journal claimed from an emitter whose process ended: this emitter then
    takes no events and has no worker; its `shutdown()` ships what the journal holds under that
    emitter's identity, from the calling thread, then that emitter's final stats, and removes
    the journal once all of it was delivered. It leaves `sink` open: the caller owns it.
    """

    enabled = True

    def __init__(
        self,
        sink: Sink,
        config: BatchConfig = BatchConfig(),
        *,
        instance: str = "",
        engine: str = "",
        register_atexit: bool = True,
        journal: JournalConfig | None = None,
        adopt: Journal | None = None,
    ) -> None:
        self._sink = sink
        self._config = config
        self._instance = instance
        self._engine = engine
        self._journal_config = journal
        self._encoded = takes_encoded(sink)
        self._lock = threading.Lock()  # guards counters touched off the fast path (and journal appends)
        self._shutdown_done = False
        self._init_state()
        if adopt is not None:
            self._adopt(adopt)
            return
        if journal is not None:
            self._open_journal()
            if self._journal is not None:
                self._start_shipper()  # here, not on the worker: it runs before anything is emitted
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
        # the journal's (unused without one)
        self._journal: Journal | None = None
        self._appended = 0  # records put in the journal
        self._acked = 0  # records the worker is done with (delivered or dropped)
        self._flushed = threading.Condition(threading.Lock())
        self._shipper_started = False
        self._prefaulted = False  # the journal's pages faulted in by the worker (Journal.prefault)
        self._adopted = False
        self._recovered = 0
        self._emitted_floor = 0  # an adopted journal's sequence end: nothing emitted goes uncounted
        self._ending = Ending.RUNNING
        self._ended_ns = 0
        self._worker: threading.Thread | None = None

    def _start_worker(self) -> None:
        self._worker = threading.Thread(target=self._run, name="kvtrace-emitter", daemon=True)
        self._worker.start()

    def _after_fork(self) -> None:
        """A forked child gets a fresh identity and buffer, and its own worker thread. A child
        of a journaled emitter lets go of its parent's journal and makes its own at its first
        emit (a child that never emits makes none)."""
        if self._journal is not None:
            self._journal.abandon()
        self._drop_own_emit()
        self._lock = threading.Lock()
        self._init_state()
        self._stopping = self._shutdown_done  # a shut-down emitter stays shut: no worker, no queue
        if not self._shutdown_done:
            if self._journal_config is not None:
                self.emit = self._emit_opening_journal  # type: ignore[method-assign]
            self._start_worker()

    # -- the journal -----------------------------------------------------------------------------
    def _open_journal(self) -> None:
        """Make this emitter's journal and send events through it; without one (no room, no
        such directory) events wait in memory, said once in the log."""
        cfg = self._journal_config
        if cfg is None:
            return
        try:
            self._journal = Journal.create(cfg.directory, self.source_id, cfg.size_bytes, instance=self._instance,
                                           engine=self._engine)
        except (OSError, ValueError) as exc:
            self._drop_own_emit()
            log.warning("kvtrace emitter: no journal in %s (%s); events wait in memory, and whatever is queued when "
                        "this process dies is lost", cfg.directory, exc)
            return
        self._append = self._journal.append
        self._wake_at = self._config.max_export_batch_size
        self.emit = self._emit_journaled  # type: ignore[method-assign]

    def _drop_own_emit(self) -> None:
        """Let the class's `emit` show through again. Never through `self.__dict__`: reading it
        turns the object's inline attribute values into a dict on CPython 3.11+, which slows
        every attribute read of the hot path after it."""
        try:
            del self.emit
        except AttributeError:
            pass

    def _emit_opening_journal(self, event: Event) -> None:
        with self._lock:
            if self.emit == self._emit_opening_journal:
                self._open_journal()
        self._wake.set()  # the worker starts the journal's shipper
        self.emit(event)

    def _adopt(self, journal: Journal) -> None:
        """Take over a journal whose emitter ended: its identity, its numbering, its counters."""
        self._journal = journal
        self._adopted = True
        self._stopping = True  # takes no events of its own
        self.source_id = journal.source_id
        self._instance = self._instance or journal.instance
        self._engine = self._engine or journal.engine
        self._batch_seq = journal.batch_seq
        c = journal.counters()
        self._dropped_queue_full = c["dropped_queue_full"]
        self._emit_errors = c["emit_errors"]
        self._dropped_shutdown = c["dropped_shutdown"]
        self._dropped_sampled_out = c["dropped_sampled_out"]
        self._exported = c["exported"]
        self._rejected = c["rejected"]
        self._batches = c["batches"]
        self._export_errors = c["export_errors"]
        self._dropped_export_failed = c["dropped_export_failed"]
        self._recovered = c["recovered"]
        # Records taken before are the ones exported, rejected or dropped; what is left is pending.
        self._drained = self._acked = self._exported + self._rejected + self._dropped_export_failed
        self._appended = self._drained + journal.pending()
        self._emitted_floor = journal.seq_end
        if journal.state is State.OPEN:
            self._ending, self._ended_ns = Ending.UNCLEAN, journal.last_alive_ns
        else:
            self._ending, self._ended_ns = Ending.CLEAN, journal.ended_ns or journal.last_alive_ns

    def _start_shipper(self) -> None:
        """Start the detached process that ships this journal if this process dies first."""
        self._shipper_started = True
        cfg, journal = self._journal_config, self._journal
        if cfg is None or journal is None or cfg.shipper is None:
            return
        try:
            cfg.shipper(journal.path)
        except Exception as exc:  # noqa: BLE001 - the journal still waits for the next start
            log.warning("kvtrace emitter: could not start the journal's shipper (%s); if this process dies, "
                        "%s waits for the next start", exc, journal.path)

    def _ship_leftovers(self) -> None:
        """Ship the journals of dead emitters in our directory, through our sink, before our own."""
        cfg = self._journal_config
        if cfg is None or not cfg.ship_leftovers:
            return
        own = self._journal.path if self._journal is not None else None
        config = dataclasses.replace(self._config, shutdown_timeout_millis=max(self._config.shutdown_timeout_millis,
                                                                               60_000))
        for path in journals(cfg.directory):
            if path == own or self._stopping:
                continue
            try:
                leftover = Journal.claim(path)
            except (OSError, JournalError) as exc:
                self._log_error(f"cannot read journal {path}: {exc}")
                continue
            if leftover is None:  # its emitter lives, or someone else ships it
                continue
            adopted = BatchEmitter(self._sink, config, register_atexit=False, adopt=leftover)
            if adopted.shutdown():
                log.info("kvtrace emitter: shipped the journal of emitter %016x (%s), which ended %s",
                         adopted.source_id, adopted._instance or "?", adopted._ending.value)

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

    def _emit_journaled(self, event: Event) -> None:
        """`emit` with a journal: the event is encoded into it before this returns, so it
        outlives the process from then on. Every call takes a sequence number, under the lock
        that orders the journal, so whatever does not reach the journal (a full journal, not an
        event, after shutdown) is a counted gap in `seq`, and the counters and the sequence end
        are written to the journal too, for whoever ships it if this process dies."""
        lock = self._lock
        lock.acquire()
        try:
            seq = next(self._seq)
            try:
                if not isinstance(event, Event):
                    raise TypeError(f"not an Event: {type(event).__name__}")
                event.source_id = self.source_id
                event.seq = seq
                if not event.ts_ns:
                    event.ts_ns = time.time_ns()
                if self._stopping:
                    self._dropped_shutdown += 1
                elif self._append(event, seq):
                    self._appended = appended = self._appended + 1
                    if appended - self._drained >= self._wake_at:
                        self._wake.set()
                    return
                else:
                    self._dropped_queue_full += 1
            except Exception:  # noqa: BLE001 - the engine must never see our failure
                self._emit_errors += 1
            journal = self._journal
            if journal is not None and not journal.closed:
                journal.note_drops(self._emit_counters(), seq + 1)
        except Exception:  # noqa: BLE001
            pass
        finally:
            lock.release()

    def _emit_counters(self) -> dict[str, int]:
        return {"dropped_queue_full": self._dropped_queue_full, "emit_errors": self._emit_errors,
                "dropped_shutdown": self._dropped_shutdown, "dropped_sampled_out": self._dropped_sampled_out}

    def sampled(self, key: int, rate: float) -> bool:
        """Deterministic per-key sampling (a request or prefix hash), counted when it says no.

        Sampling whole requests keeps each sampled request's picture complete; sampling single
        events would make every reconstruction wrong.
        """
        if key_sampled(key, rate):
            return True
        with self._lock:
            self._dropped_sampled_out += 1
            journal = self._journal
            if journal is not None and not journal.closed:
                try:
                    journal.note_drops({"dropped_sampled_out": self._dropped_sampled_out}, 0)
                except Exception:  # noqa: BLE001
                    pass
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
        leftovers = True
        while True:
            journal = self._journal
            if journal is not None:
                if not self._shipper_started:  # a forked child's journal, made at its first emit
                    self._start_shipper()
                if not self._prefaulted and not self._adopted:
                    self._prefaulted = True
                    journal.prefault(stop=lambda: self._stopping)
                if leftovers:
                    leftovers = False
                    try:
                        self._ship_leftovers()
                    except Exception as exc:  # noqa: BLE001 - our own events come first
                        self._log_error(f"shipping dead emitters' journals failed: {type(exc).__name__}: {exc}")
            self._wake.wait(delay)
            self._wake.clear()
            stopping = self._stopping
            journal = self._journal
            if journal is not None:
                try:
                    journal.heartbeat()
                    self._drain_journal(self._deadline if stopping else None)
                except Exception as exc:  # noqa: BLE001 - a bug here must not end the worker quietly
                    if not journal.closed:  # closed meanwhile by a shutdown past its deadline: not a fault
                        self._log_error(f"shipping from the journal failed: {type(exc).__name__}: {exc}")
            else:
                self._drain(self._deadline if stopping else None)
            if stopping:
                return

    def _drain(self, deadline: float | None) -> None:
        """Export until the queue is empty, or until the deadline when shutting down."""
        while True:
            batch, markers = self._take_batch()
            if batch:
                if self._export(batch, deadline) is not _Sent.DELIVERED:
                    with self._lock:
                        self._dropped_export_failed += len(batch)
            for marker in markers:
                marker.done.set()
            if not self._queue or (deadline is not None and time.monotonic() > deadline):
                return

    def _drain_journal(self, deadline: float | None) -> None:
        """Export from the journal until it is empty (or the deadline passes), freeing what was
        delivered or given up on. A batch still unsent at the deadline stays in the journal for
        whoever takes it next."""
        journal = self._journal
        limit = self._config.max_export_batch_size
        while journal is not None and not journal.closed:
            records = journal.read(limit)
            if records.fault:
                self._log_error(f"journal {journal.path}: {records.fault}")
            if not records.count:
                if records.fault and not self._adopted:  # unreadable up to here: go on after it
                    journal.skip_to_write()
                return
            n = records.count
            with self._lock:
                self._drained += n
            events: list[Event] | list[msgspec.Raw]
            if self._encoded:
                events = [msgspec.Raw(p) for p in records.payloads]
            else:
                events = _decoded(records.payloads)
                if len(events) < n:  # unreadable (what a crash can leave): invalid, not queued
                    bad = n - len(events)
                    with self._lock:
                        self._emit_errors += bad
                        self._appended -= bad
                        self._drained -= bad
                    n -= bad
            sent = self._export(events, deadline)
            if sent is _Sent.OUT_OF_TIME or journal.closed:
                # Out of time; or a sink slower than the shutdown deadline, which closed the journal
                # while this batch was on its way: the batch stays in the journal, for whoever takes
                # it next (the store de-duplicates the repeat of one that landed).
                with self._lock:
                    self._drained -= n
                return
            with self._lock:
                if sent is _Sent.FAILED:
                    self._dropped_export_failed += n
                elif self._adopted:
                    self._recovered += n
                shipping = {"exported": self._exported, "rejected": self._rejected, "batches": self._batches,
                            "export_errors": self._export_errors,
                            "dropped_export_failed": self._dropped_export_failed, "recovered": self._recovered}
            journal.note_shipping(shipping)
            journal.release(records.end, records.last_seq)
            with self._flushed:
                self._acked += n
                self._flushed.notify_all()
            if deadline is not None and time.monotonic() > deadline:
                return

    def _export(self, events: list[Event] | list[msgspec.Raw], deadline: float | None) -> _Sent:
        """Send one batch with bounded retries; counts delivered events and failed attempts (the
        caller counts a batch that was not delivered)."""
        backoff = self._config.retry_backoff_millis / 1000
        result = ExportResult(ExportStatus.RETRY, detail="not attempted")
        encoded = self._encoded and self._journal is not None
        sent = _Sent.FAILED
        for attempt in range(self._config.max_export_attempts):
            self._batch_seq += 1
            if self._journal is not None and not self._journal.closed:
                self._journal.note_batch_seq(self._batch_seq)  # a taker numbers on from here
            batch: Batch | RawBatch
            if encoded:
                batch = RawBatch(wire_version=WIRE_VERSION, source_id=self.source_id, batch_seq=self._batch_seq,
                                 sent_ns=time.time_ns(), events=events, stats=self.stats())  # type: ignore[arg-type]
            else:
                batch = Batch(source_id=self.source_id, batch_seq=self._batch_seq, sent_ns=time.time_ns(),
                              events=events, stats=self.stats())  # type: ignore[arg-type]
            try:
                result = self._sink.export(batch)  # type: ignore[arg-type]
            except Exception as exc:  # noqa: BLE001 - a sink bug must not kill the worker
                result = ExportResult(ExportStatus.RETRY, detail=f"{type(exc).__name__}: {exc}")
            if result.status is ExportStatus.SUCCESS:
                with self._lock:
                    self._exported += len(events) - result.rejected
                    self._rejected += result.rejected
                    self._batches += 1
                return _Sent.DELIVERED
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
                    sent = _Sent.OUT_OF_TIME
                    break
            time.sleep(wait)
        if sent is _Sent.OUT_OF_TIME and self._journal is not None:
            self._log_error(f"{len(events)} events left in the journal for the next taker: {result.detail}")
            return sent
        self._log_error(f"dropped {len(events)} events after export failed: {result.detail}")
        return _Sent.FAILED

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
            if self._journal is not None or self._adopted:
                depth = self._appended - self._drained
            else:
                depth = len(self._queue) - self._markers
            emitted = self._drained + depth + self._dropped_queue_full + self._emit_errors + self._dropped_shutdown
            return EmitterStats(
                ts_ns=time.time_ns(),
                source_id=self.source_id,
                instance=self._instance,
                engine=self._engine,
                emitted=max(emitted, self._emitted_floor),
                exported=self._exported,
                dropped_queue_full=self._dropped_queue_full,
                dropped_export_failed=self._dropped_export_failed,
                dropped_invalid=self._emit_errors + self._rejected,
                dropped_shutdown=self._dropped_shutdown,
                dropped_sampled_out=self._dropped_sampled_out,
                queue_depth=depth,
                batches=self._batches,
                export_errors=self._export_errors,
                recovered=self._recovered,
                ended=self._ending,
                ended_ns=self._ended_ns,
            )

    def force_flush(self, timeout_millis: int = 10000) -> bool:
        """Export everything emitted before this call; True if it all went out in time."""
        worker = self._worker
        if self._journal is not None:
            with self._lock:
                target = self._appended
            if self._shutdown_done or worker is None or not worker.is_alive():
                return self._acked >= target
            self._wake.set()
            with self._flushed:
                return self._flushed.wait_for(lambda: self._acked >= target, timeout_millis / 1000)
        if self._shutdown_done or worker is None or not worker.is_alive():
            return not self._queue
        marker = _FlushMarker()
        with self._lock:
            self._markers += 1
            self._queue.append(marker)
        self._wake.set()
        return marker.done.wait(timeout_millis / 1000)

    def shutdown(self) -> bool:
        """Flush within the shutdown deadline, stop the worker, close the sink; safe twice.

        Returns True when nothing was left behind. Events still queued in memory at the deadline
        are counted as dropped_shutdown, and a last stats-only batch reports the final counters,
        which say the emitter ended cleanly. Events still in a journal at the deadline are not
        dropped: the journal stays, and whoever takes it (the shipper, the next start) ships
        them. An adopted journal is shipped here, from the calling thread.
        """
        if self._shutdown_done:
            return True
        self._shutdown_done = True
        timeout = self._config.shutdown_timeout_millis / 1000
        deadline = time.monotonic() + timeout
        self._deadline = deadline
        with self._lock:
            self._stopping = True
        worker = self._worker
        if worker is not None:
            self._wake.set()
            worker.join(timeout)  # a stalled sink leaves the worker behind; we move on
        elif self._adopted:
            self._drain_journal(deadline)
        worker_done = worker is None or not worker.is_alive()
        if not self._adopted:
            self._ending, self._ended_ns = Ending.CLEAN, time.time_ns()
        journal = self._journal
        if journal is not None:
            with self._lock:
                leftover = self._appended - self._acked
                journal.note_drops(self._emit_counters(), 0)
            delivered = self._send_final_stats(deadline)
            done = leftover == 0 and delivered and worker_done
            if self._adopted and not done:
                journal.close(journal.state)  # as it was: the next taker tries again
            else:
                journal.close(State.CLOSED if done else State.STOPPED, self._ended_ns)
        else:
            with self._lock:
                leftover = sum(1 for item in list(self._queue) if isinstance(item, Event))
                self._queue.clear()
                self._markers = 0
                self._dropped_shutdown += leftover
            self._send_final_stats(deadline)
        if not self._adopted:
            try:
                self._sink.shutdown()
            except Exception as exc:  # noqa: BLE001
                self._log_error(f"sink shutdown failed: {exc}")
        # A worker still inside the sink holds a batch that has not been delivered.
        return leftover == 0 and self._dropped_export_failed == 0 and worker_done

    def _send_final_stats(self, deadline: float) -> bool:
        """A stats-only batch with the final counters; True if the sink took it."""
        worker = self._worker
        if (worker is not None and worker.is_alive()) or time.monotonic() > deadline:
            return False
        self._batch_seq += 1
        if self._journal is not None and not self._journal.closed:
            self._journal.note_batch_seq(self._batch_seq)
        batch = Batch(source_id=self.source_id, batch_seq=self._batch_seq, sent_ns=time.time_ns(), stats=self.stats())
        try:
            return self._sink.export(batch).status is ExportStatus.SUCCESS
        except Exception as exc:  # noqa: BLE001
            self._log_error(f"final stats not exported: {exc}")
            return False
