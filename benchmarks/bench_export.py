"""Sustained export throughput into the embedded store, against ClickHouse's own insert rate.

N events (a realistic mix, see `workload`) go through BatchEmitter(StoreSink(store)) as fast as
the caller can emit them; the time is from the first emit() to the completion of
force_flush(), and what arrived is checked with store.count_events() and the emitter's stats.
Two emitter configurations are run:

  big queue     max_queue_size >= the round's events: nothing can be dropped, the caller never
                waits; measures how fast the worker drains into the store.
  back-pressure the default BatchConfig (queue 65536); the caller sleeps while the queue is
                nearly full (checked every 1024 emits through stats()), as a replay would.

A third path is a proposal, not shipped code: the big-queue run through a StoreSink that writes
the emitter_stats row at most every 10 s instead of with every batch.

Baselines, in the same process and on the same chDB engine (one engine directory per process):
the same rows, converted once with schema.arrow.to_arrow and inserted with
store.insert_arrow('events', ...) in the chunk size the emitter exports (max_export_batch_size)
into a second fresh database; plus the cost split: to_arrow alone, and the one-row
emitter_stats insert StoreSink adds to every batch. The work is split into rounds and the paths
alternate within each round, so drift on a shared machine lands on all of them.

    .venv/bin/python benchmarks/bench_export.py [--events 1000000] [--rounds 8]
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from importlib import metadata

import msgspec

from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.sinks.base import ExportResult
from kvtrace.instrumentation.sinks.store import StoreSink
from kvtrace.schema.arrow import to_arrow
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import ComponentKind, EventKind, Reason, Tier
from kvtrace.schema.wire import Batch
from kvtrace.store.client import Store

BLOCK = 16
CHAIN = 64
NEW_BLOCKS = 16
IDENT = {"model": "meta-llama/Llama-3.1-8B-Instruct", "instance": "bench-0", "engine": "vllm", "block_size": BLOCK}


def _key(i: int) -> int:
    return (i * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF or 1


def workload(n: int) -> list[Event]:
    """Per request: a LOOKUP with a 64-block chain, CREATE + COMMIT of 16 new blocks, 16 EVICTs
    and an ADOPT (50 events); repeated until n. ts_ns/source_id/seq are left for the emitter."""
    out: list[Event] = []
    r = 0
    while len(out) < n:
        chain = [_key(r * 1000 + j) for j in range(CHAIN)]
        hit = CHAIN - NEW_BLOCKS
        rid = f"req-{r}"
        out.append(Event(kind=EventKind.LOOKUP, ts_ns=0, source_id=0, seq=0, request_id=rid,
                         prompt_tokens=CHAIN * BLOCK, group_block_keys=[chain],
                         group_hit_tokens=[hit * BLOCK], reported_hit_tokens=hit * BLOCK, **IDENT))
        for j in range(hit, CHAIN):
            common = dict(component=ComponentKind.FULL_ATTENTION, block_key=chain[j], parent_key=chain[j - 1],
                          token_start=j * BLOCK, token_end=(j + 1) * BLOCK, tier=Tier.DEVICE,
                          nbytes=BLOCK * 131072)
            out.append(Event(kind=EventKind.CREATE, ts_ns=0, source_id=0, seq=0, **common, **IDENT))
            out.append(Event(kind=EventKind.COMMIT, ts_ns=0, source_id=0, seq=0, **common, **IDENT))
        for j in range(NEW_BLOCKS):
            out.append(Event(kind=EventKind.EVICT, ts_ns=0, source_id=0, seq=0, block_key=_key(-(r * 1000 + j)),
                             component=ComponentKind.FULL_ATTENTION, tier=Tier.DEVICE,
                             reason=Reason.CAPACITY, **IDENT))
        out.append(Event(kind=EventKind.ADOPT, ts_ns=0, source_id=0, seq=0, request_id=rid,
                         reused_tiers=[Tier.DEVICE], reused_tokens=[hit * BLOCK],
                         recomputed_tokens=NEW_BLOCKS * BLOCK, **IDENT))
        r += 1
    return out[:n]


class ThrottledStatsSink(StoreSink):
    """[proposal, not shipped] StoreSink writing the stats row at most every `period_s` (and
    for stats-only batches, e.g. the final one at shutdown) instead of with every batch."""

    def __init__(self, store: Store, period_s: float = 10.0) -> None:
        super().__init__(store)
        self.period_s = period_s
        self._last = float("-inf")

    def export(self, batch: Batch) -> ExportResult:
        now = time.monotonic()
        if batch.events and batch.stats is not None and now - self._last < self.period_s:
            batch = msgspec.structs.replace(batch, stats=None)
        elif batch.stats is not None:
            self._last = now
        return super().export(batch)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def emit_all(em: BatchEmitter, events: list[Event]) -> tuple[float, float]:
    """Big queue: emit everything, then flush. Returns (emit loop s, first emit -> flushed s)."""
    emit = em.emit
    t0 = time.perf_counter()
    for ev in events:
        emit(ev)
    t1 = time.perf_counter()
    if not em.force_flush(timeout_millis=3_600_000):
        raise RuntimeError("force_flush timed out")
    return t1 - t0, time.perf_counter() - t0


def emit_backpressure(em: BatchEmitter, events: list[Event], cap: int) -> tuple[float, int]:
    """Default queue: every 1024 emits, wait while the queue is within 4096 of full."""
    emit = em.emit
    high, low = cap - 4096, cap // 2
    waits = 0
    t0 = time.perf_counter()
    for i, ev in enumerate(events):
        if not i & 1023 and em.stats().queue_depth > high:
            while em.stats().queue_depth > low:
                waits += 1
                time.sleep(0.001)
        emit(ev)
    if not em.force_flush(timeout_millis=3_600_000):
        raise RuntimeError("force_flush timed out")
    return time.perf_counter() - t0, waits


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=1_000_000, help="events per path (default 1000000)")
    ap.add_argument("--rounds", type=int, default=8, help="rounds the events are split into (default 8)")
    ap.add_argument("--chunk", type=int, default=BatchConfig().max_export_batch_size,
                    help="export batch size for the emitter and the raw inserts (default: BatchConfig's)")
    args = ap.parse_args()
    n, rounds, chunk = args.events, max(1, args.rounds), args.chunk
    per_round = -(-n // rounds)

    tmp = tempfile.mkdtemp(prefix="kvtrace-bench-export-")
    stores: list[Store] = []
    try:
        def open_store(db: str) -> Store:
            s = Store(f"chdb://{tmp}?database={db}")
            s.init()
            stores.append(s)
            return s

        s_big, s_bp, s_raw = open_store("bench_bigq"), open_store("bench_bp"), open_store("bench_raw")
        s_thr = open_store("bench_throttled")
        rss_start = peak_rss_mib()
        t = time.perf_counter()
        events = workload(n)
        build_s = time.perf_counter() - t
        rss_built = peak_rss_mib()
        chunks = [events[i:i + per_round] for i in range(0, n, per_round)]

        big_cfg = BatchConfig(max_queue_size=max(per_round + 1, chunk), max_export_batch_size=chunk)
        bp_cfg = BatchConfig(max_export_batch_size=chunk)
        em_big = BatchEmitter(StoreSink(s_big), big_cfg, instance="bench-0", engine="vllm", register_atexit=False)
        em_bp = BatchEmitter(StoreSink(s_bp), bp_cfg, instance="bench-0", engine="vllm", register_atexit=False)
        em_thr = BatchEmitter(ThrottledStatsSink(s_thr), big_cfg, instance="bench-0", engine="vllm",
                              register_atexit=False)

        tot = dict.fromkeys(("big", "big_emit", "bp", "thr", "to_arrow", "raw", "stats"), 0.0)
        ratios_big, ratios_bp, ratios_thr = [], [], []
        stats_calls = 0
        bp_waits = 0
        # each path emits one round's events and notes its time in that round's `rt`
        def run_big(evs: list[Event], rt: dict[str, float]) -> None:
            emit_s, total_s = emit_all(em_big, evs)
            tot["big_emit"] += emit_s
            tot["big"] += total_s
            rt["big"] = total_s

        def run_bp(evs: list[Event], rt: dict[str, float]) -> None:
            nonlocal bp_waits
            total_s, waits = emit_backpressure(em_bp, evs, bp_cfg.max_queue_size)
            tot["bp"] += total_s
            bp_waits += waits
            rt["bp"] = total_s

        def run_thr(evs: list[Event], rt: dict[str, float]) -> None:
            _, total_s = emit_all(em_thr, evs)
            tot["thr"] += total_s
            rt["thr"] = total_s

        for r, evs in enumerate(chunks):
            rt: dict[str, float] = {}
            paths = [run_big, run_bp, run_thr]
            for i, path in enumerate(paths[r % 3:] + paths[:r % 3]):  # rotate the order per round
                if i:
                    for ev in evs:  # the first path stamped them; a shim hands over ts_ns=0
                        ev.ts_ns = 0
                path(evs, rt)

            # raw baseline on the same (now stamped) rows, in the emitter's chunk size
            t = time.perf_counter()
            tables = [to_arrow(evs[i:i + chunk]) for i in range(0, len(evs), chunk)]
            tot["to_arrow"] += time.perf_counter() - t
            t = time.perf_counter()
            for table in tables:
                s_raw.insert_arrow("events", table)
            raw_s = time.perf_counter() - t
            tot["raw"] += raw_s
            # the per-batch stats row StoreSink also writes (into the raw database's own table)
            t = time.perf_counter()
            for _ in tables:
                s_raw.insert_stats([em_big.stats()])
            tot["stats"] += time.perf_counter() - t
            stats_calls += len(tables)
            del tables
            ratios_big.append((len(evs) / rt["big"]) / (len(evs) / raw_s))
            ratios_bp.append((len(evs) / rt["bp"]) / (len(evs) / raw_s))
            ratios_thr.append((len(evs) / rt["thr"]) / (len(evs) / raw_s))
            print(f"  round {r + 1}/{len(chunks)}: {len(evs)} events; big queue {len(evs) / rt['big']:,.0f}/s, "
                  f"back-pressure {len(evs) / rt['bp']:,.0f}/s, throttled stats {len(evs) / rt['thr']:,.0f}/s, "
                  f"raw insert {len(evs) / raw_s:,.0f}/s",
                  file=sys.stderr)

        em_big.shutdown()
        em_bp.shutdown()
        em_thr.shutdown()
        st_big, st_bp, st_thr = em_big.stats(), em_bp.stats(), em_thr.stats()
        counts = {"big": s_big.count_events(), "bp": s_bp.count_events(), "thr": s_thr.count_events(),
                  "raw": s_raw.count_events()}
        rss_end = peak_rss_mib()

        def rate(seconds: float) -> float:
            return n / seconds

        raw_rate = rate(tot["raw"])
        serial = tot["to_arrow"] + tot["raw"] + tot["stats"]
        batches = -(-n // chunk)
        versions = {p: metadata.version(p) for p in ("chdb", "clickhouse-connect", "pyarrow", "msgspec")}
        print(f"bench_export: {n:,} events in {len(chunks)} rounds, export chunk {chunk}; "
              f"Python {platform.python_version()}; "
              + ", ".join(f"{k} {v}" for k, v in versions.items())
              + f"; ClickHouse {s_raw.client.server_version}")
        print(f"workload: {n // 50:,} requests x (1 LOOKUP with {CHAIN} keys + {NEW_BLOCKS} CREATE + "
              f"{NEW_BLOCKS} COMMIT + {NEW_BLOCKS} EVICT + 1 ADOPT); built in {build_s:.1f} s "
              f"({n / build_s:,.0f} events/s, not timed below)")
        print()
        header = f"{'path':58s} {'seconds':>8s} {'events/s':>11s} {'x raw':>6s}"
        print(header)
        print("-" * len(header))
        rows = [
            ("raw: store.insert_arrow, pre-built Arrow chunks", tot["raw"]),
            ("to_arrow alone (same chunks)", tot["to_arrow"]),
            (f"stats-row inserts alone ({stats_calls}, 1 per batch)", tot["stats"]),
            ("sum: to_arrow + insert + stats insert (serial estimate)", serial),
            ("emitter, big queue: first emit -> flushed", tot["big"]),
            ("  of which the caller's emit loop", tot["big_emit"]),
            ("emitter, default queue + back-pressure", tot["bp"]),
            ("emitter, big queue, stats row every 10 s [proposal]", tot["thr"]),
        ]
        for name, secs in rows:
            print(f"{name:58s} {secs:8.2f} {rate(secs):11,.0f} {rate(secs) / raw_rate:6.2f}")
        print()
        print("events/s of a component row (to_arrow, stats inserts) = N / its seconds, as if it were")
        print("the only cost; x raw = events/s / the raw insert's events/s.")
        print(f"emitter/raw, per round (big queue): median {statistics.median(ratios_big):.2f}, "
              f"range {min(ratios_big):.2f}-{max(ratios_big):.2f}")
        print(f"emitter/raw, per round (back-pressure): median {statistics.median(ratios_bp):.2f}, "
              f"range {min(ratios_bp):.2f}-{max(ratios_bp):.2f}")
        print(f"emitter/raw, per round (stats every 10 s [proposal]): median {statistics.median(ratios_thr):.2f}, "
              f"range {min(ratios_thr):.2f}-{max(ratios_thr):.2f}")
        print(f"cost split of the serial estimate: to_arrow {tot['to_arrow'] / serial:.0%}, "
              f"insert_arrow {tot['raw'] / serial:.0%}, stats insert {tot['stats'] / serial:.0%} "
              f"({tot['stats'] / stats_calls * 1e3:.2f} ms per batch of {chunk})")
        print()
        for name, st, cnt in (("big queue", st_big, counts["big"]), ("back-pressure", st_bp, counts["bp"]),
                              ("stats / 10 s", st_thr, counts["thr"])):
            print(f"{name:14s}: emitted {st.emitted:,}, exported {st.exported:,}, dropped {st.dropped:,} "
                  f"(queue full {st.dropped_queue_full:,}), batches {st.batches:,} (>= {batches:,} expected), "
                  f"export errors {st.export_errors}; store count {cnt:,}")
        print(f"raw           : store count {counts['raw']:,}; back-pressure waits (1 ms sleeps): {bp_waits:,}")
        print(f"peak RSS: {rss_end:,.0f} MiB at the end; {rss_built:,.0f} MiB after building the events, "
              f"{rss_start:,.0f} MiB before")
        ok = (counts["big"] == counts["bp"] == counts["thr"] == counts["raw"] == n
              and st_big.dropped == st_bp.dropped == st_thr.dropped == 0)
        if not ok:
            print("WARNING: not every event arrived exactly once", file=sys.stderr)
        return 0 if ok else 1
    finally:
        for s in stores:
            s.close()
        for _ in range(20):  # background merges may still be renaming parts: retry
            shutil.rmtree(tmp, ignore_errors=True)
            if not os.path.exists(tmp):
                break
            time.sleep(0.25)
        else:
            print(f"could not remove {tmp}", file=sys.stderr)

if __name__ == "__main__":
    sys.exit(main())
