"""The ClickHouse analysis on 1, 2 and 4 shards of one fleet's events: does the work split?

Workload: the Mooncake conversation trace (../shared/traces) served by a fleet of simulated
instances (`--instances`, one emitter each, requests dealt round robin), through the real
emitter into the embedded store, until `--events`. The store is kept between runs (same
trace, fleet and target: same events), so a rerun only measures.

Shards are databases of the one embedded engine, filled by the cluster's own routing rule
(`cityHash64(instance) % N`, see kvtrace.store.shards); each runs the SQL a cluster node runs
on its own rows. They run one after another here (this machine has one engine), so a cluster's
wall time is its slowest shard: the table gives each N's slowest shard, its speed-up over one
shard, the speed-up the split allows (all events over the largest shard's), and the seconds per
million events of every shard, which stay flat when the work splits
linearly (the shards are as even as the instances' hashes make them: see each shard's events).
The rows of every N, in every round, are checked equal to one store's. Each shard's time is
the fastest of `--rounds` runs, the one-shard baseline's too: on this shared machine one
shard's time moved by up to 0.9 s between two runs of the same code. The source store and
every shard are merged (each day one part, as a settled store is), so each numbers its events
where they lie (`analysis.sql.placed_events`).

    .venv/bin/python benchmarks/bench_shards.py [--events 1000000] [--instances 16] [--shards 1,2,4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def generate(store, recipe_name: str, instances: int, target: int, trace: Path) -> tuple[int, int, float]:  # type: ignore[no-untyped-def]
    from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
    from kvtrace.instrumentation.simulator import CacheSimulator, SimConfig, SimRequest
    from kvtrace.instrumentation.sinks.store import StoreSink
    from kvtrace.schema.recipes import BUILTIN

    fleet = []
    for i in range(instances):
        config = SimConfig(recipe=BUILTIN[recipe_name], instance=f"sim-{i}", bytes_per_token=4096,
                           capacity_bytes=(1 << 30, 4 << 30, 16 << 30), lease_ns=600 * 10**9)
        emitter = BatchEmitter(StoreSink(store), BatchConfig(max_queue_size=1 << 20, shutdown_timeout_millis=600_000),
                               register_atexit=False)
        fleet.append((CacheSimulator(config, emitter), emitter))
    started, requests = time.perf_counter(), 0
    with trace.open() as f:
        for n, line in enumerate(f):
            row = json.loads(line)
            tokens = [h * 512 + j for h in row["hash_ids"] for j in range(512)][: row["input_length"]]
            sim, emitter = fleet[n % instances]
            sim.serve(SimRequest(f"q{n}", tokens, tenant="t0",
                                 arrival_ns=sim.config.start_ns + row["timestamp"] * 10**6))
            requests += 1
            if sum(s.events for s, _ in fleet) >= target:
                break
            while emitter.stats().queue_depth > 1 << 17:  # let the store catch up: never drop
                time.sleep(0.05)
    events = 0
    for sim, emitter in fleet:
        emitter.force_flush(timeout_millis=600_000)
        emitter.shutdown()
        if emitter.stats().exported != sim.events:
            raise SystemExit(f"lost events while generating {sim.config.instance}: {emitter.stats()}")
        events += sim.events
    return requests, events, time.perf_counter() - started


def fleet_store(home: Path, recipe: str, instances: int, target: int, trace: Path):  # type: ignore[no-untyped-def]
    """The fleet's store under `home`, generated when it holds fewer than `target` events (kept
    between runs: same trace, fleet and target, same events)."""
    from kvtrace.store.client import Store

    tag = f"{recipe.replace('-', '_')}_{instances}_{target}"
    store = Store(f"chdb://{home / 'chdb'}?database=fleet_{tag}")
    store.init()
    print(f"python {platform.python_version()}, {os.cpu_count()} cpus, recipe {recipe}, "
          f"{instances} instances, target {target:,} events")
    if store.count_events() < target:
        store.command(f"TRUNCATE TABLE {store.db}.events")
        requests, events, seconds = generate(store, recipe, instances, target, trace)
        print(f"generated {events:,} events from {requests:,} trace requests in {seconds:.0f} s")
        store.command(f"OPTIMIZE TABLE {store.db}.events FINAL")
    return store


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--instances", type=int, default=16)
    ap.add_argument("--recipe", default="mamba-hybrid")
    ap.add_argument("--shards", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each shard count; a shard's time is its fastest")
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--home", type=Path, default=Path(tempfile.gettempdir()) / "kvtrace-bench-shards")
    args = ap.parse_args()
    os.environ["KVTRACE_HOME"] = str(args.home)
    from polars.testing import assert_frame_equal

    from kvtrace.analysis.shards import ShardRun, sharded_results
    from kvtrace.analysis.sql import placed_events
    from kvtrace.schema.recipes import BUILTIN
    from kvtrace.store.client import Store
    from kvtrace.store.shards import route_to_shards

    counts = [int(n) for n in args.shards.split(",")]
    tag = f"{args.recipe.replace('-', '_')}_{args.instances}_{args.events}"
    dsn = f"chdb://{args.home / 'chdb'}?database="
    store = fleet_store(args.home, args.recipe, args.instances, args.events, args.trace)
    total = store.count_events()
    print(f"table: {total:,} events\n")

    recipe = BUILTIN[args.recipe]
    reference = None
    one_shard = 0.0
    print(f"{'shards':>6} {'slowest s':>10} {'speed-up':>9} {'bound':>7} {'sum s':>7}"
          "  per shard: events, s, s per M events")
    for n in counts:
        shards = [Store(dsn + f"shard_{tag}_n{n}_{k}") for k in range(n)]
        for s in shards:
            s.init()
        if sum(s.count_events() for s in shards) != total:  # kept between runs, like the source
            for s in shards:
                s.command(f"TRUNCATE TABLE {s.db}.events")
            route_to_shards(store, shards)
        for s in shards:  # settled, as the source store: each day one merged part (numbered in place)
            if not placed_events(s).layout.merged:
                s.command(f"OPTIMIZE TABLE {s.db}.events FINAL")
        best: list[float] = []
        for _ in range(args.rounds):
            runs: list[ShardRun] = []
            frame = sharded_results(shards, recipe, runs=runs)
            if reference is None:
                reference = frame
            else:
                assert_frame_equal(frame, reference, check_exact=True)
            best = [min(b, r.seconds) for b, r in zip(best, runs, strict=True)] if best else [r.seconds for r in runs]
        slowest = max(best)
        one_shard = one_shard or slowest
        per = [(s.count_events(), sec) for s, sec in zip(shards, best, strict=True)]
        detail = "; ".join(f"{e:,}, {sec:.1f}, {sec / max(e, 1) * 1e6:.1f}" for e, sec in per)
        bound = total / max(e for e, _ in per)  # the speed-up if time went as events do
        print(f"{n:>6} {slowest:>10.2f} {one_shard / slowest:>8.2f}x {bound:>6.2f}x {sum(best):>7.1f}  {detail}")
    print(f"\nrows equal across shard counts: {reference.height if reference is not None else 0:,} lookups")


if __name__ == "__main__":
    main()
