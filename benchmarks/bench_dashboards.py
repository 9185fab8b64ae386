"""Dashboard pages on a store of ten million events: each panel's query against a plain scan of
the same table, timed alternately in one run.

Uses bench_analysis's store (the Mooncake conversation trace replayed through the hybrid
simulator; run that benchmark first, or this one generates it the same way). The verdicts
table is filled once from the events (as `kvtrace analyze --write-verdicts` does), then for
each panel: the median of several runs over the whole time range with no filters, and with an
instance filter, next to `SELECT count(), sum(nbytes) FROM events FINAL`.

    .venv/bin/python benchmarks/bench_dashboards.py [--events 10000000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=10_000_000)
    ap.add_argument("--recipe", default="mamba-hybrid")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--home", type=Path, default=Path(tempfile.gettempdir()) / "kvtrace-bench-analysis")
    args = ap.parse_args()
    os.environ["KVTRACE_HOME"] = str(args.home)
    from kvtrace.analysis.sql import clickhouse_results
    from kvtrace.dashboards.queries import PANELS, render
    from kvtrace.schema.arrow import conform
    from kvtrace.schema.recipes import BUILTIN
    from kvtrace.schema.verdicts import LookupResult
    from kvtrace.store.client import Store

    tag = f"{args.recipe.replace('-', '_')}_{args.events}"
    store = Store(f"chdb://{args.home / 'chdb'}?database=bench_{tag}")
    store.init()
    if store.count_events() < args.events:
        sys.path.insert(0, str(Path(__file__).parent))
        from bench_analysis import TRACE, generate

        generate(store, args.recipe, args.events, TRACE)
    total = store.count_events()
    if not store.scalar(f"SELECT count() FROM {store.db}.verdicts"):
        t = time.perf_counter()
        frame = clickhouse_results(store, BUILTIN[args.recipe])
        store.insert_arrow("verdicts", conform(frame.to_arrow(), LookupResult))
        print(f"verdicts computed in the store: {frame.height:,} lookups in {time.perf_counter() - t:.1f} s")
    lookups = int(store.scalar(f"SELECT count() FROM {store.db}.verdicts FINAL"))
    row = store.query_arrow(f"SELECT min(ts_ns) AS lo, max(ts_ns) AS hi, any(instance) AS inst "
                            f"FROM {store.db}.events").to_pylist()[0]
    lo, hi, instance = row["lo"] // 10**9, row["hi"] // 10**9 + 1, row["inst"]
    interval = max(1, (hi - lo) // 120)
    print(f"store: {total:,} events, {lookups:,} verdicts, {hi - lo:,} s of trace; {os.cpu_count()} cpus")

    def timed(sql: str) -> float:
        t = time.perf_counter()
        store.query_arrow(sql)
        return time.perf_counter() - t

    scan = f"SELECT count(), sum(nbytes) FROM {store.db}.events FINAL"
    print(f"\n{'panel':12} {'filter':10} {'median s':>9} {'scan s':>8} {'x scan':>7}")
    for panel in PANELS:
        for label, variables in (("none", {}), ("instance", {"instance": instance})):
            sql = render(panel, store.db, lo, hi, interval, variables)
            timed(sql)  # warm caches as a page reload would
            ours, floor = [], []
            for _ in range(args.rounds):
                ours.append(timed(sql))
                floor.append(timed(scan))
            m, f = statistics.median(ours), statistics.median(floor)
            print(f"{panel.key:12} {label:10} {m:9.3f} {f:8.3f} {m / f:7.2f}")


if __name__ == "__main__":
    main()
