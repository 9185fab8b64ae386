"""The three analysis paths on one long, real workload, each next to its floor in the same run.

Workload: the Mooncake conversation trace (../shared/traces, 512-token hash ids turned into
tokens) replayed through the reference simulator with a hybrid recipe and a small device /
host / disk hierarchy, through the real emitter into the embedded store, until the target
number of events (default 10,000,000); then exported once to Parquet. The store is kept
between runs (same trace, recipe and target: same events), so a rerun only measures.

Measured:
  streaming   Reconstructor over the Parquet file, batch by batch, in a child process, on 25 %,
              50 % and 100 % of the events: events/s of the reconstructor alone and with the
              Parquet-to-Event decoding, and the child's peak RSS. Memory bounded by live objects
              shows as a flat peak while the trace grows 4x. Each share runs three times: with the
              compiled cache state (analysis/_native.c) fed event by event, the same fed whole
              Arrow batches (`Reconstructor.feed_table`, what `kvtrace analyze` and the collector
              run: object rows never become events; its decoding is inside its feeding time),
              and the Python state (KVTRACE_NATIVE=0); their rows must be equal (a digest of every
              row), and the ratios of their times are printed.
  clickhouse  clickhouse_results() on the stored table, against a plain full scan of the same
              table (count, sum and distinct count over FINAL) timed alternately in this run.
  duckdb      duckdb_results() on the Parquet file, against the same full scan in DuckDB.

    .venv/bin/python benchmarks/bench_analysis.py [--events 10000000] [--recipe mamba-hybrid] [--rounds 2]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def generate(store, recipe_name: str, target: int, trace: Path) -> tuple[int, int, float]:  # type: ignore[no-untyped-def]
    from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
    from kvtrace.instrumentation.simulator import CacheSimulator, SimConfig, SimRequest
    from kvtrace.instrumentation.sinks.store import StoreSink
    from kvtrace.schema.recipes import BUILTIN

    config = SimConfig(
        recipe=BUILTIN[recipe_name],
        bytes_per_token=4096,
        capacity_bytes=(2 << 30, 8 << 30, 32 << 30),
        lease_ns=600 * 10**9,
    )
    emitter = BatchEmitter(
        StoreSink(store), BatchConfig(max_queue_size=1 << 20, shutdown_timeout_millis=600_000), register_atexit=False
    )
    sim = CacheSimulator(config, emitter)
    started, requests = time.perf_counter(), 0
    with trace.open() as f:
        for n, line in enumerate(f):
            row = json.loads(line)
            tokens = [h * 512 + j for h in row["hash_ids"] for j in range(512)][: row["input_length"]]
            sim.serve(SimRequest(f"q{n}", tokens, tenant="t0", arrival_ns=config.start_ns + row["timestamp"] * 10**6))
            requests += 1
            if sim.events >= target:
                break
            while emitter.stats().queue_depth > 1 << 18:  # let the store catch up: never drop
                time.sleep(0.05)
    emitter.force_flush(timeout_millis=600_000)
    emitter.shutdown()
    stats = emitter.stats()
    if stats.exported != sim.events:
        raise SystemExit(f"lost events while generating: {stats}")
    return requests, sim.events, time.perf_counter() - started


def _peak_rss_mb() -> float:
    """This process's own peak RSS. ru_maxrss is not used: Linux carries it over from the parent
    across fork and exec, so a child of a big parent would report the parent's peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def stream_child(parquet: str, fraction: float, recipe_name: str, tables: bool) -> None:
    """Runs in a fresh process so its peak RSS is the streaming path's alone."""
    from kvtrace.analysis.reconstruct import Reconstructor
    from kvtrace.schema.arrow import from_arrow
    from kvtrace.schema.recipes import BUILTIN

    file = pq.ParquetFile(parquet)
    limit = int(file.metadata.num_rows * fraction)
    rec = Reconstructor(BUILTIN[recipe_name])
    seen = results = max_objects = 0
    decode_s = feed_s = 0.0
    digest = hashlib.sha256()
    encode = msgspec.msgpack.Encoder().encode
    for batch in file.iter_batches(batch_size=65536):
        started = time.perf_counter()
        table = pa.Table.from_batches([batch]).slice(0, limit - seen)
        if tables:  # decoding only the rows that become events, inside feed_table
            fed = started
            done = rec.feed_table(table)
        else:
            events = from_arrow(table)
            fed = time.perf_counter()
            done = []
            for event in events:
                done += rec.feed(event)
        feed_s += time.perf_counter() - fed
        decode_s += fed - started
        results += len(done)
        digest.update(encode(done))
        seen += table.num_rows
        max_objects = max(max_objects, rec.state.object_count())
        if seen >= limit:
            break
    started = time.perf_counter()
    done = rec.finish()
    feed_s += time.perf_counter() - started
    results += len(done)
    digest.update(encode(done))
    rss_mb = _peak_rss_mb()
    print(json.dumps(dict(events=seen, lookups=results, decode_s=decode_s, feed_s=feed_s, peak_rss_mb=rss_mb,
                          max_objects=max_objects, state=type(rec.state).__name__, digest=digest.hexdigest())))


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=10_000_000)
    ap.add_argument("--recipe", default="mamba-hybrid")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--home", type=Path, default=Path(tempfile.gettempdir()) / "kvtrace-bench-analysis")
    ap.add_argument("--only", choices=["stream", "sql"], help="run one part only")
    ap.add_argument("--stream-child", nargs=4, metavar=("PARQUET", "FRACTION", "RECIPE", "MODE"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stream_child:
        stream_child(args.stream_child[0], float(args.stream_child[1]), args.stream_child[2],
                     args.stream_child[3] == "tables")
        return

    os.environ["KVTRACE_HOME"] = str(args.home)
    from kvtrace.schema.recipes import BUILTIN
    from kvtrace.store.client import Store
    from kvtrace.store.export import export_events

    tag = f"{args.recipe.replace('-', '_')}_{args.events}"
    store = Store(f"chdb://{args.home / 'chdb'}?database=bench_{tag}")
    store.init()
    parquet = args.home / f"{tag}.parquet"
    print(f"python {platform.python_version()}, {os.cpu_count()} cpus, recipe {args.recipe}, "
          f"target {args.events:,} events")
    if store.count_events() < args.events or not parquet.exists():
        store.command(f"TRUNCATE TABLE {store.db}.events")
        requests, events, seconds = generate(store, args.recipe, args.events, args.trace)
        print(f"generated {events:,} events from {requests:,} trace requests in {seconds:.0f} s "
              f"({events / seconds:,.0f} events/s through simulator, emitter and store)")
        store.command(f"OPTIMIZE TABLE {store.db}.events FINAL")
        export_events(store, parquet)
    total = store.count_events()
    lookups = int(store.scalar(f"SELECT count() FROM {store.db}.events WHERE kind = 'lookup'"))
    print(f"table: {total:,} events, {lookups:,} lookups; parquet {parquet.stat().st_size / 2**20:.0f} MiB\n")

    if args.only != "sql":
        stream(parquet, args.recipe)
    if args.only != "stream":
        sql(store, parquet, BUILTIN[args.recipe], args.rounds)


def stream(parquet: Path, recipe_name: str) -> None:
    print("streaming reconstructor (child process per run): the compiled state fed events, the same fed")
    print("Arrow batches (its decoding inside its feeding), and the Python state fed events")
    print(f"{'share':>6} {'state':>8} {'events':>12} {'reconstruct ev/s':>17} {'with decode ev/s':>17}"
          f" {'peak RSS MiB':>13} {'live objects (max)':>19}")
    for fraction in (0.25, 0.5, 1.0):
        runs = {}
        for state in ("compiled", "tables", "python"):
            out = subprocess.run(
                [sys.executable, __file__, "--stream-child", str(parquet), str(fraction), recipe_name,
                 "tables" if state == "tables" else "events"],
                check=True, capture_output=True, text=True,
                env={**os.environ, "KVTRACE_NATIVE": "0" if state == "python" else "1"},
            )
            r = runs[state] = json.loads(out.stdout)
            assert r["state"] == ("CacheState" if state == "python" else "NativeState"), r["state"]
            both = r["feed_s"] + r["decode_s"]
            print(f"{fraction:>6.0%} {state:>8} {r['events']:>12,} {r['events'] / r['feed_s']:>17,.0f}"
                  f" {r['events'] / both:>17,.0f} {r['peak_rss_mb']:>13,.0f} {r['max_objects']:>19,}")
        same = runs["compiled"]["digest"] == runs["python"]["digest"] == runs["tables"]["digest"]
        total = {k: r["feed_s"] + r["decode_s"] for k, r in runs.items()}
        print(f"{'':>6} compiled / python feeding time: {runs['compiled']['feed_s'] / runs['python']['feed_s']:.3f}x;"
              f" with decoding: tables / compiled events {total['tables'] / total['compiled']:.3f}x, tables / python"
              f" {total['tables'] / total['python']:.3f}x; rows {'equal' if same else 'DIFFER'}")
        assert same, "the three runs' rows differ"


def sql(store, parquet: Path, recipe, rounds: int) -> None:  # type: ignore[no-untyped-def]
    import duckdb

    from kvtrace.analysis.sql import StatementTiming, clickhouse_results, duckdb_results, placed_events

    scan_ch = (f"SELECT count(), sum(nbytes), uniqExact(block_key), max(length(group_block_keys)) "
               f"FROM {store.db}.events FINAL")
    scan_dd = (f"SELECT count(*), sum(nbytes), count(DISTINCT block_key), max(len(group_block_keys)) "
               f"FROM read_parquet('{parquet}')")
    # Each path's rounds alternate its scan and its analysis; the ClickHouse rounds come first.
    # A DuckDB run leaves this process slower for the ClickHouse run after it, even with its
    # connection closed (4.76-4.86 s against 4.45-4.66 s alone, 10M events, 2026-12-05), and one
    # kept open holds its buffers (~10 GB here): 1.6x slower. Each DuckDB round gets a
    # connection of its own, closed after it.
    # The table is merged (one part per day, as `main` leaves it), so ClickHouse numbers the
    # events where they lie; each round also runs the sorted numbering that a table with fresh,
    # unmerged parts takes (`in_place=False`), and its rows must be the same.
    ch, ch_sorted, ch_scan, dd, dd_scan = [], [], [], [], []
    placed = placed_events(store).layout.merged
    for _ in range(rounds):
        ch_scan.append(timed(lambda: store.query_arrow(scan_ch)))
        ch.append(timed(lambda: clickhouse_results(store, recipe)))
        ch_sorted.append(timed(lambda: clickhouse_results(store, recipe, in_place=False)))
    key = ["ts_ns", "source_id", "seq"]
    placed_rows, sorted_rows = (clickhouse_results(store, recipe, in_place=flag).sort(key) for flag in (True, False))
    assert placed_rows.equals(sorted_rows), "numbered in place and sorted, the ClickHouse rows differ"
    for _ in range(rounds):
        with duckdb.connect() as con:
            dd_scan.append(timed(lambda: con.execute(scan_dd).fetchall()))
            dd.append(timed(lambda: duckdb_results(parquet, recipe, connection=con)))
    print(f"\nSQL paths, median of {rounds} rounds (each path's rounds: scan, analysis, alternating)")
    print(f"{'path':<11} {'analysis s':>11} {'full scan s':>12} {'ratio':>7}")
    for name, a, s in (("clickhouse", ch, ch_scan), ("ch sorted", ch_sorted, ch_scan), ("duckdb", dd, dd_scan)):
        ma, ms = statistics.median(a), statistics.median(s)
        print(f"{name:<11} {ma:>11.2f} {ms:>12.2f} {ma / ms:>6.1f}x")
    print(f"clickhouse: events numbered {'in place (every day one merged part)' if placed else 'by sorting'};"
          " ch sorted: numbered by sorting, as on unmerged parts; rows equal")

    # One more run of each with per-statement timings (each step then also counts its rows,
    # which the timed rounds above do not), to say where the time goes.
    ch_steps: list[StatementTiming] = []
    dd_steps: list[StatementTiming] = []
    clickhouse_results(store, recipe, timings=ch_steps)
    duckdb_results(parquet, recipe, timings=dd_steps)
    for name, steps, scan in (("clickhouse", ch_steps, statistics.median(ch_scan)),
                              ("duckdb", dd_steps, statistics.median(dd_scan))):
        total = sum(s.seconds for s in steps)
        print(f"\n{name}: per statement (one profiled run, {total:.2f} s; full scan {scan:.2f} s)")
        print(f"{'statement':<18} {'s':>8} {'share':>6} {'x scan':>7} {'rows':>13}")
        for s in steps:
            print(f"{s.name:<18} {s.seconds:>8.2f} {s.seconds / total:>6.0%} {s.seconds / scan:>7.1f} {s.rows:>13,}")


if __name__ == "__main__":
    main()
