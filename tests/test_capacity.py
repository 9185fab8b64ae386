"""Capacity curves from stack distances match replays of the same requests at each capacity."""

from __future__ import annotations

import random

import pytest

from kvtrace.analysis.capacity import capacity_curve, capacity_needed, request_distances
from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.simulator import CacheSimulator, SimConfig, SimRequest
from kvtrace.instrumentation.sinks.memory import MemorySink
from kvtrace.schema.recipes import BUILTIN

BLOCK_BYTES = 16 * 2048


def requests(n: int = 300, seed: int = 3) -> list[SimRequest]:
    rng = random.Random(seed)
    docs = [[d * 100_000 + i for i in range(rng.choice([128, 256, 512, 1024]))] for d in range(25)]
    out = []
    for i in range(n):
        doc = docs[min(int(rng.expovariate(0.15)), len(docs) - 1)]  # a few hot documents, a long tail
        out.append(SimRequest(f"r{i}", doc[: rng.randint(len(doc) // 2, len(doc))] + [i] * rng.randint(1, 200)))
    return out


def replay(recipe_name: str, reqs: list[SimRequest], capacity_blocks: int | None,
           free_outside_window: bool = False) -> tuple[list, list[int]]:
    """Serve the requests with an LRU device cache of that many blocks (None: unlimited) and no
    lower tiers; returns the events and the tokens each request reused."""
    cap = (1 << 50) if capacity_blocks is None else capacity_blocks * BLOCK_BYTES
    config = SimConfig(recipe=BUILTIN[recipe_name], model="m", bytes_per_token=2048, capacity_bytes=(cap, 0, 0),
                       free_outside_window=free_outside_window)
    sink = MemorySink()
    emitter = BatchEmitter(sink, BatchConfig(max_queue_size=1 << 21, max_export_batch_size=1 << 14),
                           register_atexit=False)
    sim = CacheSimulator(config, emitter)
    adopted = [sim.serve(r).adopted_tokens for r in reqs]
    assert emitter.shutdown()
    return sink.events, adopted


@pytest.fixture(scope="module")
def dense() -> tuple[list[SimRequest], list]:
    reqs = requests()
    events, _ = replay("dense", reqs, None)
    return reqs, request_distances(events, BUILTIN["dense"], free_outside_window=False)


@pytest.mark.parametrize("capacity", [64, 200, 500, 1500])
def test_dense_curve_matches_lru_replays_request_by_request(dense, capacity: int) -> None:
    reqs, distances = dense
    _, adopted = replay("dense", reqs, capacity)
    predicted = [d.hit_tokens([capacity]) for d in distances]
    assert predicted == adopted
    curve = capacity_curve(distances, BUILTIN["dense"], [capacity])
    assert curve["hit_tokens"].to_list() == [sum(adopted)]


def test_curve_rises_with_capacity_to_the_unlimited_hit(dense) -> None:
    reqs, distances = dense
    curve = capacity_curve(distances, BUILTIN["dense"], [0, 16, 64, 256, 1024, 4096, 1 << 20])
    hits = curve["hit_tokens"].to_list()
    assert hits[0] == 0 and hits == sorted(hits)
    _, unlimited = replay("dense", reqs, None)
    assert hits[-1] == sum(unlimited) > 0


def test_capacity_needed_keeps_99_percent_of_requests_at_99_percent_of_their_prefix(dense) -> None:
    reqs, distances = dense
    (need,) = capacity_needed(distances, BUILTIN["dense"])
    assert need.blocks > 0
    _, at_need = replay("dense", reqs, need.blocks)
    _, unlimited = replay("dense", reqs, None)
    kept = [a >= 0.99 * u for a, u in zip(at_need, unlimited, strict=True)]
    assert sum(kept) >= 0.99 * len(kept)
    _, below = replay("dense", reqs, max(need.blocks - 1, 0))  # and it is the least that does
    kept_below = [a >= 0.99 * u for a, u in zip(below, unlimited, strict=True)]
    assert sum(kept_below) < 0.99 * len(kept_below)


def test_hybrid_groups_are_sized_separately() -> None:
    reqs = requests(120, seed=9)
    recipe = BUILTIN["sliding-window-hybrid"]
    events, _ = replay("sliding-window-hybrid", reqs, None, free_outside_window=True)
    distances = request_distances(events, recipe)
    needs = {n.component: n.blocks for n in capacity_needed(distances, recipe)}
    assert set(needs) == {g.component.value for g in recipe.groups}
    # the window keeps only its last W tokens per request: it needs far fewer blocks
    assert needs["sliding_window"] < needs["full_attention"]


def test_reuse_intervals_measure_commit_to_hit() -> None:
    from kvtrace.analysis.capacity import reuse_intervals, reuse_summary

    reqs = [SimRequest("a", list(range(64)) + [1]), SimRequest("b", list(range(64)) + [2]),
            SimRequest("c", list(range(64)) + [3])]
    events, adopted = replay("dense", reqs, None)
    intervals = reuse_intervals(events, BUILTIN["dense"])
    # b and c each hit the 4 blocks a committed
    assert intervals.height == 8 and (intervals["interval_ns"] > 0).all()
    summary = reuse_summary(intervals)
    assert summary["reuses"].to_list() == [8] and summary["p50_s"][0] > 0
    assert adopted == [0, 64, 64]
