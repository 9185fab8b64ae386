"""The in-process emitter: stamping, batching, bounded buffering, retries, flush, shutdown, fork.

Every test builds its own BatchEmitter with register_atexit=False and shuts it down; stalls are
made with a gate (a threading.Event the test opens) rather than sleeps wherever possible.
"""

from __future__ import annotations

import os
import random
import selectors
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
from emitter_helpers import _restore_global_emitter, wait_until  # noqa: F401 - an autouse fixture

from kvtrace.instrumentation import api
from kvtrace.instrumentation.api import NoopEmitter, get_emitter, set_emitter
from kvtrace.instrumentation.config import (
    ConfigError,
    EmitterSettings,
    SinkKind,
    build_sink,
    configure,
)
from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.sinks.base import OK, ExportResult, ExportStatus
from kvtrace.instrumentation.sinks.http import HttpSink
from kvtrace.instrumentation.sinks.memory import MemorySink
from kvtrace.instrumentation.sinks.otlp import OtlpLogSink
from kvtrace.instrumentation.sinks.spool import SpoolSink
from kvtrace.instrumentation.sinks.store import StoreSink
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import ComponentKind, EventKind, Tier
from kvtrace.schema.records import EmitterStats
from kvtrace.schema.wire import SPOOL_SUFFIX, Batch, decode_batch, read_spool

# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def ev(key: int, ts_ns: int = 0) -> Event:
    """A valid commit event; source_id/seq (and ts_ns when 0) are left for the emitter to stamp."""
    return Event(
        kind=EventKind.COMMIT,
        ts_ns=ts_ns,
        source_id=0,
        seq=0,
        component=ComponentKind.FULL_ATTENTION,
        block_key=key,
        tier=Tier.DEVICE,
    )


def make(sink: object, **config: int) -> BatchEmitter:
    return BatchEmitter(sink, BatchConfig(**config), register_atexit=False)  # type: ignore[arg-type]


# A worker that only wakes on force_flush or a full batch: one flush == one batch.
QUIET = dict(max_queue_size=10_000, max_export_batch_size=1_000, schedule_delay_millis=60_000)


def assert_balanced(stats: EmitterStats) -> None:
    """Every emitted event is exported, dropped for a named reason, or still queued."""
    assert stats.emitted == (
        stats.exported
        + stats.dropped_queue_full
        + stats.dropped_export_failed
        + stats.dropped_invalid
        + stats.dropped_shutdown
        + stats.queue_depth
    ), stats


class GateSink(MemorySink):
    """A MemorySink whose export blocks until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()

    def export(self, batch: Batch) -> ExportResult:
        self.entered.set()
        self.gate.wait(30)
        return super().export(batch)


class FlakySink(MemorySink):
    """Answers `status` (with `retry_after_s`) to its first `fail_first` calls, then accepts."""

    def __init__(self, fail_first: int, status: ExportStatus = ExportStatus.RETRY, retry_after_s: float = 0.0):
        super().__init__()
        self.fail_first = fail_first
        self.status = status
        self.retry_after_s = retry_after_s
        self.call_times: list[float] = []

    def export(self, batch: Batch) -> ExportResult:
        self.call_times.append(time.monotonic())
        if len(self.call_times) <= self.fail_first:
            with self._lock:
                self.calls += 1
            return ExportResult(self.status, retry_after_s=self.retry_after_s, detail="flaky")
        return super().export(batch)


# --------------------------------------------------------------------------------------------
# stamping, ordering, accounting
# --------------------------------------------------------------------------------------------


def test_emit_stamps_identity_and_delivers_everything_in_order() -> None:
    sink = MemorySink()
    em = make(sink, max_queue_size=4096, max_export_batch_size=64, schedule_delay_millis=5)
    assert em.enabled is True
    events = [ev(i + 1) for i in range(1000)]
    fixed = ev(5000, ts_ns=123)
    for i, e in enumerate(events):
        em.emit(e)
        assert e.source_id == em.source_id
        assert e.seq == i
        assert e.ts_ns > 0
    em.emit(fixed)
    assert fixed.ts_ns == 123 and fixed.seq == 1000

    assert em.force_flush(10_000) is True
    got = sink.events
    assert [e.seq for e in got] == list(range(1001))
    assert [e.block_key for e in got] == [e.block_key for e in events] + [5000]
    assert {e.source_id for e in got} == {em.source_id}
    assert em.source_id != 0

    # batches: bounded size, numbered per source, each carrying stats
    assert all(0 < len(b.events) <= 64 for b in sink.batches)
    seqs = [b.batch_seq for b in sink.batches]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert all(b.source_id == em.source_id and b.stats is not None for b in sink.batches)

    st = em.stats()
    assert st.emitted == st.exported == 1001
    assert st.dropped == 0 and st.queue_depth == 0 and st.export_errors == 0
    assert st.batches == len(sink.batches)
    assert_balanced(st)

    assert em.shutdown() is True
    final = sink.last_stats
    assert final is not None
    assert final.emitted == final.exported == 1001 and final.dropped == 0
    assert sink.batches[-1].events == []  # the final batch is stats only


def test_two_emitters_have_distinct_sources() -> None:
    a, b = make(MemorySink()), make(MemorySink())
    try:
        assert a.source_id != b.source_id
        assert 0 < a.source_id < 2**64 and 0 < b.source_id < 2**64
    finally:
        a.shutdown()
        b.shutdown()


def test_full_buffer_drops_are_counted_and_appear_as_seq_gaps() -> None:
    sink = GateSink()
    em = make(sink, max_queue_size=100, max_export_batch_size=10, schedule_delay_millis=5)
    started = time.monotonic()
    for i in range(1000):
        em.emit(ev(i + 1))
    elapsed = time.monotonic() - started
    assert elapsed < 2.0  # the stalled sink blocks for 30 s; emit must not wait for it
    assert sink.entered.wait(10)

    st = em.stats()
    assert st.emitted == 1000
    assert st.queue_depth <= 100
    # at most one batch (<= 10 events) left the queue before the sink stalled
    assert 1000 - 100 - 10 <= st.dropped_queue_full <= 1000 - 100

    sink.gate.set()
    assert em.force_flush(10_000) is True
    assert em.shutdown() is True
    final = em.stats()
    assert final.emitted == 1000
    assert final.exported + final.dropped_queue_full == 1000
    assert final.dropped_shutdown == final.dropped_export_failed == final.queue_depth == 0
    assert_balanced(final)
    assert sink.last_stats == msgspec.structs.replace(final, ts_ns=sink.last_stats.ts_ns)

    delivered = [e.seq for e in sink.events]
    assert len(delivered) == len(set(delivered)) == final.exported
    gaps = set(range(1000)) - set(delivered)
    assert len(gaps) == final.dropped_queue_full


def test_emit_returns_while_sink_is_stalled() -> None:
    sink = MemorySink()
    sink.delay_s = 5.0
    em = make(
        sink,
        max_queue_size=1000,
        max_export_batch_size=100,
        schedule_delay_millis=5,
        shutdown_timeout_millis=200,
    )
    started = time.monotonic()
    for i in range(10_000):
        em.emit(ev(i + 1))
    assert time.monotonic() - started < 2.0  # blocking on the sink would take 5 s or more
    assert wait_until(lambda: sink.calls >= 1)
    st = em.stats()
    assert st.emitted == 10_000
    assert st.dropped_queue_full >= 10_000 - 1000 - 100

    started = time.monotonic()
    # a batch is still stuck in the sink and the queue is full: nothing is delivered yet
    assert em.shutdown() is False
    assert time.monotonic() - started < 3.0  # honours its 0.2 s deadline, not the 5 s stall
    final = em.stats()
    assert final.emitted == 10_000  # queued events dropped at shutdown are still "emitted"
    assert final.dropped_shutdown == st.queue_depth
    assert final.queue_depth == 0
    assert sink.shutdowns == 1


def test_shutdown_reports_batch_still_in_flight() -> None:
    sink = GateSink()
    em = make(sink, max_queue_size=100, max_export_batch_size=10, shutdown_timeout_millis=100)
    for i in range(5):
        em.emit(ev(i + 1))
    assert em.force_flush(50) is False  # the worker took the batch and is stuck in export
    assert sink.entered.wait(10)
    assert em.shutdown() is False  # five events have not been delivered
    sink.gate.set()
    assert wait_until(lambda: em.stats().exported == 5)
    assert_balanced(em.stats())


# --------------------------------------------------------------------------------------------
# sink failures and retries
# --------------------------------------------------------------------------------------------


def test_sink_that_raises_never_reaches_the_caller() -> None:
    sink = MemorySink()
    sink.raise_error = RuntimeError("boom")
    em = make(sink, max_export_attempts=3, retry_backoff_millis=1, **QUIET)
    for i in range(50):
        em.emit(ev(i + 1))  # must not raise
    em.force_flush(10_000)
    st = em.stats()
    assert sink.calls == 3
    assert st.export_errors == 3
    assert st.dropped_export_failed == 50
    assert st.exported == 0 and st.batches == 0
    assert_balanced(st)
    assert em.shutdown() is False  # events were lost
    assert sink.shutdowns == 1


def test_sink_failure_is_not_retried() -> None:
    sink = MemorySink()
    sink.fail_with = ExportStatus.FAILURE
    em = make(sink, max_export_attempts=5, retry_backoff_millis=1, **QUIET)
    for i in range(40):
        em.emit(ev(i + 1))
    em.force_flush(10_000)
    for i in range(10):
        em.emit(ev(100 + i))
    em.force_flush(10_000)
    st = em.stats()
    assert sink.calls == 2  # one attempt per batch, no retry storm
    assert st.export_errors == 2
    assert st.dropped_export_failed == 50
    assert st.exported == 0
    assert_balanced(st)
    em.shutdown()


def test_retry_status_is_retried_up_to_the_attempt_bound() -> None:
    sink = MemorySink()
    sink.fail_with = ExportStatus.RETRY
    em = make(sink, max_export_attempts=4, retry_backoff_millis=1, **QUIET)
    for i in range(7):
        em.emit(ev(i + 1))
    em.force_flush(10_000)
    st = em.stats()
    assert sink.calls == 4 and st.export_errors == 4
    assert st.dropped_export_failed == 7
    assert_balanced(st)
    em.shutdown()


def test_retry_then_success_delivers_everything() -> None:
    sink = FlakySink(fail_first=2)
    em = make(sink, max_export_attempts=5, retry_backoff_millis=1, **QUIET)
    for i in range(50):
        em.emit(ev(i + 1))
    assert em.force_flush(10_000) is True
    st = em.stats()
    assert [e.seq for e in sink.events] == list(range(50))
    assert st.exported == 50 and st.export_errors == 2 and st.batches == 1
    assert st.dropped == 0
    assert len(sink.call_times) == 3
    assert_balanced(st)
    assert em.shutdown() is True


def test_retry_after_is_honoured_in_full() -> None:
    sink = FlakySink(fail_first=1, retry_after_s=0.3)
    em = make(sink, max_export_attempts=3, retry_backoff_millis=1, **QUIET)
    em.emit(ev(1))
    assert em.force_flush(10_000) is True
    assert len(sink.call_times) == 2
    # the server asked for 0.3 s; jitter may lengthen our own backoff, never shorten its wait
    assert sink.call_times[1] - sink.call_times[0] >= 0.29
    assert len(sink.events) == 1
    em.shutdown()


def test_retry_after_is_capped_by_max_retry_wait() -> None:
    sink = FlakySink(fail_first=1, retry_after_s=600.0)
    em = make(sink, max_export_attempts=2, retry_backoff_millis=1, max_retry_wait_millis=20, **QUIET)
    em.emit(ev(1))
    assert em.force_flush(10_000) is True  # a 600 s Retry-After would time this out
    assert len(sink.events) == 1
    em.shutdown()


# --------------------------------------------------------------------------------------------
# malformed input
# --------------------------------------------------------------------------------------------


def test_malformed_objects_are_counted_not_raised() -> None:
    sink = MemorySink()
    em = make(sink, max_export_attempts=2, retry_backoff_millis=1, **QUIET)
    em.emit(ev(1))
    for bad in (None, object(), 42, "commit", SimpleNamespace(ts_ns=0, source_id=0, seq=0)):
        em.emit(bad)  # type: ignore[arg-type]
    em.emit(ev(2))
    assert em.force_flush(10_000) is True
    st = em.stats()
    assert st.dropped_invalid == 5
    assert st.emitted == 7
    # the malformed objects neither took a seq nor cost the good events their batch
    assert [(e.seq, e.block_key) for e in sink.events] == [(0, 1), (1, 2)]
    assert st.exported == 2 and st.export_errors == 0
    assert_balanced(st)
    assert em.shutdown() is True


# --------------------------------------------------------------------------------------------
# flush and shutdown
# --------------------------------------------------------------------------------------------


def test_force_flush_times_out_on_a_stalled_sink_without_skewing_stats() -> None:
    sink = GateSink()
    em = make(sink, **QUIET)
    em.emit(ev(1))
    assert em.force_flush(100) is False
    assert sink.entered.wait(10)  # the worker holds event 1 inside the sink
    em.emit(ev(2))
    assert em.force_flush(100) is False
    st = em.stats()
    assert st.emitted == 2  # pending flush markers are not events
    assert st.queue_depth == 1
    sink.gate.set()
    assert em.force_flush(10_000) is True
    st = em.stats()
    assert st.emitted == st.exported == 2 and st.queue_depth == 0
    assert_balanced(st)
    assert em.shutdown() is True


def test_shutdown_flushes_queue_and_is_idempotent() -> None:
    sink = MemorySink()
    em = make(sink, **QUIET)
    for i in range(100):
        em.emit(ev(i + 1))
    assert em.shutdown() is True  # the worker was asleep: shutdown itself delivered them
    assert [e.seq for e in sink.events] == list(range(100))
    final = sink.last_stats
    assert final is not None
    assert final.emitted == final.exported == 100 and final.dropped == 0
    assert sink.batches[-1].events == [] and sink.batches[-1].stats == final
    n_batches = len(sink.batches)

    assert em.shutdown() is True
    assert sink.shutdowns == 1

    late = ev(999)
    em.emit(late)
    em.emit(ev(1000))
    assert late.seq == 100  # still stamped: the loss shows as a gap downstream
    assert len(sink.batches) == n_batches
    assert len(sink.events) == 100
    st = em.stats()
    assert st.dropped_shutdown == 2
    assert st.emitted == 102
    assert_balanced(st)
    assert em.force_flush(100) is True  # nothing queued after shutdown


def test_shutdown_counts_leftovers_of_a_stalled_sink() -> None:
    sink = GateSink()
    em = make(sink, max_queue_size=100, max_export_batch_size=10, schedule_delay_millis=5,
              shutdown_timeout_millis=100)
    for i in range(30):
        em.emit(ev(i + 1))
    assert sink.entered.wait(10)
    queued = em.stats().queue_depth
    assert queued > 0
    assert em.shutdown() is False
    st = em.stats()
    assert st.dropped_shutdown == queued
    assert st.emitted == 30
    sink.gate.set()  # the in-flight batch goes out after all
    assert wait_until(lambda: em.stats().exported == 30 - queued)
    assert_balanced(em.stats())
    assert sink.shutdowns == 1


def test_final_stats_batch_reflects_drops() -> None:
    sink = FlakySink(fail_first=1, status=ExportStatus.FAILURE)
    em = make(sink, **QUIET)
    for i in range(10):
        em.emit(ev(i + 1))
    em.force_flush(10_000)
    for i in range(5):
        em.emit(ev(100 + i))
    em.emit(None)  # type: ignore[arg-type]
    assert em.shutdown() is False
    final = sink.last_stats
    assert final is not None
    assert final.emitted == 16
    assert final.exported == 5
    assert final.dropped_export_failed == 10
    assert final.dropped_invalid == 1
    assert final.export_errors == 1
    assert_balanced(final)


# --------------------------------------------------------------------------------------------
# concurrency
# --------------------------------------------------------------------------------------------


def test_many_threads_emit_exactly_once() -> None:
    sink = MemorySink()
    em = make(sink, max_queue_size=65_536, max_export_batch_size=2048, schedule_delay_millis=10)
    threads_n, per_thread = 8, 5000
    barrier = threading.Barrier(threads_n)

    def work(t: int) -> None:
        barrier.wait()
        for i in range(per_thread):
            em.emit(ev((t << 32) | (i + 1)))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(threads_n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not any(th.is_alive() for th in threads)
    assert em.force_flush(20_000) is True
    got = sink.events
    total = threads_n * per_thread
    assert len(got) == total
    assert sorted(e.seq for e in got) == list(range(total))
    assert len({e.block_key for e in got}) == total
    # each thread's events arrive in the order it emitted them, with increasing seq
    for t in range(threads_n):
        mine = [e for e in got if e.block_key >> 32 == t]
        assert [e.block_key & 0xFFFFFFFF for e in mine] == list(range(1, per_thread + 1))
        assert all(a.seq < b.seq for a, b in zip(mine, mine[1:], strict=False))
    st = em.stats()
    assert st.emitted == st.exported == total and st.dropped == 0
    assert em.shutdown() is True


# --------------------------------------------------------------------------------------------
# fork
# --------------------------------------------------------------------------------------------


def _in_child(body) -> str:  # noqa: ANN001
    """Run body() in a forked child; return what it wrote (a str), failing on a hang or crash."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            os.write(w, body().encode())
            os.close(w)
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    data = b""
    deadline = time.monotonic() + 30
    # A selector, not select(): late in a long test run this process holds over 1,024 descriptors
    # (ClickHouse's pooled threads each keep three /proc files open), past what select() takes.
    waiting = selectors.DefaultSelector()
    waiting.register(r, selectors.EVENT_READ)
    try:
        while time.monotonic() < deadline:
            if waiting.select(0.5):
                chunk = os.read(r, 4096)
                if not chunk:
                    break
                data += chunk
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.01)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("forked child did not finish")
    finally:
        waiting.close()
        os.close(r)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    return data.decode()


def _spool_contents(directory: Path) -> dict[int, tuple[list[int], int]]:
    """source_id -> (event seqs in file order, final exported count) from every spool file."""
    out: dict[int, tuple[list[int], int]] = {}
    files = sorted(directory.glob(f"*{SPOOL_SUFFIX}"))
    assert files
    for path in files:
        with path.open("rb") as f:
            scan = read_spool(f, path.name)
        assert scan.torn_tail_bytes == 0, path
        for payload in scan.payloads:
            batch = decode_batch(payload)
            assert path.name.startswith(f"kvtrace-{batch.source_id:016x}-")
            seqs, exported = out.get(batch.source_id, ([], 0))
            for raw in batch.events:
                seqs.append(msgspec.msgpack.decode(raw, type=Event).seq)
            if batch.stats is not None:
                exported = batch.stats.exported
            out[batch.source_id] = (seqs, exported)
    return out


def test_forked_child_gets_fresh_source_and_its_own_spool(tmp_path: Path) -> None:
    sink = SpoolSink(tmp_path)
    em = make(sink, max_queue_size=1000, max_export_batch_size=10, schedule_delay_millis=5)
    for i in range(30):
        em.emit(ev(i + 1))
    assert em.force_flush(10_000) is True
    parent_id = em.source_id

    def child() -> str:
        for i in range(25):
            em.emit(ev(1000 + i))
        ok = em.shutdown()
        st = em.stats()
        return f"{em.source_id} {st.emitted} {st.exported} {int(ok)}"

    data = _in_child(child)
    child_id, child_emitted, child_exported, child_ok = map(int, data.split())
    assert child_id != parent_id and child_id != 0
    assert (child_emitted, child_exported, child_ok) == (25, 25, 1)

    # the parent carries on under its own identity, its seq unbroken by the child
    assert em.source_id == parent_id
    for i in range(10):
        em.emit(ev(2000 + i))
    assert em.shutdown() is True

    contents = _spool_contents(tmp_path)
    assert set(contents) == {parent_id, child_id}
    assert contents[parent_id] == (list(range(40)), 40)
    assert contents[child_id] == (list(range(25)), 25)


def test_emitter_shut_down_before_fork_stays_shut_in_the_child() -> None:
    sink = MemorySink()
    em = make(sink, **QUIET)
    em.emit(ev(1))
    assert em.shutdown() is True

    def child() -> str:
        em.emit(ev(2))
        st = em.stats()
        return f"{st.emitted} {st.dropped_shutdown} {st.queue_depth} {int(em.force_flush(100))}"

    # the child has no worker: an event it emits is dropped and counted, not queued forever
    assert _in_child(child).split() == ["1", "1", "0", "1"]


# --------------------------------------------------------------------------------------------
# sampling
# --------------------------------------------------------------------------------------------


def test_sampling_is_deterministic_and_near_the_rate() -> None:
    em = make(MemorySink(), **QUIET)
    rng = random.Random(7)
    keys = [rng.getrandbits(64) for _ in range(20_000)]
    first = [em.sampled(k, 0.25) for k in keys]
    assert [em.sampled(k, 0.25) for k in keys[:2000]] == first[:2000]
    kept = sum(first)
    assert 0.22 < kept / len(keys) < 0.28
    sequential = sum(em.sampled(k, 0.5) for k in range(10_000))
    assert 0.45 < sequential / 10_000 < 0.55

    refused = (len(keys) - kept) + (2000 - sum(first[:2000])) + (10_000 - sequential)
    assert em.stats().dropped_sampled_out == refused

    before = em.stats().dropped_sampled_out
    assert all(em.sampled(k, 1.0) for k in keys[:1000])
    assert not any(em.sampled(k, 0.0) for k in keys[:100])
    st = em.stats()
    assert st.dropped_sampled_out == before + 100
    assert st.emitted == 0 and st.dropped == 0  # sampling is a choice, not a loss
    em.shutdown()


def test_sampling_nests_across_rates() -> None:
    """A key kept at a low rate is kept at every higher one (the hash is compared to the rate)."""
    em = make(MemorySink(), **QUIET)
    rng = random.Random(11)
    for k in (rng.getrandbits(64) for _ in range(2000)):
        if em.sampled(k, 0.1):
            assert em.sampled(k, 0.3) and em.sampled(k, 0.9)
    em.shutdown()


# --------------------------------------------------------------------------------------------
# the global API
# --------------------------------------------------------------------------------------------


def test_noop_emitter_is_the_default_in_a_fresh_process() -> None:
    code = (
        "from kvtrace.instrumentation.api import get_emitter, NoopEmitter\n"
        "e = get_emitter()\n"
        "print(type(e).__name__, e.enabled)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["NoopEmitter", "False"]


def test_noop_emitter_does_nothing() -> None:
    em = get_emitter()
    assert isinstance(em, NoopEmitter)
    assert em.enabled is False
    e = ev(1)
    assert em.emit(e) is None
    assert (e.source_id, e.seq, e.ts_ns) == (0, 0, 0)  # untouched
    assert em.sampled(1, 1.0) is False
    st = em.stats()
    assert st.emitted == st.exported == st.dropped == 0
    assert em.force_flush() is True and em.shutdown() is True


def test_set_emitter_returns_previous_and_none_restores_noop() -> None:
    batch = make(MemorySink())
    try:
        assert isinstance(set_emitter(batch), NoopEmitter)
        assert get_emitter() is batch
        assert set_emitter(None) is batch
        assert get_emitter() is api._NOOP
    finally:
        batch.shutdown()


# --------------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------------


def test_batch_config_defaults_are_valid() -> None:
    cfg = BatchConfig()
    assert cfg.max_export_batch_size <= cfg.max_queue_size
    assert BatchConfig(max_queue_size=1, max_export_batch_size=1).max_queue_size == 1
    assert BatchConfig(schedule_delay_millis=0, retry_backoff_millis=0).schedule_delay_millis == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_queue_size": 0},
        {"max_queue_size": -1},
        {"max_export_batch_size": 0},
        {"max_export_attempts": 0},
        {"max_queue_size": 10, "max_export_batch_size": 11},
        {"schedule_delay_millis": -5},
        {"retry_backoff_millis": 1.5},
        {"shutdown_timeout_millis": "100"},
        {"max_retry_wait_millis": None},
    ],
)
def test_batch_config_rejects_bad_bounds(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        BatchConfig(**kwargs)


@pytest.mark.parametrize(
    ("env", "kind"),
    [
        ({"KVTRACE_ENABLED": "1", "KVTRACE_COLLECTOR_URL": "http://127.0.0.1:9"}, SinkKind.COLLECTOR),
        ({"KVTRACE_ENABLED": "true", "KVTRACE_DSN": "chdb:///tmp/x"}, SinkKind.STORE),
        ({"KVTRACE_ENABLED": "yes", "KVTRACE_OTLP_ENDPOINT": "http://127.0.0.1:4318/v1/logs"}, SinkKind.OTLP),
        ({"KVTRACE_ENABLED": "on", "KVTRACE_SPOOL_DIR": "/tmp/spool"}, SinkKind.SPOOL),
        ({"KVTRACE_ENABLED": "1"}, SinkKind.SPOOL),
        ({"KVTRACE_ENABLED": "1", "KVTRACE_SINK": "Spool", "KVTRACE_DSN": "chdb:///tmp/x"}, SinkKind.SPOOL),
        (
            {"KVTRACE_ENABLED": "1", "KVTRACE_DSN": "chdb:///tmp/x", "KVTRACE_COLLECTOR_URL": "http://h:1"},
            SinkKind.COLLECTOR,
        ),
    ],
)
def test_settings_pick_the_sink(env: dict[str, str], kind: SinkKind) -> None:
    s = EmitterSettings.from_env(env)
    assert s.enabled is True
    assert s.sink is kind


def test_settings_read_every_variable() -> None:
    s = EmitterSettings.from_env(
        {
            "KVTRACE_ENABLED": " TRUE ",
            "KVTRACE_COLLECTOR_URL": "http://127.0.0.1:9",
            "KVTRACE_TOKEN": "s3cret",
            "KVTRACE_INSTANCE": "node-a",
            "KVTRACE_TENANT": "acme",
            "KVTRACE_SAMPLE_RATE": "0.5",
            "KVTRACE_MAX_QUEUE_SIZE": "2048",
            "KVTRACE_MAX_EXPORT_BATCH_SIZE": "256",
            "KVTRACE_SCHEDULE_DELAY_MILLIS": "50",
        }
    )
    assert (s.instance, s.tenant, s.sample_rate, s.token) == ("node-a", "acme", 0.5, "s3cret")
    assert (s.batch.max_queue_size, s.batch.max_export_batch_size, s.batch.schedule_delay_millis) == (2048, 256, 50)
    assert "s3cret" not in repr(s)


def test_settings_defaults_are_disabled() -> None:
    s = EmitterSettings.from_env({})
    assert s.enabled is False
    assert s.sample_rate == 1.0
    assert s.instance.endswith(f":{os.getpid()}")
    assert s.batch == BatchConfig()
    # sink requirements are only enforced when tracing is on
    assert EmitterSettings.from_env({"KVTRACE_SINK": "store"}).enabled is False


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"KVTRACE_ENABLED": "maybe"}, "KVTRACE_ENABLED"),
        ({"KVTRACE_SAMPLE_RATE": "2"}, "KVTRACE_SAMPLE_RATE"),
        ({"KVTRACE_SAMPLE_RATE": "0"}, "KVTRACE_SAMPLE_RATE"),
        ({"KVTRACE_SAMPLE_RATE": "half"}, "KVTRACE_SAMPLE_RATE"),
        ({"KVTRACE_SINK": "kafka"}, "KVTRACE_SINK"),
        ({"KVTRACE_MAX_QUEUE_SIZE": "abc"}, "KVTRACE_MAX_QUEUE_SIZE"),
        ({"KVTRACE_MAX_EXPORT_BATCH_SIZE": "1e3"}, "KVTRACE_MAX_EXPORT_BATCH_SIZE"),
        ({"KVTRACE_SCHEDULE_DELAY_MILLIS": "-1"}, "KVTRACE_SCHEDULE_DELAY_MILLIS"),
        ({"KVTRACE_MAX_QUEUE_SIZE": "0"}, "KVTRACE_MAX_QUEUE_SIZE"),
        ({"KVTRACE_MAX_QUEUE_SIZE": "64", "KVTRACE_MAX_EXPORT_BATCH_SIZE": "128"}, "KVTRACE_MAX_EXPORT_BATCH_SIZE"),
        ({"KVTRACE_ENABLED": "1", "KVTRACE_SINK": "store"}, "KVTRACE_DSN"),
        ({"KVTRACE_ENABLED": "1", "KVTRACE_SINK": "collector"}, "KVTRACE_COLLECTOR_URL"),
    ],
)
def test_settings_errors_name_the_variable(env: dict[str, str], variable: str) -> None:
    with pytest.raises(ConfigError, match=variable):
        EmitterSettings.from_env(env)


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


def test_build_sink_builds_each_kind(tmp_path: Path, store_dsn: str) -> None:
    collector = build_sink(EmitterSettings(enabled=True, sink=SinkKind.COLLECTOR, collector_url="http://127.0.0.1:9"))
    assert isinstance(collector, HttpSink) and collector.url == "http://127.0.0.1:9/v1/batches"
    store = build_sink(EmitterSettings(enabled=True, sink=SinkKind.STORE, dsn=store_dsn))
    assert isinstance(store, StoreSink)  # the store connects lazily: nothing opened here
    spool = build_sink(EmitterSettings(enabled=True, sink=SinkKind.SPOOL, spool_dir=str(tmp_path)))
    assert isinstance(spool, SpoolSink)
    otlp = build_sink(EmitterSettings(enabled=True, sink=SinkKind.OTLP, otlp_endpoint="http://127.0.0.1:9/v1/logs"))
    try:
        assert isinstance(otlp, OtlpLogSink)
    finally:
        otlp.shutdown()


def test_configure_disabled_installs_the_noop() -> None:
    em = configure(EmitterSettings(enabled=False))
    assert em is get_emitter()
    assert isinstance(em, NoopEmitter) and em.enabled is False


def test_configure_disabled_shuts_the_previous_emitter_down() -> None:
    sink = MemorySink()
    previous = make(sink, **QUIET)
    set_emitter(previous)
    previous.emit(ev(1))
    em = configure(EmitterSettings(enabled=False))
    assert isinstance(em, NoopEmitter)
    # turning tracing off flushes what the old emitter held, as re-configuring does
    assert sink.shutdowns == 1
    assert [e.block_key for e in sink.events] == [1]


def test_configure_enabled_installs_a_batch_emitter(tmp_path: Path) -> None:
    settings = EmitterSettings(
        enabled=True,
        sink=SinkKind.SPOOL,
        spool_dir=str(tmp_path),
        instance="inst-1",
        batch=BatchConfig(max_queue_size=1000, max_export_batch_size=100, schedule_delay_millis=10),
    )
    em = configure(settings, engine="sim")
    assert isinstance(em, BatchEmitter) and get_emitter() is em and em.enabled is True
    for i in range(20):
        em.emit(ev(i + 1))
    assert em.force_flush(10_000) is True

    # re-configuring shuts the previous emitter down (its final stats reach its spool)
    em2 = configure(settings, engine="sim")
    assert em2 is not em and get_emitter() is em2
    em.emit(ev(99))
    assert em.stats().dropped_shutdown == 1
    em2.shutdown()

    contents = _spool_contents(tmp_path)
    assert contents[em.source_id] == (list(range(20)), 20)
    stats = []
    for path in sorted(tmp_path.glob(f"kvtrace-{em.source_id:016x}-*{SPOOL_SUFFIX}")):
        with path.open("rb") as f:
            stats += [decode_batch(p).stats for p in read_spool(f).payloads]
    last = [s for s in stats if s is not None][-1]
    assert (last.instance, last.engine) == ("inst-1", "sim")


def test_sink_protocol_is_runtime_checkable() -> None:
    from kvtrace.instrumentation.sinks.base import Sink

    assert isinstance(MemorySink(), Sink)
    assert OK.status is ExportStatus.SUCCESS and OK.rejected == 0


def test_request_keys_are_the_same_in_every_process() -> None:
    """Sampling by request must pick the same requests in the prefill and the decode process
    (and in an engine and its resolver): Python's string hash is salted per process."""
    import subprocess
    import sys

    from kvtrace.instrumentation.api import request_key

    ids = ["req-1", "chatcmpl-42", "7f3e"]
    other = subprocess.run([sys.executable, "-c", "import sys; from kvtrace.instrumentation.api import request_key; "
                            "print(*(request_key(r) for r in sys.argv[1:]))", *ids],
                           capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": "12345"})
    assert [int(x) for x in other.stdout.split()] == [request_key(r) for r in ids]
    assert len({request_key(f"r{i}") for i in range(1000)}) == 1000
