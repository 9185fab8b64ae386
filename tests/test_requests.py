"""Lookups and adopts judged from a batch's columns (analysis.requests) give the rows and leave
the state that feeding every event does, and most of a serving stream's requests never become
events."""

from __future__ import annotations

import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lifecycle import RECIPES, lifecycle_streams, long_stream

from kvtrace.analysis.evaluate import Policy
from kvtrace.analysis.reconstruct import Reconstructor
from kvtrace.instrumentation.attach import attach_events
from kvtrace.schema.arrow import to_arrow
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import EventKind, Tier
from kvtrace.schema.recipes import RecipeBook
from kvtrace.schema.verdicts import LookupResult

BOOK = RecipeBook(RECIPES)
POLICIES = [Policy(), Policy(shared_tenants=frozenset({"t2"})), Policy(keep_one_token=False)]


def _tables(rec: Reconstructor, events: list[Event], cuts: list[int], fed: list[Event]) -> list[LookupResult]:
    def feed(event: Event) -> list[LookupResult]:
        fed.append(event)
        return rec.feed(event)

    out: list[LookupResult] = []
    bounds = [0, *sorted(cuts), len(events)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        if b > a:
            out += rec.feed_table(to_arrow(events[a:b]), feed)
    return out + rec.finish()


@st.composite
def adopted_streams(draw: st.DrawFn) -> list[Event]:
    """Lifecycle streams whose lookups are mostly adopted, soon after (what the lane judges):
    nothing, or a few events of any instance, between a lookup and its adopt."""
    events = draw(lifecycle_streams())
    out, seq = list(events), 0
    for i, e in enumerate(events):
        if e.kind is not EventKind.LOOKUP or not draw(st.integers(0, 4)):
            continue
        after = events[min(len(events) - 1, i + draw(st.integers(0, 8)))]
        reused = draw(st.integers(0, e.prompt_tokens))
        seq += 1
        out.append(Event(ts_ns=after.ts_ns, source_id=3, seq=seq, kind=EventKind.ADOPT, engine=e.engine,
                         instance=e.instance, model=e.model, request_id=e.request_id, reused_tiers=[Tier.DEVICE],
                         reused_tokens=[reused], recomputed_tokens=e.prompt_tokens - reused))
    out.sort(key=lambda e: (e.ts_ns, e.source_id, e.seq))
    return out


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(events=st.one_of(lifecycle_streams(), adopted_streams(), adopted_streams()), policy=st.sampled_from(POLICIES),
       max_pending=st.sampled_from([1, 2, 100]), data=st.data())
def test_the_lane_gives_the_rows_and_state_of_events(events: list[Event], policy: Policy, max_pending: int,
                                                      data: st.DataObject) -> None:
    # Cut anywhere (a lookup's adopt in the next table), few lookups allowed to wait (the lane
    # steps aside where one would overflow), and every policy the lane serves.
    cuts = data.draw(st.lists(st.integers(0, len(events)), max_size=4), label="cuts")
    one = Reconstructor(BOOK, policy, max_pending)
    whole = list(one.run(events))
    lane = Reconstructor(BOOK, policy, max_pending)
    assert _tables(lane, events, cuts, []) == whole
    a, b = one.capture(), lane.capture()
    assert (a.events_seen, a.unmatched_adopts, a.pending_overflow) == (b.events_seen, b.unmatched_adopts,
                                                                      b.pending_overflow)
    assert a.state.changes == b.state.changes and a.state.tenants == b.state.tenants


def _serving(n: int, attach_at: int) -> list[Event]:
    """Requests of one instance (lookup, adopt, commit of its blocks), an engine attaching part
    way (its recipe published for later lookups), lookups of a model nobody described, and a
    canary probe among them."""
    base = dict(engine="vllm", instance="i", source_id=1)
    events: list[Event] = []

    def add(**kw: object) -> None:
        events.append(Event(ts_ns=1_750_000_000 * 10**9 + len(events), seq=len(events), **{**base, **kw}))  # type: ignore[arg-type]

    for r in range(n):
        if r == attach_at:
            for attached in attach_events(Event(kind=EventKind.ATTACH), RECIPES["dense"], engine_version="t"):
                add(model="published", kind=attached.kind, engine_version=attached.engine_version,
                    recipe=attached.recipe)
        model = "dense" if r % 7 else ("published" if r > attach_at else "nobody")
        keys = [(r % 9) * 100 + i + 1 for i in range(1 + r % 5)]
        add(model=model, kind=EventKind.LOOKUP, request_id=f"r{r}", prompt_tokens=len(keys) * 2 + 1,
            group_block_keys=[keys])
        if r % 11 == 3:
            add(model=model, kind=EventKind.PROBE, request_id=f"r{r}", probe_of=f"r{r - 1}", prompt_tokens=3)
        if r % 13 != 5:  # now and then never adopted
            add(model=model, kind=EventKind.ADOPT, request_id=f"r{r}", reused_tiers=[Tier.DEVICE],
                reused_tokens=[len(keys)], recomputed_tokens=len(keys) + 1)
        add(model="dense", kind=EventKind.COMMIT, tier=Tier.DEVICE, block_key=keys[0], more_keys=keys[1:], nbytes=8)
    return events


def test_attaches_unknown_models_and_probes_keep_their_place() -> None:
    events = _serving(400, attach_at=150)
    whole = list(Reconstructor(BOOK).run(event for event in events if event.kind is not EventKind.PROBE
                                          and event.model != "nobody"))
    rec, fed = Reconstructor(BOOK), []

    def feed(event: Event) -> list[LookupResult]:  # as the live judge does: what it cannot judge, it skips
        fed.append(event)
        if event.kind is EventKind.PROBE or event.model == "nobody":
            return []
        return rec.feed(event)

    out: list[LookupResult] = []
    for a in range(0, len(events), 97):
        out += rec.feed_table(to_arrow(events[a:a + 97]), feed)
    assert out + rec.finish() == whole
    assert any(r.model == "published" for r in whole) and sum(r.adopt_seen for r in whole) > 300
    assert {e.kind for e in fed} >= {EventKind.ATTACH, EventKind.PROBE, EventKind.LOOKUP}


def test_most_requests_of_a_serving_stream_are_judged_from_the_columns() -> None:
    events = long_stream(requests=3000)
    whole = list(Reconstructor(BOOK).run(events))
    fed: list[Event] = []
    assert _tables(Reconstructor(BOOK), events, [5000, 9000], fed) == whole
    lookups = sum(e.kind is EventKind.LOOKUP for e in events)
    assert lookups == 3000 and sum(e.kind is EventKind.LOOKUP for e in fed) < lookups // 100
    assert sum(r.recoverable_hit_tokens > 0 for r in whole) > 500


def test_a_table_that_starts_with_an_engine_attaching_is_judged_from_the_columns_after_it() -> None:
    # A fresh engine's first events (its attach, then serving) reach the live judge as one table:
    # the lookups after the attach are judged from the columns, not walked as events.
    stream = long_stream(requests=3000)
    first = stream[0]
    made = attach_events(Event(kind=EventKind.ATTACH), RECIPES["dense"], engine_version="t")
    attached = [Event(ts_ns=first.ts_ns - 10 + i, source_id=first.source_id, seq=10**6 + i, engine=first.engine,
                      instance=first.instance, model=first.model, kind=a.kind, engine_version="t", recipe=a.recipe,
                      tier=a.tier, reason=a.reason)
                for i, a in enumerate(made)]
    events = [*attached, *stream]
    whole = list(Reconstructor(BOOK).run(events))
    fed: list[Event] = []
    assert _tables(Reconstructor(BOOK), events, [9000], fed) == whole
    lookups = sum(e.kind is EventKind.LOOKUP for e in events)
    assert sum(e.kind is EventKind.ATTACH for e in fed) == 1
    assert sum(e.kind is EventKind.LOOKUP for e in fed) < lookups // 100


def test_what_changes_between_a_lookup_and_its_adopt_is_judged_at_the_adopt() -> None:
    # Per request: its blocks committed (now and then under another tenant, or with a lease
    # that runs out), looked up, now and then a needed block evicted before the adopt.
    base = dict(engine="vllm", instance="i", model="dense", source_id=1)
    events: list[Event] = []

    def add(**kw: object) -> None:
        events.append(Event(ts_ns=1_750_000_000 * 10**9 + 10 * len(events), seq=len(events), **{**base, **kw}))  # type: ignore[arg-type]

    for r in range(300):
        keys = [r * 10 + i + 1 for i in range(4)]
        lease = events[-1].ts_ns + 25 if events and r % 5 == 1 else 0  # runs out between the lookup and the adopt
        add(kind=EventKind.COMMIT, tier=Tier.DEVICE, block_key=keys[0], more_keys=keys[1:], nbytes=8,
            tenant="t2" if r % 7 == 2 else "t1", lease_expiry_ns=lease)
        add(kind=EventKind.LOOKUP, request_id=f"r{r}", prompt_tokens=9, tenant="t1", group_block_keys=[keys])
        if r % 3 == 0:
            add(kind=EventKind.EVICT, tier=Tier.DEVICE, block_key=keys[1])
        add(kind=EventKind.ADOPT, request_id=f"r{r}", reused_tiers=[Tier.DEVICE], reused_tokens=[8],
            recomputed_tokens=1)
    whole = list(Reconstructor(BOOK).run(events))
    fed: list[Event] = []
    assert _tables(Reconstructor(BOOK), events, [333, 700], fed) == whole
    assert not any(e.kind is EventKind.LOOKUP for e in fed)
    reasons = {r.reason for r in whole}
    assert {"changed_before_use", "tenant_mismatch"} <= {str(x) for x in reasons}
    assert any(r.cross_tenant for r in whole) and any(r.unsafe_reuse for r in whole)
    assert sum(r.reason == "changed_before_use" and r.reason_detail == "lease_expired" for r in whole) > 10


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(events=adopted_streams(), policy=st.sampled_from(POLICIES), data=st.data())
def test_verdicts_made_as_columns_are_the_results_as_columns(events: list[Event], policy: Policy,
                                                              data: st.DataObject) -> None:
    # What the live judge writes: the lane's verdicts as Arrow tables, the others as results.
    cuts = data.draw(st.lists(st.integers(0, len(events)), max_size=3), label="cuts")
    whole = to_arrow(list(Reconstructor(BOOK, policy).run(events)), LookupResult)
    rec = Reconstructor(BOOK, policy)
    rec.verdict_tables = tables = []
    rows: list[LookupResult] = []
    bounds = [0, *sorted(cuts), len(events)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        if b > a:
            rows += rec.feed_table(to_arrow(events[a:b]))
    rows += rec.finish()
    got = pa.concat_tables([to_arrow(rows, LookupResult), *tables])
    order = [("ts_ns", "ascending"), ("source_id", "ascending"), ("seq", "ascending")]
    assert got.sort_by(order).equals(whole.sort_by(order))
