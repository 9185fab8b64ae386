"""What routing costs in recoverable tokens: the reference fleet under each routing policy.

    .venv/bin/python benchmarks/bench_routing.py [--requests 200] [--instances 4] [--recipe dense]

The Mooncake synthetic trace (tokens synthesized from its hash ids; its requests share long
prefixes across sessions) is served by
`FleetSimulator`: N reference engines of one model behind a router, on one clock. For each
policy the table gives, summed over the requests, from the simulators' own ground truth: prompt
tokens, the longest hash hit anywhere (seen anywhere), recoverable anywhere, recoverable on the
chosen instance, adopted, and the routing regret (recoverable anywhere minus here), with its
ratio to round robin's. Events go to a sink that counts and drops them.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from counting_sink import CountingSink  # beside this script

from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.fleet import FleetSimulator, RoutePolicy
from kvtrace.instrumentation.replay import tokens_of
from kvtrace.instrumentation.simulator import SimConfig, SimRequest
from kvtrace.instrumentation.traces import read_trace
from kvtrace.schema.kinds import Tier
from kvtrace.schema.recipes import BUILTIN

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--recipe", choices=sorted(BUILTIN), default="dense")
    ap.add_argument("--trace", type=Path, default=TRACE)
    args = ap.parse_args()
    requests = [SimRequest(r.request_id, tokens_of(r), tenant="default")
                for r in read_trace(args.trace, limit=args.requests)]
    config = SimConfig(recipe=BUILTIN[args.recipe], instance="fleet", bytes_per_token=1024,
                       capacity_bytes=(64 << 20, 128 << 20, 0), fetch_tiers=(Tier.HOST,))
    print(f"{len(requests)} requests of {args.trace.name}, {args.instances} instances, recipe {args.recipe}, "
          f"device {config.capacity_bytes[0] >> 20} MiB and host {config.capacity_bytes[1] >> 20} MiB each")
    print(f"{'policy':<13} {'prompt':>10} {'seen':>9} {'anywhere':>9} {'here':>9} {'adopted':>9} {'regret':>8} "
          f"{'x round robin':>13} {'seconds':>8}")
    regrets: dict[RoutePolicy, int] = {}
    for policy in (RoutePolicy.ROUND_ROBIN, RoutePolicy.RANDOM, RoutePolicy.LEAST_LOADED, RoutePolicy.PREFIX_AWARE):
        emitters = [BatchEmitter(CountingSink(), BatchConfig(max_queue_size=1 << 20), register_atexit=False)
                    for _ in range(args.instances)]
        started = time.perf_counter()
        truths = FleetSimulator(config, emitters, policy, seed=7).serve_all(requests)
        seconds = time.perf_counter() - started
        for emitter in emitters:
            emitter.shutdown()
        regrets[policy] = regret = sum(t.regret for t in truths)
        base = regrets[RoutePolicy.ROUND_ROBIN]
        sums = [sum(t.prompt_tokens for t in truths), sum(t.seen_anywhere for t in truths),
                sum(t.recoverable_anywhere for t in truths), sum(t.recoverable_here for t in truths),
                sum(t.adopted for t in truths)]
        print(f"{policy.value:<13} {sums[0]:>10,} {sums[1]:>9,} {sums[2]:>9,} {sums[3]:>9,} {sums[4]:>9,} {regret:>8,} "
              f"{regret / base if base else 0:>13.3f} {seconds:>8.1f}")


if __name__ == "__main__":
    main()
