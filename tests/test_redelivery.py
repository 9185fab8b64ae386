"""Delivery is at least once: a batch whose answer was lost comes again (the emitter's retry, its
journal's shipper after a kill). The store keeps one copy of each event; the live verdicts must
be those of one copy too."""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lifecycle import lifecycle_streams
from polars.testing import assert_frame_equal
from test_paths_agree import BOOK, SORT, streaming

from kvtrace.analysis.evaluate import Policy
from kvtrace.analysis.sql import conform_results
from kvtrace.collector import redelivery
from kvtrace.collector.live import LiveReconstruction
from kvtrace.collector.metrics import CollectorMetrics
from kvtrace.collector.redelivery import Delivered, redelivered
from kvtrace.schema import Event
from kvtrace.schema.kinds import ComponentKind, EventKind, Tier
from kvtrace.schema.recipes import load_recipe
from kvtrace.store.client import Store


@st.composite
def deliveries(draw: st.DrawFn) -> list[list[tuple[int, int]]]:
    """Batches of (source, seq) as a collector receives them: a source's numbers dense but for
    holes (events dropped before they were sent), in batches that may arrive in any order (a
    client sending one source's batches concurrently) and rows out of order within a batch (an
    emitter's threads queue in either order), some sent again, whole or from a point on."""
    numbered = {s: iter(range(draw(st.integers(0, 5)), 10**6)) for s in range(draw(st.integers(1, 4)))}
    made: list[list[tuple[int, int]]] = []
    for _ in range(draw(st.integers(1, 10))):
        batch = []
        for _ in range(draw(st.integers(1, 8))):
            source = draw(st.sampled_from(sorted(numbered)))
            for _ in range(draw(st.integers(0, 2))):  # a hole
                next(numbered[source])
            batch.append((source, next(numbered[source])))
        made.append(draw(st.permutations(batch)) if draw(st.booleans()) else batch)
    sent: list[list[tuple[int, int]]] = []
    for batch in draw(st.permutations(made)) if draw(st.booleans()) else made:
        sent.append(batch)
        if draw(st.booleans()):
            again = draw(st.sampled_from(sent))
            sent.append(again[draw(st.integers(0, len(again) - 1)):])
    return sent


def _found(sent: list[list[tuple[int, int]]]) -> list[list[bool]]:
    delivered: dict[int, Delivered] = {}
    return [_mask(redelivered(np.array([s for s, _ in batch], dtype=np.uint64),
                              np.array([q for _, q in batch], dtype=np.uint64), delivered), len(batch))
            for batch in sent]


@given(sent=deliveries())
def test_exactly_the_copies_are_found(sent: list[list[tuple[int, int]]]) -> None:
    seen: set[tuple[int, int]] = set()
    want = []
    for batch in sent:
        mask = []
        for row in batch:
            mask.append(row in seen)
            seen.add(row)
        want.append(mask)
    assert _found(sent) == want


def test_holes_that_never_fill_are_forgotten_oldest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """A source that drops every other event keeps a range per hole, up to the bound; past it
    the oldest holes count as delivered."""
    monkeypatch.setattr(redelivery, "MAX_RANGES", 2)
    d = Delivered()
    assert d.take(np.array([0, 2, 4, 6], dtype=np.uint64)) is None
    assert (d.starts.tolist(), d.ends.tolist()) == ([0, 6], [5, 7])
    assert _mask(d.take(np.array([1, 5, 7], dtype=np.uint64)), 3) == [True, False, False]
    assert (d.starts.tolist(), d.ends.tolist()) == ([0], [8])


def _mask(mask: np.ndarray | None, n: int) -> list[bool]:
    return mask.tolist() if mask is not None else [False] * n


def _live(store: Store, batches: list[list[Event]], policy: Policy) -> tuple[pl.DataFrame, int]:
    store.command(f"TRUNCATE TABLE {store.db}.verdicts")
    live = LiveReconstruction(store, BOOK, CollectorMetrics(), policy, lateness_ns=0)
    try:
        for batch in batches:
            live.feed(batch)
        live.tick(force=True)
    finally:
        live.close()
    rows = conform_results(store.query_polars(f"SELECT * FROM {store.db}.verdicts FINAL")).sort(SORT)
    return rows, live.redelivered_events


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(events=lifecycle_streams(), cuts=st.lists(st.floats(0, 1), min_size=1, max_size=4),
       again=st.lists(st.tuples(st.sampled_from([1, 2]), st.integers(1, 6)), min_size=4, max_size=4),
       fleet=st.booleans())
def test_batches_sent_again_change_no_verdict(store: Store, events: list[Event], cuts: list[float],
                                              again: list[tuple[int, int]], fleet: bool) -> None:
    """Each batch after the first comes after a copy of one source's last rows, sent again
    after they were judged (and after the other source's rows that followed them): the
    verdicts are the stream's own."""
    for source in {e.source_id for e in events}:  # the premise: a source's events arrive numbered in order
        seqs = [e.seq for e in events if e.source_id == source]
        assert seqs == sorted(seqs)
    bounds = sorted({int(c * len(events)) for c in cuts} | {0, len(events)})
    batches, copies = [], 0
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        source, k = again[i % len(again)]
        sent = [e for e in events[:a] if e.source_id == source][-k:]
        batches.append(sent + events[a:b])
        copies += len(sent)
    policy = Policy(fleet=fleet)
    got, dropped = _live(store, batches, policy)
    assert dropped == copies
    assert_frame_equal(got, streaming(events, policy), check_exact=True)


def test_a_lookup_sent_again_after_it_was_judged_keeps_its_adopt(store: Store) -> None:
    """What a server killed mid-load did: the batch ending in a lookup reached the collector, the
    kill took its answer, and the journal's shipper sent that lookup again with the adopt
    after it. The lookup's verdict is its adopt's, written once."""
    t = 1_700_000_000_000_000_000
    base: dict[str, Any] = dict(instance="eng", engine="vllm", model="m", source_id=7, tenant="t")
    commit = [Event(kind=EventKind.COMMIT, ts_ns=t + i, seq=i, block_key=100 + i, parent_key=99 + i if i else 0,
                    token_start=16 * i, token_end=16 * (i + 1), block_size=16, component=ComponentKind.FULL_ATTENTION,
                    tier=Tier.DEVICE, **base) for i in range(4)]
    lookup = Event(kind=EventKind.LOOKUP, ts_ns=t + 10, seq=4, request_id="r1", prompt_tokens=70,
                   group_block_keys=[[100, 101, 102, 103]], group_hit_tokens=[64], reported_hit_tokens=64, **base)
    adopt = Event(kind=EventKind.ADOPT, ts_ns=t + 11, seq=5, request_id="r1", reused_tiers=[Tier.DEVICE],
                  reused_tokens=[64], recomputed_tokens=6, **base)
    store.command(f"TRUNCATE TABLE {store.db}.verdicts")
    live = LiveReconstruction(store, load_recipe("dense"), CollectorMetrics(), lateness_ns=0)
    try:
        live.feed([*commit, lookup])  # judged at once (no lateness), waiting for its adopt
        live.feed([lookup, adopt])  # sent again, with what followed
        live.ended([("eng", 7)])
        live.tick(force=True)
    finally:
        live.close()
    rows = store.query_arrow(f"SELECT request_id, adopt_seen, adopted_tokens FROM {store.db}.verdicts").to_pylist()
    assert rows == [{"request_id": "r1", "adopt_seen": True, "adopted_tokens": 64}]
    assert getattr(live, "redelivered_events", 1) == 1 and live.late_events == 0


def _judged(store: Store, stored: list[Event], batches: list[list[Event]]) -> tuple[list[dict], LiveReconstruction]:
    """Verdicts of a collector that meets `stored` already in the store (another collector's
    ingest) and then stores and judges each of `batches`, as its drain would."""
    store.command(f"TRUNCATE TABLE {store.db}.events")
    store.command(f"TRUNCATE TABLE {store.db}.verdicts")
    store.insert_events(stored)
    live = LiveReconstruction(store, load_recipe("dense"), CollectorMetrics(), lateness_ns=0)
    try:
        for batch in batches:
            store.insert_events(batch)
            live.feed(batch)
        live.ended([("eng", 7), ("eng", 8)])
        live.tick(force=True)
    finally:
        live.close()
    rows = store.query_arrow(f"SELECT request_id, logical_hit_tokens, recoverable_hit_tokens, verdict "
                             f"FROM {store.db}.verdicts FINAL ORDER BY ts_ns").to_pylist()
    return rows, live


def test_a_collector_taking_over_drops_copies_of_what_it_read_back_and_feeds_late_rows(store: Store) -> None:
    """The new collector reads the instance's stored rows back. A copy of one of them arriving
    afterwards (the retry of a batch the collector that died never answered) is dropped; another
    process's rows older than those read back, but stored only after the read (that process
    fell behind), are fed, late, as the collector that never died would have fed them. Its
    verdicts are that collector's."""
    t = 1_700_000_000_000_000_000
    base: dict[str, Any] = dict(instance="eng", engine="vllm", model="m", tenant="t")

    def commit(src: int, seq: int, ts: int, key: int, i: int) -> Event:
        return Event(kind=EventKind.COMMIT, ts_ns=t + ts, source_id=src, seq=seq, block_key=key,
                     parent_key=key - 1 if i else 0, token_start=16 * i, token_end=16 * (i + 1), block_size=16,
                     component=ComponentKind.FULL_ATTENTION, tier=Tier.DEVICE, **base)

    def asked(seq: int, ts: int, rid: str, keys: list[int]) -> list[Event]:
        n = 16 * len(keys)
        return [Event(kind=EventKind.LOOKUP, ts_ns=t + ts, source_id=7, seq=seq, request_id=rid, prompt_tokens=n + 6,
                      group_block_keys=[keys], group_hit_tokens=[n], reported_hit_tokens=n, **base),
                Event(kind=EventKind.ADOPT, ts_ns=t + ts + 1, source_id=7, seq=seq + 1, request_id=rid,
                      reused_tiers=[Tier.DEVICE], reused_tokens=[n], recomputed_tokens=6, **base)]

    before = [commit(7, i, 2 * i, 100 + i, i) for i in range(4)]  # stored by the collector that died
    first = [*asked(4, 10, "r1", [100, 101, 102, 103]),
             Event(kind=EventKind.EVICT, ts_ns=t + 12, source_id=7, seq=6, block_key=103, tier=Tier.DEVICE,
                   component=ComponentKind.FULL_ATTENTION, **base)]
    late = [commit(8, 0, 1, 200, 0), commit(8, 1, 3, 201, 1)]  # older than what was read back
    copy = [before[3]]  # commits block 103 again, after its eviction, if it were fed
    after = [*asked(7, 20, "r2", [200, 201]), *asked(9, 22, "r3", [100, 101, 102, 103])]

    taken_over, live = _judged(store, before, [first, late, copy, after])
    assert live.redelivered_events == 1 and live.late_events == 2 and live.rebuilt_events == 4
    never_died, _ = _judged(store, [], [before, first, late, copy, after])
    assert taken_over == never_died
    assert [(r["request_id"], r["recoverable_hit_tokens"]) for r in taken_over] == [("r1", 64), ("r2", 32), ("r3", 48)]
