"""Cost of one `BatchEmitter.emit()` on the caller's thread, relative to a bare Python call.

Every variant is timed in batches of `--batch` calls (per-call time = batch time / batch size).
One round times one batch of every variant, in a shuffled order, so machine noise lands on all
of them alike. Reported: median and p99 of the per-call time over rounds, and the median over
rounds of (variant batch time / bare-call batch time of the same round). No absolute
thresholds: only same-process, interleaved comparisons.

Events are built before their batch is timed and fresh each round (`emit` stamps them, and an
event whose ts_ns is already set would skip the clock read), except in the `construct` rows,
which time what a shim really pays. The emitter's worker runs while the caller is timed, as in
an engine; the GIL slices it takes show up in the p99 (compare the `worker parked` row).

Groups: baselines; emit (what ships); journal (emit with the emitter's journal, the default for
engine processes that send to a collector or spool files: the event is encoded into a
memory-mapped file before emit() returns, so the caller pays the encoding that the in-memory
path leaves to the worker, whose share per event the `worker's encoding` rows give);
construction (what building an Event costs, including two CPython call-shape effects); ablation
(emit() rebuilt one step at a time, and proposals that are NOT in the shipped code, marked
[proposal]).

    .venv/bin/python benchmarks/bench_emit.py [--events 200000] [--batch 1000]
"""

from __future__ import annotations

import argparse
import collections
import gc
import itertools
import platform
import random
import statistics
import sys
import tempfile
import time
from typing import Any

import msgspec
from counting_sink import CountingSink  # beside this script

from kvtrace.instrumentation.api import NoopEmitter
from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter, JournalConfig
from kvtrace.instrumentation.sinks.memory import MemorySink
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import ComponentKind, EventKind, Tier
from kvtrace.schema.wire import Batch, encode_batch

BLOCK = 16
CHAIN = 64
IDENT = {"model": "meta-llama/Llama-3.1-8B-Instruct", "instance": "bench-0", "engine": "vllm"}
pc = time.perf_counter_ns


# -- events ------------------------------------------------------------------------------------
def _key(i: int) -> int:
    return (i * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF or 1


def commit_event(i: int) -> Event:
    return Event(
        kind=EventKind.COMMIT, ts_ns=0, source_id=0, seq=0,
        component=ComponentKind.FULL_ATTENTION, block_key=_key(i), parent_key=_key(i - 1),
        token_start=(i % CHAIN) * BLOCK, token_end=(i % CHAIN + 1) * BLOCK, tier=Tier.DEVICE,
        nbytes=BLOCK * 131072, **IDENT,
    )


CHAINS = [[_key(c * 1000 + j) for j in range(CHAIN)] for c in range(32)]


def lookup_event(i: int) -> Event:
    return Event(
        kind=EventKind.LOOKUP, ts_ns=0, source_id=0, seq=0, request_id=f"req-{i}",
        prompt_tokens=CHAIN * BLOCK, group_block_keys=[CHAINS[i % len(CHAINS)]],
        group_hit_tokens=[32 * BLOCK], reported_hit_tokens=32 * BLOCK, **IDENT,
    )


def _tuple_event_type() -> type:
    """[proposal] An Event subclass whose four list fields are tuples defaulting to ().

    msgspec copies a `[]` default into a fresh, GC-tracked list for every instance; `()` is a
    shared immutable singleton. Field order and every other default are Event's, and it passes
    emit()'s isinstance check, so only the construction cost differs.
    """
    fields = [(f.name, tuple, ()) for f in msgspec.structs.fields(Event) if f.default_factory is list]
    out = msgspec.defstruct("EventTupleFields", fields, bases=(Event,), kw_only=True, omit_defaults=True, gc=False)
    assert out.__struct_fields__ == Event.__struct_fields__
    return out


EventT = _tuple_event_type()


# -- the ablation: emit() rebuilt one step at a time, as methods (same call overhead) ------------
class Ablation(BatchEmitter):
    """Each a_..d_ method is a prefix of `BatchEmitter.emit` as of 2026-11-30 (isinstance check,
    stamp source_id, seq, ts_ns, append, then the two len checks); f_ and g_ are proposals. If
    emit() changes, update these to match: the `= emit` row always calls the shipped method.
    """

    def a0_isinstance(self, event: Event) -> None:
        try:
            if not isinstance(event, Event):
                raise TypeError(f"not an Event: {type(event).__name__}")
        except Exception:  # noqa: BLE001
            pass

    def a_stamp_source(self, event: Event) -> None:
        try:
            if not isinstance(event, Event):
                raise TypeError(f"not an Event: {type(event).__name__}")
            event.source_id = self.source_id
        except Exception:  # noqa: BLE001
            pass

    def b_plus_seq(self, event: Event) -> None:
        try:
            if not isinstance(event, Event):
                raise TypeError(f"not an Event: {type(event).__name__}")
            event.source_id = self.source_id
            event.seq = next(self._seq)
        except Exception:  # noqa: BLE001
            pass

    def c_plus_ts(self, event: Event) -> None:
        try:
            if not isinstance(event, Event):
                raise TypeError(f"not an Event: {type(event).__name__}")
            event.source_id = self.source_id
            event.seq = next(self._seq)
            if not event.ts_ns:
                event.ts_ns = time.time_ns()
        except Exception:  # noqa: BLE001
            pass

    def d_plus_append(self, event: Event) -> None:
        try:
            if not isinstance(event, Event):
                raise TypeError(f"not an Event: {type(event).__name__}")
            event.source_id = self.source_id
            event.seq = next(self._seq)
            if not event.ts_ns:
                event.ts_ns = time.time_ns()
            self._queue.append(event)
        except Exception:  # noqa: BLE001
            pass

    # e = the shipped emit(): d + the queue-full / stopping check + the batch-ready check.

    def f_cached_limits(self, event: Event) -> None:
        """[proposal] emit() with the two limits copied onto self at init, one len() call."""
        try:
            if not isinstance(event, Event):
                raise TypeError(f"not an Event: {type(event).__name__}")
            event.source_id = self.source_id
            event.seq = next(self._seq)
            if not event.ts_ns:
                event.ts_ns = time.time_ns()
            queue = self._queue
            n = len(queue)
            if n >= self._max_queue or self._stopping:
                with self._lock:
                    if self._stopping:
                        self._dropped_shutdown += 1
                    else:
                        self._dropped_queue_full += 1
                return
            queue.append(event)
            if n + 1 >= self._max_batch:
                self._wake.set()
        except Exception:  # noqa: BLE001
            with self._lock:
                self._emit_errors += 1

    def g_drop_lockfree(self, event: Event) -> None:
        """[proposal] emit() counting queue-full drops with an itertools.count (atomic under the
        GIL, like the seq counter) instead of taking the lock; stats() would read it off-path."""
        try:
            if not isinstance(event, Event):
                raise TypeError(f"not an Event: {type(event).__name__}")
            event.source_id = self.source_id
            event.seq = next(self._seq)
            if not event.ts_ns:
                event.ts_ns = time.time_ns()
            queue = self._queue
            if len(queue) >= self._config.max_queue_size or self._stopping:
                if self._stopping:
                    with self._lock:
                        self._dropped_shutdown += 1
                else:
                    next(self._drop_counter)
                return
            queue.append(event)
            if len(queue) >= self._config.max_export_batch_size:
                self._wake.set()
        except Exception:  # noqa: BLE001
            with self._lock:
                self._emit_errors += 1


def bare(x: object) -> None:
    return None


# -- timed loops: only the measured call is inside the loop ---------------------------------------
def time_calls(fn, items) -> int:
    t0 = pc()
    for x in items:
        fn(x)
    return pc() - t0


def time_empty(items) -> int:
    t0 = pc()
    for _ in items:
        pass
    return pc() - t0


def time_construct_commit(emit, idx, E=Event) -> int:
    """14 keyword arguments: CPython 3.11 compiles this to a KW_NAMES + CALL (fast call)."""
    K, C, T = EventKind.COMMIT, ComponentKind.FULL_ATTENTION, Tier.DEVICE
    model, inst, eng = IDENT["model"], IDENT["instance"], IDENT["engine"]
    t0 = pc()
    for key, parent, start in idx:
        emit(E(kind=K, ts_ns=0, source_id=0, seq=0, component=C, block_key=key, parent_key=parent,
               token_start=start, token_end=start + 16, tier=T, nbytes=2097152,
               model=model, instance=inst, engine=eng))
    return pc() - t0


def time_construct_commit_no_envelope(emit, idx) -> int:
    """11 keyword arguments: ts_ns/source_id/seq left to their default_factory=int."""
    E, K, C, T = Event, EventKind.COMMIT, ComponentKind.FULL_ATTENTION, Tier.DEVICE
    model, inst, eng = IDENT["model"], IDENT["instance"], IDENT["engine"]
    t0 = pc()
    for key, parent, start in idx:
        emit(E(kind=K, component=C, block_key=key, parent_key=parent,
               token_start=start, token_end=start + 16, tier=T, nbytes=2097152,
               model=model, instance=inst, engine=eng))
    return pc() - t0


def time_construct_commit_16kw(emit, idx) -> int:
    """The same event plus two identity fields: 16 keyword arguments. CPython 3.11 compiles a
    call with positional + 2 * keyword > 30 stack slots to BUILD_MAP + CALL_FUNCTION_EX."""
    E, K, C, T = Event, EventKind.COMMIT, ComponentKind.FULL_ATTENTION, Tier.DEVICE
    model, inst, eng = IDENT["model"], IDENT["instance"], IDENT["engine"]
    t0 = pc()
    for key, parent, start in idx:
        emit(E(kind=K, ts_ns=0, source_id=0, seq=0, component=C, block_key=key, parent_key=parent,
               token_start=start, token_end=start + 16, tier=T, nbytes=2097152,
               model=model, instance=inst, engine=eng, block_size=16, kv_dtype="bfloat16"))
    return pc() - t0


def time_construct_commit_splat(emit, idx) -> int:
    """cli/demo.py style: Event(kind=..., **common, **ident), a dict built per event."""
    E, K, C, T = Event, EventKind.COMMIT, ComponentKind.FULL_ATTENTION, Tier.DEVICE
    ident = IDENT
    t0 = pc()
    for key, parent, start in idx:
        common = dict(component=C, block_key=key, parent_key=parent, token_start=start,
                      token_end=start + 16, tier=T, nbytes=2097152)
        emit(E(kind=K, ts_ns=0, source_id=0, seq=0, **common, **ident))
    return pc() - t0


def time_construct_lookup(emit, idx) -> int:
    E, K = Event, EventKind.LOOKUP
    model, inst, eng = IDENT["model"], IDENT["instance"], IDENT["engine"]
    chains = CHAINS
    t0 = pc()
    for i, rid in idx:
        emit(E(kind=K, ts_ns=0, source_id=0, seq=0, request_id=rid, prompt_tokens=1024,
               group_block_keys=[chains[i & 31]], group_hit_tokens=[512], reported_hit_tokens=512,
               model=model, instance=inst, engine=eng))
    return pc() - t0


def no_gc(fn, *args) -> int:
    gc.disable()
    try:
        return fn(*args)
    finally:
        gc.enable()


def quantile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=200_000, help="calls timed per variant (default 200000)")
    ap.add_argument("--batch", type=int, default=1000, help="calls per timed batch (default 1000)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the per-round variant order")
    args = ap.parse_args()
    n = args.batch
    rounds = max(1, args.events // n)

    cfg = BatchConfig()  # the defaults: queue 65536, batches of 8192
    sink = MemorySink()
    em = BatchEmitter(sink, cfg, instance="bench-0", engine="vllm", register_atexit=False)
    abl_sink = MemorySink()
    abl = Ablation(abl_sink, cfg, register_atexit=False)
    abl._max_queue = cfg.max_queue_size
    abl._max_batch = cfg.max_export_batch_size

    # The same emitter with its worker parked (no wake-ups, no schedule): what emit() costs the
    # caller alone, without the GIL time the worker takes while the caller runs.
    park_cfg = BatchConfig(max_queue_size=10**9, max_export_batch_size=10**9, schedule_delay_millis=10**9)
    parked = BatchEmitter(MemorySink(), park_cfg, register_atexit=False)

    # A sink that stalls: the worker takes one batch and sleeps in export, the queue fills, and
    # every later emit takes the drop path (stamp, len check, lock, counter).
    stall_cfg = BatchConfig(max_queue_size=4096, max_export_batch_size=1024, shutdown_timeout_millis=100)
    stall_sink = MemorySink()
    stall_sink.delay_s = 3600.0
    stalled = Ablation(stall_sink, stall_cfg, register_atexit=False)
    stalled._drop_counter = itertools.count()
    for i in range(stall_cfg.max_export_batch_size):
        stalled.emit(commit_event(i))
    deadline = time.monotonic() + 5
    while stall_sink.calls == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    for i in range(stall_cfg.max_queue_size + 16):
        stalled.emit(commit_event(i))
    pre_dropped = stalled.stats().dropped_queue_full
    if not (stall_sink.calls == 1 and pre_dropped > 0):
        print("the stalled sink did not stall; cannot measure the drop path", file=sys.stderr)
        return 2

    # The journaled emitter, its worker shipping to a sink that takes the records as they are.
    journal_dir = tempfile.TemporaryDirectory(prefix="bench-emit-")
    jsink = CountingSink()
    jem = BatchEmitter(jsink, cfg, instance="bench-0", engine="vllm", register_atexit=False,
                       journal=JournalConfig(journal_dir.name, 64 << 20, shipper=None, ship_leftovers=False))
    # ... and with its worker parked (it ships between rounds, untimed): the caller's cost alone.
    pjem = BatchEmitter(CountingSink(), park_cfg, register_atexit=False,
                        journal=JournalConfig(journal_dir.name, 64 << 20, shipper=None, ship_leftovers=False))
    if jem._journal is None or pjem._journal is None:
        print("no journal could be made; cannot measure the journaled path", file=sys.stderr)
        return 2

    def worker_encoding(events: list[Event]) -> int:
        """What the in-memory path's worker pays later: one batch of the events encoded."""
        for i, e in enumerate(events):
            e.source_id, e.seq, e.ts_ns = 1, i, 1_700_000_000_000_000_000 + i
        batch = Batch(source_id=1, batch_seq=1, sent_ns=1, events=events)
        t0 = pc()
        encode_batch(batch)
        return pc() - t0

    noop = NoopEmitter()
    dq: collections.deque = collections.deque()
    rng = random.Random(args.seed)
    serial = itertools.count(1)

    def commits() -> list[Event]:
        return [commit_event(next(serial)) for _ in range(n)]

    def lookups() -> list[Event]:
        return [lookup_event(next(serial)) for _ in range(n)]

    def commit_idx() -> list[tuple[int, int, int]]:
        return [(_key(i), _key(i - 1), (i % CHAIN) * BLOCK) for i in (next(serial) for _ in range(n))]

    def lookup_idx() -> list[tuple[int, str]]:
        return [(i, f"req-{i}") for i in (next(serial) for _ in range(n))]

    same = [commit_event(j) for j in range(n)]  # the baselines do not look at their argument

    # name -> (group, prepare() -> arg [untimed], run(arg) -> ns)
    V: dict[str, tuple[str, Any, Any]] = {
        "empty loop (for x in items: pass)": ("baseline", lambda: same, time_empty),
        "bare call f(x)": ("baseline", lambda: same, lambda a: time_calls(bare, a)),
        "deque.append(x)": ("baseline", lambda: same, lambda a: time_calls(dq.append, a)),
        "NoopEmitter.emit(x)": ("baseline", lambda: same, lambda a: time_calls(noop.emit, a)),
        "emit COMMIT (pre-built)": ("emit", commits, lambda a: time_calls(em.emit, a)),
        "emit COMMIT (pre-built), worker parked": ("emit", commits, lambda a: time_calls(parked.emit, a)),
        "emit LOOKUP 64 keys (pre-built)": ("emit", lookups, lambda a: time_calls(em.emit, a)),
        "construct+emit COMMIT": ("emit", commit_idx, lambda a: time_construct_commit(em.emit, a)),
        "construct+emit LOOKUP 64 keys": ("emit", lookup_idx, lambda a: time_construct_lookup(em.emit, a)),
        "emit COMMIT, queue full (drop path)": ("emit", commits, lambda a: time_calls(stalled.emit, a)),
        "worker's encoding, per COMMIT (in-memory path)": ("journal", commits, worker_encoding),
        "worker's encoding, per LOOKUP (in-memory path)": ("journal", lookups, worker_encoding),
        "emit COMMIT (pre-built), journaled": ("journal", commits, lambda a: time_calls(jem.emit, a)),
        "emit COMMIT (pre-built), journaled, worker parked": (
            "journal", commits, lambda a: time_calls(pjem.emit, a)),
        "emit LOOKUP 64 keys (pre-built), journaled": ("journal", lookups, lambda a: time_calls(jem.emit, a)),
        "emit LOOKUP 64 keys (pre-built), journaled, worker parked": (
            "journal", lookups, lambda a: time_calls(pjem.emit, a)),
        "construct+emit COMMIT, journaled": ("journal", commit_idx, lambda a: time_construct_commit(jem.emit, a)),
        "construct+emit LOOKUP 64 keys, journaled": (
            "journal", lookup_idx, lambda a: time_construct_lookup(jem.emit, a)),
        "construct COMMIT, 14 kwargs": ("construct", commit_idx, lambda a: time_construct_commit(bare, a)),
        "construct COMMIT, envelope omitted (11 kwargs)": (
            "construct", commit_idx, lambda a: time_construct_commit_no_envelope(bare, a)),
        "construct COMMIT, 16 kwargs": ("construct", commit_idx, lambda a: time_construct_commit_16kw(bare, a)),
        "construct COMMIT, **dicts (demo.py style)": (
            "construct", commit_idx, lambda a: time_construct_commit_splat(bare, a)),
        "construct COMMIT, tuple fields [proposal]": (
            "construct", commit_idx, lambda a: time_construct_commit(bare, a, EventT)),
        "construct+emit COMMIT, gc off in batch": (
            "construct", commit_idx, lambda a: no_gc(time_construct_commit, em.emit, a)),
        "construct+emit COMMIT, tuple fields [proposal]": (
            "construct", commit_idx, lambda a: time_construct_commit(em.emit, a, EventT)),
        "ablation a0: isinstance(event, Event)": (
            "ablation", commits, lambda a: time_calls(abl.a0_isinstance, a)),
        "ablation a: + stamp source_id": ("ablation", commits, lambda a: time_calls(abl.a_stamp_source, a)),
        "ablation b: + seq = next(count)": ("ablation", commits, lambda a: time_calls(abl.b_plus_seq, a)),
        "ablation c: + ts_ns = time.time_ns()": ("ablation", commits, lambda a: time_calls(abl.c_plus_ts, a)),
        "ablation d: + deque.append": ("ablation", commits, lambda a: time_calls(abl.d_plus_append, a)),
        "ablation e: + len checks (= emit)": ("ablation", commits, lambda a: time_calls(abl.emit, a)),
        "emit, limits cached [proposal]": ("ablation", commits, lambda a: time_calls(abl.f_cached_limits, a)),
        "drop path, lock-free counter [proposal]": (
            "ablation", commits, lambda a: time_calls(stalled.g_drop_lockfree, a)),
    }
    names = list(V)
    per_call: dict[str, list[float]] = {k: [] for k in names}
    ratio: dict[str, list[float]] = {k: [] for k in names}

    for name in names:  # warm-up round, not recorded
        V[name][2](V[name][1]())

    t_start = time.monotonic()
    for _ in range(rounds):
        order = names[:]
        rng.shuffle(order)
        got = {}
        for name in order:
            _, prep, run = V[name]
            arg = prep()
            got[name] = run(arg)
            del arg
        for name in names:
            per_call[name].append(got[name] / n)
            ratio[name].append(got[name] / got["bare call f(x)"])
        # keep memory flat: drop what the sinks, the deque and the parked queue hold, untimed
        for s in (sink, abl_sink):
            with s._lock:
                s.batches.clear()
        dq.clear()
        parked._queue.clear()
        pjem.force_flush()
    elapsed = time.monotonic() - t_start

    em.force_flush()
    jem.force_flush()
    st = em.stats()
    jst = jem.stats()
    dropped_timed = stalled.stats().dropped_queue_full - pre_dropped
    lockfree_drops = int(repr(stalled._drop_counter)[6:-1])  # "count(N)" -> N
    expected_drops = (rounds + 1) * n  # + the warm-up batch

    print(f"bench_emit: {rounds} rounds x {n} calls per variant (+1 warm-up round), {elapsed:.1f} s; "
          f"Python {platform.python_version()}, msgspec {msgspec.__version__}, gc "
          f"{'on' if gc.isenabled() else 'off'}")
    print(f"emitter config: queue {cfg.max_queue_size}, batch {cfg.max_export_batch_size}; "
          f"stalled emitter: queue {stall_cfg.max_queue_size}")
    print()
    loop_med = statistics.median(per_call["empty loop (for x in items: pass)"])
    bare_net = statistics.median(per_call["bare call f(x)"]) - loop_med
    header = f"{'variant':47s} {'median ns':>10s} {'p99 ns':>9s} {'net ns':>8s} {'x bare':>7s} {'x bare net':>10s}"
    print(header)
    print("-" * len(header))
    group = None
    for name in names:
        g = V[name][0]
        if group is not None and g != group:
            print()
        group = g
        med = statistics.median(per_call[name])
        net = med - loop_med
        rnet = net / bare_net if bare_net > 0 else float("nan")
        print(f"{name:47s} {med:10.1f} {quantile(per_call[name], 0.99):9.1f} {net:8.1f} "
              f"{statistics.median(ratio[name]):7.2f} {rnet:10.2f}")
    print()
    print("median / p99: per-call time (batch time / batch size) over rounds, loop overhead included.")
    print("net ns: median minus the empty loop's median. x bare: median over rounds of the batch-time")
    print("ratio to the bare call of the same round (loop in both); x bare net: net ns / bare call net ns.")
    print()
    print(f"checks: emitter exported {st.exported}, dropped {st.dropped} (queue full {st.dropped_queue_full}, "
          f"invalid {st.dropped_invalid}); stalled emitter dropped "
          f"{dropped_timed} while timed (expected {expected_drops}: every call took the drop path), "
          f"lock-free variant counted {lockfree_drops}")
    print(f"journaled emitter: emitted {jst.emitted}, exported {jst.exported}, dropped {jst.dropped} "
          f"(journal full {jst.dropped_queue_full})")
    ok = (st.dropped == 0 and jst.dropped == 0 and pjem.stats().dropped == 0
          and dropped_timed == expected_drops == lockfree_drops)
    jem.shutdown()
    pjem.shutdown()
    journal_dir.cleanup()
    for e in (em, abl, parked):
        e.shutdown()
    stalled.shutdown()  # its worker sleeps in the stalled export; shutdown gives up after 100 ms
    if not ok:
        print("WARNING: drop accounting differs from what the benchmark assumed", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
