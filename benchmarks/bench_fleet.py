"""What the fleet view costs the streaming reconstructor, on one fleet's events, in one run.

    .venv/bin/python benchmarks/bench_fleet.py [--events 1000000] [--instances 8] [--route round_robin]
                                               [--recipe mamba-hybrid] [--rounds 3]

A Mooncake trace (default the synthetic one, whose requests share long prefixes across
sessions: the fleet view's worst case, as most lookups find other instances holding some of
their prefix) is served by `FleetSimulator` (N reference engines behind a router) into memory
until the target number of events, then sorted into stream order once. Each round feeds the
same events to a `Reconstructor` without and with `Policy(fleet=True)`, alternating, and times
the feeding alone (no decoding). Printed: seconds per variant (median of the rounds), the ratio
with / without, the instances judged per lookup and the rows' fleet totals. The fleet rows are
checked against the simulators' truth for every lookup, so the figure is for correct answers.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

from kvtrace.analysis.evaluate import Policy
from kvtrace.analysis.reconstruct import Reconstructor
from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.fleet import FleetSimulator, RoutePolicy
from kvtrace.instrumentation.replay import tokens_of
from kvtrace.instrumentation.simulator import SimConfig, SimRequest
from kvtrace.instrumentation.sinks.memory import MemorySink
from kvtrace.instrumentation.traces import read_trace
from kvtrace.schema.kinds import Tier
from kvtrace.schema.recipes import BUILTIN

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"


def generate(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    config = SimConfig(recipe=BUILTIN[args.recipe], instance="fleet", bytes_per_token=1024,
                       capacity_bytes=(256 << 20, 1 << 30, 0), fetch_tiers=(Tier.HOST,))
    sinks = [MemorySink() for _ in range(args.instances)]
    emitters = [BatchEmitter(s, BatchConfig(max_queue_size=1 << 22), register_atexit=False) for s in sinks]
    fleet = FleetSimulator(config, emitters, RoutePolicy(args.route), seed=7)
    truths = []
    for n, r in enumerate(read_trace(args.trace)):
        truths.append(fleet.serve(SimRequest(r.request_id, tokens_of(r), tenant="default",
                                             arrival_ns=config.start_ns + n * 10**6))[0])
        if fleet.events >= args.events:
            break
    for emitter in emitters:
        emitter.shutdown()
        assert not emitter.stats().dropped, emitter.stats()
    events = sorted((e for s in sinks for e in s.events), key=lambda e: (e.ts_ns, e.source_id, e.seq))
    return config.recipe, truths, events


def feed(recipe, events, policy: Policy):  # type: ignore[no-untyped-def]
    gc.collect()
    rec = Reconstructor(recipe, policy)
    started = time.perf_counter()
    rows = list(rec.run(events))
    return time.perf_counter() - started, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--route", choices=[p.value for p in RoutePolicy], default="round_robin")
    ap.add_argument("--recipe", choices=sorted(BUILTIN), default="mamba-hybrid")
    ap.add_argument("--trace", type=Path, default=TRACES / "mooncake_synthetic_trace.jsonl")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    started = time.perf_counter()
    recipe, truths, events = generate(args)
    print(f"{len(events):,} events of {len(truths)} requests ({args.trace.name}), {args.instances} instances, "
          f"route {args.route}, recipe {args.recipe}; generated in {time.perf_counter() - started:.0f} s")
    times: dict[bool, list[float]] = {False: [], True: []}
    rows = {}
    for _ in range(args.rounds):
        for fleet in (False, True):
            seconds, rows[fleet] = feed(recipe, events, Policy(fleet=fleet))
            times[fleet].append(seconds)
    by_id = {t.request_id: t for t in truths}
    for row in rows[True]:
        t = by_id[row.request_id]
        got = (row.seen_anywhere_tokens, row.recoverable_anywhere_tokens, row.routing_regret_tokens)
        assert got == (t.seen_anywhere, t.recoverable_anywhere, t.regret), (row, t)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    n = len(events)
    print(f"without the fleet view: {off:.2f} s ({n / off / 1e3:.0f}k events/s); rounds "
          + ", ".join(f"{s:.2f}" for s in times[False]))
    print(f"with the fleet view:    {on:.2f} s ({n / on / 1e3:.0f}k events/s); rounds "
          + ", ".join(f"{s:.2f}" for s in times[True]))
    print(f"ratio with / without: {on / off:.3f}x")
    fleet_rows = rows[True]
    beyond = sum(r.seen_anywhere_tokens > r.logical_hit_tokens for r in fleet_rows)
    print(f"lookups {len(fleet_rows)}: seen elsewhere beyond here {beyond}, "
          f"with routing regret {sum(r.routing_regret_tokens > 0 for r in fleet_rows)} "
          f"({sum(r.routing_regret_tokens for r in fleet_rows):,} tokens); every row equals the fleet's truth")


if __name__ == "__main__":
    main()
