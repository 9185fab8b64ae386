"""Feeding a stream as Arrow tables (object rows applied from their columns, analysis.columnar)
gives the rows, and leaves the state, that feeding it event by event does."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lifecycle import RECIPES, SMALL, lifecycle_streams, long_stream

from kvtrace.analysis.evaluate import Policy
from kvtrace.analysis.native_state import NativeState
from kvtrace.analysis.reconstruct import Reconstructor
from kvtrace.schema.arrow import to_arrow
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import ComponentKind, EventKind, Tier
from kvtrace.schema.recipes import RecipeBook, RecipeMismatch
from kvtrace.schema.verdicts import LookupResult

BOOK = RecipeBook(RECIPES)
POLICIES = [Policy(), Policy(shared_tenants=frozenset({"t2"})), Policy(keep_one_token=False), Policy(fleet=True)]
SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _by_table(rec: Reconstructor, events: list[Event], cuts: list[int]) -> list[LookupResult]:
    out: list[LookupResult] = []
    bounds = [0, *sorted(cuts), len(events)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        if b > a:
            out += rec.feed_table(to_arrow(events[a:b]))
    return out + rec.finish()


def _same_state(a: Reconstructor, b: Reconstructor) -> None:
    sa, sb = a.capture(), b.capture()
    assert sa.events_seen == sb.events_seen
    assert {k: t for k, t in sa.state.tables.items() if t} == {k: t for k, t in sb.state.tables.items() if t}
    assert (sa.state.bulk, sa.state.changes, sa.state.leased, sa.state.tenants) == \
        (sb.state.bulk, sb.state.changes, sb.state.leased, sb.state.tenants)


@SETTINGS
@given(events=lifecycle_streams(), policy=st.sampled_from(POLICIES), data=st.data())
def test_tables_give_the_rows_and_state_of_events(events: list[Event], policy: Policy, data: st.DataObject) -> None:
    cuts = data.draw(st.lists(st.integers(0, len(events)), max_size=4), label="cuts")
    one = Reconstructor(BOOK, policy)
    whole = list(one.run(events))
    batched = Reconstructor(BOOK, policy)
    assert isinstance(batched.state, NativeState)
    assert _by_table(batched, events, cuts) == whole
    _same_state(one, batched)


def test_a_long_stream_as_tables_gives_the_same_rows() -> None:
    events = long_stream()
    one = Reconstructor(BOOK)
    whole = list(one.run(events))
    batched = Reconstructor(BOOK)
    assert _by_table(batched, events, [1000, 5000, 17_000]) == whole
    _same_state(one, batched)
    assert sum(r.recoverable_hit_tokens > 0 for r in whole) > 1000


def test_a_commit_the_given_recipe_refuses_stops_the_table_where_the_events_stop() -> None:
    # SMALL's group 0 has blocks of 4 tokens: a commit of 8-token blocks contradicts it.
    base = dict(engine="vllm", instance="i", model="hybrid", source_id=1, component=ComponentKind.FULL_ATTENTION,
                tier=Tier.DEVICE, nbytes=8)
    events = [Event(kind=EventKind.COMMIT, ts_ns=10 + i, seq=i, block_key=i + 1, token_start=4 * i,
                    token_end=4 * i + (8 if i == 3 else 4), **base) for i in range(6)]  # type: ignore[arg-type]
    for feed in ("events", "table"):
        rec = Reconstructor(RecipeBook({"hybrid": SMALL}))
        with pytest.raises(RecipeMismatch, match="hybrid"):
            if feed == "events":
                rec.run(events).__next__()
            else:
                rec.feed_table(to_arrow(events))
        assert rec.events_seen == 4  # the refused commit counted, the ones after it never read
        assert rec.state.object_count() == 3


def test_bail_feeds_every_later_row_as_an_event() -> None:
    events = long_stream(requests=300)
    fed: list[Event] = []
    rec = Reconstructor(BOOK)

    def feed(event: Event) -> list[LookupResult]:
        fed.append(event)
        return rec.feed(event)

    # requests=False: lookups and adopts come as events too (tests/test_requests.py has the lane)
    rows = rec.feed_table(to_arrow(events), feed, bail=lambda: len(fed) >= 50, requests=False)
    one = Reconstructor(BOOK)
    assert rows + rec.finish() == list(one.run(events))
    later = events.index(fed[49]) + 1
    assert fed[50:] == events[later:]  # after bailing, objects too come as events
    assert all(e.kind in (EventKind.LOOKUP, EventKind.ADOPT) for e in fed[:50])
