"""The fleet simulator's ground truth: several reference engines behind a router, on one clock.

What it knows per request (seen anywhere, recoverable anywhere and on the chosen instance,
adopted) comes from the simulators' own blocks; the per-instance analysis of the events must
agree with it on the chosen instance, and prefix-aware routing must lose fewer recoverable
tokens to the routing decision than round robin on a real trace.
"""

from __future__ import annotations

import random
from pathlib import Path

import polars as pl
import pytest

from kvtrace.analysis.costs import fit_prefill, fit_transfers, routing_regret_seconds
from kvtrace.analysis.evaluate import Policy
from kvtrace.analysis.funnel import results_frame
from kvtrace.analysis.reconstruct import reconstruct
from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.fleet import FleetSimulator, RoutePolicy
from kvtrace.instrumentation.replay import tokens_of
from kvtrace.instrumentation.simulator import SimConfig, SimRequest
from kvtrace.instrumentation.sinks.memory import MemorySink
from kvtrace.instrumentation.traces import read_trace
from kvtrace.schema.arrow import to_arrow
from kvtrace.schema.kinds import Tier
from kvtrace.schema.recipes import BUILTIN
from kvtrace.schema.verdicts import GapReason

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
RECIPE = BUILTIN["dense"]
CONFIG = SimConfig(recipe=RECIPE, instance="fleet", bytes_per_token=1024,
                   capacity_bytes=(64 << 20, 128 << 20, 0), fetch_tiers=(Tier.HOST,))


def _requests(n: int, trace: str = "mooncake_conversation_trace.jsonl") -> list[SimRequest]:
    return [SimRequest(r.request_id, tokens_of(r), tenant="default")
            for r in read_trace(TRACES / trace, limit=n)]


def _run(policy: RoutePolicy, requests: list[SimRequest], instances: int = 3, config: SimConfig = CONFIG):
    sinks = [MemorySink() for _ in range(instances)]
    emitters = [BatchEmitter(s, BatchConfig(schedule_delay_millis=10, max_queue_size=1 << 20), register_atexit=False)
                for s in sinks]
    fleet = FleetSimulator(config, emitters, policy, seed=7)
    truths = fleet.serve_all(requests)
    for emitter, sim in zip(emitters, fleet.sims, strict=True):
        assert emitter.shutdown()
        assert emitter.stats().emitted == sim.events and not emitter.stats().dropped
    return fleet, truths, sorted((e for s in sinks for e in s.events), key=lambda e: (e.ts_ns, e.source_id, e.seq))


@pytest.mark.parametrize("policy", list(RoutePolicy))
def test_each_request_s_truth_is_consistent_and_the_analysis_finds_it_on_the_chosen_instance(policy):
    fleet, truths, events = _run(policy, _requests(80))
    by_id = {t.request_id: t for t in truths}
    for t in truths:
        assert t.prompt_tokens >= t.seen_anywhere >= t.recoverable_anywhere >= t.recoverable_here >= 0
        assert (t.best_instance == "") == (t.recoverable_anywhere == 0)
        assert t.adopted == t.recoverable_here  # the reference engine adopts exactly what is complete
    rows = reconstruct(events, RECIPE)
    assert len(rows) == len(truths)
    for row in rows:
        t = by_id[row.request_id]
        assert row.instance == t.instance
        assert row.recoverable_hit_tokens == t.recoverable_here, row
        assert row.adopted_tokens == t.adopted
    # Several instances were used, and some requests could have reused more elsewhere.
    assert len({t.instance for t in truths}) > 1


def test_prefix_aware_routing_loses_fewer_tokens_to_routing_than_round_robin():
    requests = _requests(200, "mooncake_synthetic_trace.jsonl")  # its requests share prefixes across sessions
    regret = {}
    for policy in (RoutePolicy.ROUND_ROBIN, RoutePolicy.PREFIX_AWARE):
        _, truths, _ = _run(policy, requests, instances=4)
        regret[policy] = sum(t.regret for t in truths)
        assert sum(t.prompt_tokens for t in truths) == sum(len(r.tokens) for r in requests)
    assert regret[RoutePolicy.ROUND_ROBIN] > 0
    assert regret[RoutePolicy.PREFIX_AWARE] < regret[RoutePolicy.ROUND_ROBIN] / 2  # 19,456 vs 59,568 tokens


@pytest.mark.parametrize(("policy", "recipe"), [
    *((p, "dense") for p in RoutePolicy),
    (RoutePolicy.RANDOM, "mamba-hybrid"),  # a hit needs one checkpoint, not the whole prefix
    (RoutePolicy.LEAST_LOADED, "sliding-window-hybrid"),  # hits elsewhere that the window lost there
])
def test_the_analysis_fleet_view_equals_the_fleet_s_truth_for_every_request(policy, recipe):
    """Seen anywhere, recoverable anywhere, the best instance and the regret, from the events of
    all instances: each equals what the simulators' own blocks said at the lookup."""
    config = SimConfig(recipe=BUILTIN[recipe], instance="fleet", bytes_per_token=1024,
                       capacity_bytes=(48 << 20, 96 << 20, 0), fetch_tiers=(Tier.HOST,))
    _, truths, events = _run(policy, _requests(120, "mooncake_synthetic_trace.jsonl"), instances=4, config=config)
    rows = reconstruct(events, BUILTIN[recipe], Policy(fleet=True))
    by_id = {t.request_id: t for t in truths}
    assert len(rows) == len(truths)
    for row in rows:
        t = by_id[row.request_id]
        got = (row.seen_anywhere_tokens, row.recoverable_anywhere_tokens, row.best_instance,
               row.recoverable_hit_tokens, row.routing_regret_tokens, row.adopted_tokens)
        assert got == (t.seen_anywhere, t.recoverable_anywhere, t.best_instance, t.recoverable_here, t.regret,
                       t.adopted), row
        assert (row.fleet_reason == "") == (t.seen_anywhere == t.recoverable_anywhere)
    # Other instances held more than the chosen one by hash for some requests; where what they
    # held was not recoverable there either, the row says why.
    assert any(r.seen_anywhere_tokens > r.logical_hit_tokens for r in rows)
    if recipe == "sliding-window-hybrid":
        assert {r.fleet_reason for r in rows} > {GapReason.NONE}
    elif policy is not RoutePolicy.PREFIX_AWARE:
        assert sum(r.routing_regret_tokens for r in rows) > 0
    # Without the fleet view each instance is its own fleet.
    alone = reconstruct(events, BUILTIN[recipe])
    assert all(r.seen_anywhere_tokens == r.logical_hit_tokens and r.routing_regret_tokens == 0 for r in alone)


def test_routing_regret_in_seconds_equals_the_fleet_s_own_costs():
    """Cost models fitted from the fleet's timed loads and adopts price each regretted request:
    serving it where it was sent and on the best instance, as the simulators' own cost
    parameters say it would have cost there at that moment (one fetch tier, so the best
    instance's restore is priced on its own path; no transfer latency, so one transfer per tier
    costs what the engine's runs cost)."""
    rng = random.Random(7)  # documents read again and again, each time with a question of its own
    docs = [[d * 100_000 + i for i in range(rng.choice([256, 512, 1024, 2048]))] for d in range(24)]
    requests = []
    for i in range(160):
        doc = rng.choice(docs)
        requests.append(SimRequest(f"r{i}", doc[: rng.randint(len(doc) // 2, len(doc))] + [i] * rng.randint(1, 200)))
    config = SimConfig(recipe=RECIPE, instance="fleet", model="m", bytes_per_token=1024,
                       capacity_bytes=(8 << 20, 512 << 20, 0), fetch_tiers=(Tier.HOST,),
                       load_bytes_per_s=(5e9, 1e9), prefill_ns_per_token=40e3, prefill_ns_per_token_pair=4.0)
    _, truths, events = _run(RoutePolicy.ROUND_ROBIN, requests, instances=4, config=config)
    frame = pl.from_arrow(to_arrow(events))
    transfers, prefills = fit_transfers(frame), fit_prefill(frame)
    assert [(t.src, t.dst) for t in transfers] == [(Tier.HOST, Tier.DEVICE)]
    regret = routing_regret_seconds(results_frame(reconstruct(events, RECIPE, Policy(fleet=True))), transfers,
                                    prefills)
    by_id = {t.request_id: t for t in truths}
    regretted = [t for t in truths if t.regret]
    assert regret.height == len(regretted) > 10 and regret["regret_s"].null_count() == 0
    for row in regret.iter_rows(named=True):
        t = by_id[row["request_id"]]
        assert row["here_s"] == pytest.approx(t.here_ns / 1e9, rel=1e-3, abs=2e-6), row
        assert row["best_s"] == pytest.approx(t.best_ns / 1e9, rel=1e-3, abs=2e-6), row
        assert row["regret_s"] == pytest.approx(max(t.here_ns - t.best_ns, 0) / 1e9, rel=1e-3, abs=4e-6)
    # Some of the regret was priced through a restore on the best instance, and it still paid.
    assert regret.filter(~pl.col("best_exact") & (pl.col("regret_s") > 0)).height
    assert regret["regret_s"].sum() > 0
