"""Validation of untrusted rows and exact round trips through JSON, msgpack and Arrow."""

from __future__ import annotations

import math

import msgspec
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import EDGES, TIERS, events

from kvtrace.schema import validation
from kvtrace.schema.arrow import from_arrow, to_arrow
from kvtrace.schema.events import FIELD_NAMES, REQUIRED_BY_KIND, SCHEMA_VERSION, Event
from kvtrace.schema.kinds import EVICT_REASONS, INVALIDATE_REASONS, ComponentKind, EventKind, Reason, Tier
from kvtrace.schema.recipes import dense, recipe_json
from kvtrace.schema.records import EmitterStats
from kvtrace.schema.validation import (
    InvalidEvent,
    ensure_valid,
    event_from_builtins,
    event_from_json,
    problems,
    validate_rows,
)
from kvtrace.schema.wire import Batch, decode_batch, decode_raw_event, encode_batch

# A valid row of each kind, as plain JSON builtins.
GOOD: dict[EventKind, dict] = {
    EventKind.CREATE: {"component": "full_attention", "block_key": 11, "tier": "device"},
    EventKind.COMMIT: {"component": "sliding_window", "block_key": 12, "tier": "device"},
    EventKind.OFFLOAD: {"component": "mamba", "block_key": 13, "src_tier": "device", "dst_tier": "host"},
    EventKind.LOAD: {"component": "indexer", "block_key": 14, "src_tier": "disk", "dst_tier": "device"},
    EventKind.EVICT: {"component": "full_attention", "block_key": 15, "tier": "host", "reason": "capacity"},
    EventKind.INVALIDATE: {"reason": "weight_update"},
    EventKind.LOOKUP: {"request_id": "r1", "prompt_tokens": 64, "reported_hit_tokens": 32},
    EventKind.ADOPT: {"request_id": "r1", "reused_tiers": ["host"], "reused_tokens": [32]},
    EventKind.USAGE: {"tier": "device", "locked_bytes": 1 << 20, "evictable_bytes": 1 << 30, "free_bytes": 0},
    EventKind.PROBE: {"request_id": "kvtrace-verify-1", "probe_of": "r1", "prompt_tokens": 64,
                      "reported_hit_tokens": 32, "probe_positions": 36, "probe_max_abs_diff": 0.25,
                      "probe_max_kl": 0.01, "noise_floor": 1e-5},
    EventKind.ATTACH: {"engine": "vllm", "model": "m", "engine_version": "0.32.0", "max_model_len": 4096,
                       "block_size": 32, "recipe": recipe_json(dense(32))},
}


def row(kind: str = "create", **kw: object) -> dict:
    out = {"kind": kind, "ts_ns": 1_750_000_000_000_000_000, "source_id": 42, "seq": 7}
    out.update(GOOD.get(EventKind(kind), {}) if kind in set(EventKind) else {})
    out.update(kw)
    return {k: v for k, v in out.items() if v is not ...}


# -- round trips -------------------------------------------------------------------------------


@given(events())
@settings(max_examples=200, deadline=None)
def test_strategy_makes_valid_events(event):
    assert problems(event) == []
    assert ensure_valid(event) is event


@given(st.sampled_from(list(EventKind)).flatmap(lambda k: events(kinds=st.just(k))))
@settings(max_examples=100, deadline=None)
def test_strategy_covers_every_kind_with_its_required_fields(event):
    for name in REQUIRED_BY_KIND[event.kind]:
        assert getattr(event, name)
    if event.kind is EventKind.EVICT:
        assert event.reason in EVICT_REASONS
    if event.kind is EventKind.INVALIDATE:
        assert event.reason in INVALIDATE_REASONS


@given(events())
@settings(max_examples=200, deadline=None)
def test_json_round_trip(event):
    text = msgspec.json.encode(event)
    assert event_from_json(text) == event
    assert event_from_json(text.decode()) == event
    # omit_defaults keeps JSON small, but the id and time are always there
    decoded = msgspec.json.decode(text)
    assert {"kind", "ts_ns", "source_id", "seq"} <= decoded.keys()


@given(st.lists(events(), max_size=10), st.integers(1, 2**64 - 1), st.integers(0, 2**63 - 1))
@settings(max_examples=100, deadline=None)
def test_msgpack_batch_round_trip(evs, source_id, batch_seq):
    stats = EmitterStats(ts_ns=5, source_id=source_id, emitted=len(evs), exported=len(evs))
    batch = Batch(source_id=source_id, batch_seq=batch_seq, sent_ns=9, events=evs, stats=stats)
    payload = encode_batch(batch)
    raw = decode_batch(payload)
    assert (raw.source_id, raw.batch_seq, raw.sent_ns) == (source_id, batch_seq, 9)
    assert raw.stats == stats
    assert [event_from_builtins(decode_raw_event(r)) for r in raw.events] == evs


@given(st.lists(events(), max_size=15))
@settings(max_examples=100, deadline=None)
def test_arrow_round_trip(evs):
    table = to_arrow(evs)
    assert table.num_rows == len(evs)
    assert tuple(table.column_names) == FIELD_NAMES
    assert from_arrow(table) == evs
    # rows read off Arrow validate as untrusted input too (the Parquet ingest path)
    assert [event_from_builtins(r) for r in table.to_pylist()] == evs


def test_to_arrow_refuses_a_value_of_the_wrong_kind_even_where_it_equals_the_default():
    """0 == False, so a column of defaults made without converting its values would have let a
    bool into an integer column (and 0 into a bool one); the store sink relies on the refusal."""
    base = Event(kind=EventKind.LOOKUP, ts_ns=1, source_id=1, seq=0, request_id="r", prompt_tokens=1)
    for name, value in (("in_flight", 0), ("dp_rank", False)):
        with pytest.raises((TypeError, ValueError, pa.ArrowException)):
            to_arrow([msgspec.structs.replace(base, **{name: value})])
    negative_zero = to_arrow([msgspec.structs.replace(base, noise_floor=-0.0)]).column("noise_floor")[0].as_py()
    assert math.copysign(1.0, negative_zero) == -1.0


def test_envelope_and_wire_version_are_always_encoded():
    """The first event of every emitter has seq 0; a default must not drop it from the wire.

    schema_version is always written too: a row without it would be read as the reader's version.
    So is the transform, whose default (exact) is not its column type's zero: ClickHouse's JSON
    insert fills omitted fields with zeros.
    """
    shim_made = Event(kind=EventKind.INVALIDATE, reason=Reason.RESET)
    assert (shim_made.ts_ns, shim_made.source_id, shim_made.seq) == (0, 0, 0)
    first = Event(kind=EventKind.INVALIDATE, reason=Reason.RESET, ts_ns=5, source_id=3, seq=0)
    assert msgspec.json.decode(msgspec.json.encode(first)) == {
        "kind": "invalidate", "ts_ns": 5, "source_id": 3, "seq": 0, "schema_version": SCHEMA_VERSION,
        "transform": "exact", "reason": "reset"}
    assert event_from_json(msgspec.json.encode(first)) == first
    payload = encode_batch(Batch(source_id=3, batch_seq=0, sent_ns=0, events=[first]))
    assert msgspec.msgpack.decode(payload)["wire_version"] == 1
    (raw,) = decode_batch(payload).events
    assert event_from_builtins(decode_raw_event(raw)) == first


# -- rejections name the field -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        (row(kind="teleport"), "kind"),
        (row(kind=...), "kind"),
        (row(ts_ns=...), "ts_ns"),
        (row(source_id=...), "source_id"),
        (row(seq=...), "seq"),
        (row(ts_ns=0), "ts_ns"),
        (row(ts_ns=-5), "ts_ns"),
        (row(source_id=0), "source_id"),
        (row(token_start=100, token_end=99), "token_end"),
        (row(nbytes="4096"), "nbytes"),
        (row(nbytes=-1), "nbytes"),
        (row(nbytes=1.5), "nbytes"),
        (row(block_key=2**64), "block_key"),
        (row(parent_key=2**64 + 5), "parent_key"),
        (row(duration_ns=2**63), "duration_ns"),
        (row(dp_rank=2**16), "dp_rank"),
        (row(token_end=2**32), "token_end"),
        (row(group_hit_tokens=[1, 2**32]), "group_hit_tokens[1]"),
        (row(group_block_keys=[[1], [2, 2**64]]), "group_block_keys[1][1]"),
        (row(tier="l3"), "tier"),
        (row(in_flight="yes"), "in_flight"),
        (row(schema_version=99), "schema_version"),
        (row(schema_version=SCHEMA_VERSION + 1), "schema_version"),
        (row(schema_version=0), "schema_version"),
        (row(schema_version=-1), "schema_version"),
        (row(schema_version="1"), "schema_version"),
        (row("evict", reason=...), "reason"),
        (row("evict", reason="weight_update"), "reason"),
        (row("invalidate", reason="capacity"), "reason"),
        (row("invalidate", reason=...), "reason"),
        (row("create", component=...), "component"),
        (row("create", block_key=0), "block_key"),
        (row("commit", tier=""), "tier"),
        (row("offload", dst_tier=...), "dst_tier"),
        (row("load", src_tier=...), "src_tier"),
        (row("lookup", request_id=...), "request_id"),
        (row("lookup", request_id=""), "request_id"),
        (row("lookup", prompt_tokens=0, reported_hit_tokens=0), "prompt_tokens"),
        (row("lookup", prompt_tokens=10, reported_hit_tokens=11), "reported_hit_tokens"),
        (row("adopt", request_id=...), "request_id"),
        (row("adopt", reused_tiers=["host", "disk"], reused_tokens=[1]), "reused_tokens"),
        (row("adopt", reused_tiers=["ram"], reused_tokens=[1]), "reused_tiers[0]"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_rejection_names_the_field(bad, field):
    with pytest.raises(InvalidEvent) as err:
        event_from_builtins(bad)
    assert err.value.field == field, err.value.reason
    assert err.value.reason
    # the JSON path rejects it the same way
    with pytest.raises(InvalidEvent) as err2:
        event_from_json(msgspec.json.encode(bad))
    assert err2.value.field == field


@pytest.mark.parametrize("bad", [b"", b"{", b"not json", b'{"kind": "create",}', b"\xff\xfe{}"])
def test_bad_json_is_a_row_level_rejection(bad):
    with pytest.raises(InvalidEvent) as err:
        event_from_json(bad)
    assert err.value.field == ""


@pytest.mark.parametrize("bad", [[1, 2], "create", 5, None])
def test_non_object_rows_are_rejected(bad):
    with pytest.raises(InvalidEvent, match="expected an object") as err:
        event_from_builtins(bad)
    assert err.value.field == ""


def test_every_kind_accepts_its_minimal_row():
    for kind in EventKind:
        event = event_from_builtins(row(kind.value))
        assert event.kind is kind
        assert event.schema_version == SCHEMA_VERSION


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.5])
@pytest.mark.parametrize("name", ["probe_max_abs_diff", "probe_mean_kl", "probe_max_kl", "noise_floor"])
def test_a_probe_measurement_must_be_finite_and_not_negative(name, value):
    with pytest.raises(InvalidEvent) as err:
        event_from_builtins(row("probe", **{name: value}))
    assert err.value.field == name and "finite and not negative" in str(err.value)


def test_ensure_valid_reports_the_first_problem_and_problems_lists_all():
    e = Event(kind=EventKind.EVICT, ts_ns=1, source_id=1, seq=0, token_start=5, token_end=1)
    fields = [p.field for p in problems(e)]
    assert "token_end" in fields and "component" in fields and "block_key" in fields
    assert "tier" in fields and "reason" in fields
    with pytest.raises(InvalidEvent) as err:
        ensure_valid(e)
    assert err.value.field == fields[0]


def test_validate_rows_keeps_good_rows_and_numbers_bad_ones():
    rows = [
        row("create"),  # 1
        row("teleport"),  # 2
        row("lookup"),  # 3
        row("create", nbytes="x"),  # 4
        "not an object",  # 5
        row("evict", reason=...),  # 6
        row("adopt"),  # 7
        row("invalidate", schema_version=99),  # 8
    ]
    good, bad = validate_rows(rows, origin="unit")
    assert [e.kind for e in good] == [EventKind.CREATE, EventKind.LOOKUP, EventKind.ADOPT]
    assert [(r.row, r.field) for r in bad] == [
        (2, "kind"),
        (4, "nbytes"),
        (5, ""),
        (6, "reason"),
        (8, "schema_version"),
    ]
    assert all(r.origin == "unit" and r.reason and r.received_ns > 0 for r in bad)
    assert msgspec.json.decode(bad[0].raw) == rows[1]
    assert bad[2].raw == "not an object"
    assert bad[1].message().startswith("unit row 4: nbytes: ")


def test_validate_rows_numbers_from_first_row():
    good, bad = validate_rows([row(), row(ts_ns=...)], origin="x", first_row=1001)
    assert len(good) == 1
    assert [(r.row, r.field) for r in bad] == [(1002, "ts_ns")]


# -- forward compatibility ----------------------------------------------------------------------


def test_row_without_version_or_optional_fields_takes_defaults():
    e = event_from_builtins({"kind": "invalidate", "ts_ns": 3, "source_id": 9, "seq": 0, "reason": "reset"})
    assert e == Event(kind=EventKind.INVALIDATE, ts_ns=3, source_id=9, seq=0, reason=Reason.RESET)
    assert e.schema_version == SCHEMA_VERSION
    assert e.transform.value == "exact"
    assert (e.block_key, e.request_id, e.reused_tiers, e.group_block_keys) == (0, "", [], [])


def test_unknown_fields_from_a_newer_minor_writer_are_ignored():
    e = event_from_builtins(row("create", some_future_field=[1, 2, 3], another={"x": 1}))
    assert e == event_from_builtins(row("create"))


def test_older_version_rows_are_upgraded(monkeypatch):
    """A reader at version N+1 upgrades version-N rows: renames via UPGRADES, new fields default."""
    newer = SCHEMA_VERSION + 1

    def rename(old: dict) -> dict:
        out = dict(old)
        if "legacy_hit" in out:
            out["reported_hit_tokens"] = out.pop("legacy_hit")
        return out

    monkeypatch.setattr(validation, "SCHEMA_VERSION", newer)
    monkeypatch.setitem(validation.UPGRADES, SCHEMA_VERSION, rename)
    old = row("lookup", schema_version=SCHEMA_VERSION, reported_hit_tokens=..., legacy_hit=8)
    e = event_from_builtins(old)
    assert e.schema_version == newer
    assert e.reported_hit_tokens == 8
    assert e.recomputed_tokens == 0
    # the caller's row is not modified
    assert old["schema_version"] == SCHEMA_VERSION and "legacy_hit" in old
    # rows of the reader's own version pass untouched; versions past it are refused
    assert event_from_builtins(row("lookup", schema_version=newer)).schema_version == newer
    with pytest.raises(InvalidEvent) as err:
        event_from_builtins(row("lookup", schema_version=newer + 1))
    assert err.value.field == "schema_version"


def test_a_huge_negative_version_is_rejected_at_once():
    with pytest.raises(InvalidEvent) as err:
        event_from_builtins(row(schema_version=-(10**15)))
    assert err.value.field == "schema_version"


# -- arbitrary input never escapes as anything but InvalidEvent ----------------------------------

_JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
    max_leaves=12,
)
_FIELD_VALUES = st.one_of(
    _JSONISH,
    st.sampled_from([v.value for e in (EventKind, Tier, Reason, ComponentKind) for v in e]),
    st.integers(-(2**70), 2**70),
    st.lists(st.integers(-5, 2**65), max_size=3),
    st.lists(st.lists(st.integers(-5, 2**65), max_size=3), max_size=3),
    st.lists(st.sampled_from([t.value for t in TIERS] + ["bogus"]), max_size=3),
)


@st.composite
def jsonish_rows(draw: st.DrawFn) -> object:
    """Mostly event-shaped dicts with arbitrary values; sometimes anything JSON can hold."""
    if draw(st.integers(0, 9)) == 0:
        return draw(_JSONISH)
    base = draw(st.fixed_dictionaries({}, optional={name: _FIELD_VALUES for name in FIELD_NAMES}))
    base.update(draw(st.dictionaries(st.text(max_size=6), _JSONISH, max_size=3)))
    if draw(st.booleans()):
        base.update(row(draw(st.sampled_from(list(EventKind))).value))
        base.update(draw(st.fixed_dictionaries({}, optional={name: _FIELD_VALUES for name in FIELD_NAMES})))
    return base


@given(jsonish_rows())
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_arbitrary_rows_raise_only_invalid_event(value):
    try:
        event = event_from_builtins(value)
    except InvalidEvent as exc:
        assert isinstance(exc.field, str)
        assert exc.reason
        if exc.field:
            assert exc.field.split("[")[0] in FIELD_NAMES
        return
    # anything accepted is a fully valid event that survives every format
    assert problems(event) == []
    assert event_from_json(msgspec.json.encode(event)) == event
    assert from_arrow(to_arrow([event])) == [event]


@given(st.binary(max_size=64) | st.text(max_size=64))
@settings(max_examples=200, deadline=None)
def test_arbitrary_text_raises_only_invalid_event(data):
    try:
        event_from_json(data)
    except InvalidEvent:
        pass



def test_runs_name_more_blocks_only_on_object_events():
    base = dict(ts_ns=5, source_id=3, seq=1)
    run = Event(kind=EventKind.EVICT, component=ComponentKind.FULL_ATTENTION, block_key=7, more_keys=[8, 9],
                tier=Tier.DEVICE, reason=Reason.CAPACITY, **base)
    assert validation.problems(run) == []
    lookup = Event(kind=EventKind.LOOKUP, request_id="r", prompt_tokens=4, more_keys=[8], **base)
    assert [p.field for p in validation.problems(lookup)] == ["more_keys"]
    zero = msgspec.structs.replace(run, more_keys=[8, 0])
    assert "0 is not a block key" in validation.problems(zero)[0].reason


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events(), st.dictionaries(st.sampled_from(sorted(EDGES)), st.none(), max_size=4), st.data())
def test_clean_agrees_with_problems(event: Event, fields: dict, data: st.DataObject) -> None:
    """The ingest fast path's `clean` accepts exactly the events `problems` finds nothing wrong with."""
    changed = msgspec.structs.replace(event, **{name: data.draw(EDGES[name], label=name) for name in fields})
    assert validation.clean(changed) == (not problems(changed, msgpack_decoded=True)), problems(changed)


@pytest.mark.parametrize("recipe", ['{"name": "x"}', "not json", '{"name": "x", "groups": []}',
                                    '{"name": "x", "groups": [{"group_id": 1, "component": "full_attention",'
                                    ' "block_size": 16}]}'])
def test_an_attach_event_carries_a_recipe_that_is_one(recipe: str) -> None:
    """The analysis judges the engine's lookups by it: a broken one is refused with the row, by
    every check that decides what gets stored."""
    good = event_from_builtins({"kind": "attach", "ts_ns": 5, "source_id": 3, "seq": 0, **GOOD[EventKind.ATTACH]})
    assert problems(good) == [] and validation.clean(good)
    bad = msgspec.structs.replace(good, recipe=recipe)
    assert [p.field for p in problems(bad)] == ["recipe"]
    assert not validation.clean(bad)
    from kvtrace.schema.arrow import to_arrow
    from kvtrace.schema.arrow_checks import clean_rows

    assert clean_rows(to_arrow([good, bad])).tolist() == [True, False]
