"""Analysing the last 10 % of a store from a snapshot, against a full run, in one process.

Workload: the fleet store of bench_shards.py (the Mooncake conversation trace dealt to
simulated instances; built here when missing, kept between runs). Measured, by the streaming
path:

  full         every lookup, reading every event (the streaming path without --since)
  refresh      the first 90 % with --until at the cut: what leaves the snapshot (a run that
               happens once; later ones start from the snapshot it left)
  incremental  the last 10 % (--since at the cut), from that snapshot

The ratio is incremental over full; the rows of the last 10 % are checked equal to the full
run's rows for the same lookups.

    .venv/bin/python benchmarks/bench_incremental.py [--events 1000000] [--instances 16] [--share 0.1]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from bench_shards import TRACE, fleet_store  # beside this script


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--instances", type=int, default=16)
    ap.add_argument("--recipe", default="mamba-hybrid")
    ap.add_argument("--share", type=float, default=0.1, help="the last share of the events analysed (default 0.1)")
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--home", type=Path, default=Path(tempfile.gettempdir()) / "kvtrace-bench-shards")
    args = ap.parse_args()
    os.environ["KVTRACE_HOME"] = str(args.home)
    import polars as pl
    from polars.testing import assert_frame_equal

    from kvtrace.analysis.incremental import range_results
    from kvtrace.analysis.run import stream_results
    from kvtrace.schema.recipes import BUILTIN

    store = fleet_store(args.home, args.recipe, args.instances, args.events, args.trace)
    store.command(f"TRUNCATE TABLE IF EXISTS {store.db}.snapshots")
    total = store.count_events()
    cut = int(store.scalar(f"SELECT quantileExact({1 - args.share})(ts_ns) FROM {store.db}.events"))
    lo, hi = (int(v) for v in store.query_arrow(f"SELECT min(ts_ns), max(ts_ns) + 1 FROM {store.db}.events")
              .to_pylist()[0].values())
    recipe = BUILTIN[args.recipe]
    print(f"table: {total:,} events; the last {args.share:.0%} starts at ts {cut}\n")

    started = time.perf_counter()
    full = stream_results(store, recipe)
    full_s = time.perf_counter() - started
    started = time.perf_counter()
    _, first = range_results(store, lo, cut, recipe, every_ns=0)
    refresh_s = time.perf_counter() - started
    size = int(store.scalar(f"SELECT max(length(state)) FROM {store.db}.snapshots"))
    objects = int(store.scalar(f"SELECT max(objects) FROM {store.db}.snapshots"))
    started = time.perf_counter()
    last, run = range_results(store, cut, hi, recipe, save=False)
    inc_s = time.perf_counter() - started
    assert run.started_at_ns > 0, run
    assert_frame_equal(last, full.filter(pl.col("ts_ns") >= cut).sort(["ts_ns", "source_id", "seq"]), check_exact=True)

    print(f"{'run':<12} {'seconds':>8} {'events read':>12} {'lookups':>8}")
    print(f"{'full':<12} {full_s:>8.1f} {total:>12,} {full.height:>8,}")
    print(f"{'refresh':<12} {refresh_s:>8.1f} {first.events_read:>12,} {first.lookups:>8,}")
    print(f"{'incremental':<12} {inc_s:>8.1f} {run.events_read:>12,} {run.lookups:>8,}")
    print(f"\nincremental / full: {inc_s / full_s:.3f}x time, {run.events_read / total:.3f}x events read; "
          f"snapshot {size / 2**20:.1f} MiB (base64) holding {objects:,} live objects; rows equal")


if __name__ == "__main__":
    main()
