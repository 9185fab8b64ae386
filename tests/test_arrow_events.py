"""Arrow tables back to events: every field exact, whatever shape the batches have.

`from_arrow` builds events column by column (constant columns once, strings once per distinct
value, one constructor per batch shape), so what it must get right is every way a column can
look: all default, one non-default value, varying, lists empty in some rows, floats whose bits
matter, several record batches of different shapes in one table.
"""

from __future__ import annotations

import math

import msgspec
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import events

from kvtrace.schema.arrow import from_arrow, to_arrow
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import EventKind, Tier


def exact(evs: list[Event]) -> list[bytes]:
    """Every field, defaults and float bits included."""
    return [msgspec.msgpack.encode(msgspec.structs.asdict(e)) for e in evs]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(events(), min_size=1, max_size=12), min_size=1, max_size=4))
def test_any_events_come_back_exactly_from_tables_of_several_batches(batches):
    table = pa.Table.from_batches([b for evs in batches for b in to_arrow(evs).to_batches()])
    want = [e for evs in batches for e in evs]
    back = from_arrow(table)
    assert back == want
    assert exact(back) == exact(want)
    assert all(type(e.kind) is EventKind for e in back)


def test_a_column_of_one_value_that_is_not_the_default_is_kept():
    base = dict(kind=EventKind.COMMIT, ts_ns=5, source_id=9, block_key=3, tier=Tier.HOST)
    evs = [Event(seq=i, **base, engine="vllm", nbytes=0, probe_max_kl=-0.0) for i in range(3)]
    back = from_arrow(to_arrow(evs))
    assert back == evs
    assert all(e.tier is Tier.HOST and e.engine == "vllm" for e in back)
    assert all(math.copysign(1.0, e.probe_max_kl) < 0 for e in back)  # -0.0 is not the default 0.0


def test_lists_filled_in_some_rows_only():
    evs = [Event(kind=EventKind.EVICT, ts_ns=1, source_id=1, seq=0, block_key=1, more_keys=[2**64 - 1, 2]),
           Event(kind=EventKind.EVICT, ts_ns=1, source_id=1, seq=1, block_key=4),
           Event(kind=EventKind.LOOKUP, ts_ns=2, source_id=1, seq=2, request_id="r", prompt_tokens=64,
                 group_block_keys=[[1, 2], []], reused_tiers=[Tier.DISK])]
    back = from_arrow(to_arrow(evs))
    assert back == evs
    assert back[2].reused_tiers[0] is Tier.DISK
    assert back[1].more_keys == [] and back[0].more_keys == [2**64 - 1, 2]


def test_a_single_row_and_an_empty_table():
    ev = Event(kind=EventKind.USAGE, ts_ns=0, source_id=0, seq=0)
    assert from_arrow(to_arrow([ev])) == [ev]
    assert from_arrow(to_arrow([])) == []
