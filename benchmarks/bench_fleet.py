"""What the fleet view costs the streaming reconstructor, on one fleet's events, in one run.

    .venv/bin/python benchmarks/bench_fleet.py [--events 1000000] [--instances 8] [--route round_robin]
                                               [--recipe mamba-hybrid] [--rounds 3] [--sql [--statements]]

A Mooncake trace (default the synthetic one, whose requests share long prefixes across
sessions: the fleet view's worst case, as most lookups find other instances holding some of
their prefix) is served by `FleetSimulator` (N reference engines behind a router) into an
embedded store until the target number of events, then exported once to Parquet in stream
order. Each round feeds the same events to a `Reconstructor` without and with
`Policy(fleet=True)`, alternating, and times the feeding alone (the Parquet decoding is not
timed). Printed: seconds per variant (median of the rounds), the ratio
with / without, the instances judged per lookup and the rows' fleet totals. The fleet rows are
checked against the simulators' truth for every lookup, so the figure is for correct answers.
With `--sql`, the ClickHouse path (on the store) and the DuckDB path (on the Parquet file) are
timed without and with the fleet view the same way, their rows checked equal to the streaming
rows; `--statements` then times each of their statements once without and with it.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kvtrace.analysis.evaluate import Policy
from kvtrace.analysis.reconstruct import Reconstructor
from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.fleet import FleetSimulator, RoutePolicy
from kvtrace.instrumentation.replay import tokens_of
from kvtrace.instrumentation.simulator import SimConfig, SimRequest
from kvtrace.instrumentation.traces import read_trace
from kvtrace.schema.arrow import from_arrow
from kvtrace.schema.kinds import Tier
from kvtrace.schema.recipes import BUILTIN

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"


def generate(args: argparse.Namespace, folder: Path):  # type: ignore[no-untyped-def]
    """Serve the trace on the fleet into an embedded store until the target, then export the
    events in stream order to Parquet (the feeding reads it batch by batch: memory stays that of
    the reconstructor, not of the events)."""
    import uuid

    from kvtrace.instrumentation.sinks.store import StoreSink
    from kvtrace.store.client import Store
    from kvtrace.store.export import export_events

    config = SimConfig(recipe=BUILTIN[args.recipe], instance="fleet", bytes_per_token=1024,
                       capacity_bytes=(256 << 20, 1 << 30, 0), fetch_tiers=(Tier.HOST,))
    store = Store(f"chdb://{folder / 'db'}?database=f_{uuid.uuid4().hex[:8]}")
    store.init()
    emitters = [BatchEmitter(StoreSink(store), BatchConfig(max_queue_size=1 << 20, shutdown_timeout_millis=600_000),
                             register_atexit=False) for _ in range(args.instances)]
    fleet = FleetSimulator(config, emitters, RoutePolicy(args.route), seed=7)
    truths = []
    for n, r in enumerate(read_trace(args.trace)):
        truths.append(fleet.serve(SimRequest(r.request_id, tokens_of(r), tenant="default",
                                             arrival_ns=config.start_ns + n * 10**6))[0])
        if fleet.events >= args.events:
            break
        while sum(e.stats().queue_depth for e in emitters) > 1 << 19:  # let the store catch up: never drop
            time.sleep(0.05)
    for emitter in emitters:
        emitter.force_flush(timeout_millis=600_000)
        emitter.shutdown()
        assert not emitter.stats().dropped, emitter.stats()
    parquet = folder / "events.parquet"
    export_events(store, parquet)
    return config.recipe, truths, store, parquet


def feed(recipe, parquet: Path, policy: Policy):  # type: ignore[no-untyped-def]
    """Seconds of feeding alone (the Parquet decoding is not timed), and the rows."""
    gc.collect()
    rec = Reconstructor(recipe, policy)
    rows, seconds = [], 0.0
    for batch in pq.ParquetFile(parquet).iter_batches(batch_size=65536):
        events = from_arrow(pa.Table.from_batches([batch]))
        started = time.perf_counter()
        for event in events:
            rows.extend(rec.feed(event))
        seconds += time.perf_counter() - started
    started = time.perf_counter()
    rows.extend(rec.finish())
    return seconds + time.perf_counter() - started, rows


def sql_paths(store, parquet: Path, recipe, expected, rounds: int,  # type: ignore[no-untyped-def]
              statements: bool = False) -> None:
    from kvtrace.analysis.funnel import results_frame
    from kvtrace.analysis.sql import clickhouse_results, conform_results, duckdb_results

    key = ["ts_ns", "source_id", "seq"]
    want = conform_results(results_frame(expected)).sort(key)
    paths = {"clickhouse": lambda p, timings=None: clickhouse_results(store, recipe, p, timings=timings),
             "duckdb": lambda p, timings=None: duckdb_results(parquet, recipe, p, timings=timings)}
    for name, run in paths.items():
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(rounds):
            for fleet in (False, True):
                started = time.perf_counter()
                got = run(Policy(fleet=fleet))
                times[fleet].append(time.perf_counter() - started)
                if fleet:
                    assert got.sort(key).equals(want), f"{name}: rows differ from the streaming path's"
        off, on = statistics.median(times[False]), statistics.median(times[True])
        print(f"{name}: without {off:.2f} s, with {on:.2f} s: {on / off:.3f}x (rounds "
              + ", ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(times[False], times[True], strict=True)) + ")")
        if statements:
            statement_times(name, run)


def statement_times(name: str, run) -> None:  # type: ignore[no-untyped-def]
    """One more run of the path without and with the fleet view, each statement timed: where
    the fleet view's extra time goes. (Each step then also counts its rows, so these runs are
    slower than the timed rounds.)"""
    from kvtrace.analysis.sql import StatementTiming

    steps: dict[bool, dict[str, float]] = {}
    for fleet in (False, True):
        timed: list[StatementTiming] = []
        run(Policy(fleet=fleet), timed)
        steps[fleet] = {}
        for step in timed:
            steps[fleet][step.name] = steps[fleet].get(step.name, 0.0) + step.seconds
    print(f"{name}, per statement (s): without, with, difference")
    for step in dict.fromkeys([*steps[False], *steps[True]]):
        off, on = steps[False].get(step, 0.0), steps[True].get(step, 0.0)
        print(f"  {step:<24} {off:7.3f} {on:7.3f} {on - off:+7.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--route", choices=[p.value for p in RoutePolicy], default="round_robin")
    ap.add_argument("--recipe", choices=sorted(BUILTIN), default="mamba-hybrid")
    ap.add_argument("--trace", type=Path, default=TRACES / "mooncake_synthetic_trace.jsonl")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sql", action="store_true", help="also time the ClickHouse and DuckDB paths")
    ap.add_argument("--statements", action="store_true",
                    help="with --sql: then time each path's statements once without and with the fleet view")
    args = ap.parse_args()
    started = time.perf_counter()
    folder = Path(tempfile.mkdtemp(prefix="kvtrace-bench-fleet-"))
    recipe, truths, store, parquet = generate(args, folder)
    n = pq.ParquetFile(parquet).metadata.num_rows
    print(f"{n:,} events of {len(truths)} requests ({args.trace.name}), {args.instances} instances, "
          f"route {args.route}, recipe {args.recipe}; generated in {time.perf_counter() - started:.0f} s")
    times: dict[bool, list[float]] = {False: [], True: []}
    rows = {}
    for _ in range(args.rounds):
        for fleet in (False, True):
            seconds, rows[fleet] = feed(recipe, parquet, Policy(fleet=fleet))
            times[fleet].append(seconds)
    by_id = {t.request_id: t for t in truths}
    for row in rows[True]:
        t = by_id[row.request_id]
        got = (row.seen_anywhere_tokens, row.recoverable_anywhere_tokens, row.routing_regret_tokens)
        assert got == (t.seen_anywhere, t.recoverable_anywhere, t.regret), (row, t)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"without the fleet view: {off:.2f} s ({n / off / 1e3:.0f}k events/s); rounds "
          + ", ".join(f"{s:.2f}" for s in times[False]))
    print(f"with the fleet view:    {on:.2f} s ({n / on / 1e3:.0f}k events/s); rounds "
          + ", ".join(f"{s:.2f}" for s in times[True]))
    print(f"ratio with / without: {on / off:.3f}x")
    if args.sql:
        sql_paths(store, parquet, recipe, rows[True], args.rounds, args.statements)
    shutil.rmtree(folder, ignore_errors=True)
    fleet_rows = rows[True]
    beyond = sum(r.seen_anywhere_tokens > r.logical_hit_tokens for r in fleet_rows)
    print(f"lookups {len(fleet_rows)}: seen elsewhere beyond here {beyond}, "
          f"with routing regret {sum(r.routing_regret_tokens > 0 for r in fleet_rows)} "
          f"({sum(r.routing_regret_tokens for r in fleet_rows):,} tokens); every row equals the fleet's truth")


if __name__ == "__main__":
    main()
