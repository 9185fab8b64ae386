"""The compiled cache state gives the rows the Python state gives, for every stream drawn, and
survives the snapshot round trip (a run split anywhere, resumed by either state, gives the rows
of the whole run)."""

from __future__ import annotations

import collections

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lifecycle import RECIPES, lifecycle_streams, long_stream

from kvtrace.analysis import snapshot
from kvtrace.analysis.evaluate import Policy
from kvtrace.analysis.native_state import NativeState, available
from kvtrace.analysis.reconstruct import Reconstructor
from kvtrace.analysis.state import CacheState
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import ComponentKind, EventKind, Tier
from kvtrace.schema.recipes import RecipeBook
from kvtrace.schema.verdicts import GapReason, LookupResult

BOOK = RecipeBook(RECIPES)
BASE = 1_750_000_000 * 10**9
POLICIES = [Policy(), Policy(shared_tenants=frozenset({"t2"})), Policy(keep_one_token=False), Policy(fleet=True)]
SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _rows(events: list[Event], policy: Policy, native: bool, monkeypatch: pytest.MonkeyPatch) -> list[LookupResult]:
    monkeypatch.setenv("KVTRACE_NATIVE", "1" if native else "0")
    rec = Reconstructor(BOOK, policy)
    assert isinstance(rec.state, NativeState) == native
    return list(rec.run(events))


def test_the_compiled_state_is_built_where_the_tests_run() -> None:
    # The install compiles it (setup.py); were it missing, every other test here would compare
    # the Python state with itself.
    assert available()


@SETTINGS
@given(events=lifecycle_streams(), policy=st.sampled_from(POLICIES))
def test_compiled_and_python_states_give_the_same_rows(events: list[Event], policy: Policy) -> None:
    with pytest.MonkeyPatch.context() as mp:
        python = _rows(events, policy, False, mp)
        compiled = _rows(events, policy, True, mp)
    assert compiled == python


@SETTINGS
@given(events=lifecycle_streams(), data=st.data())
def test_the_compiled_state_round_trips_through_a_snapshot(events: list[Event], data: st.DataObject) -> None:
    cut = data.draw(st.integers(0, len(events)), label="cut")
    policy = data.draw(st.sampled_from([Policy(), Policy(fleet=True)]), label="policy")
    with pytest.MonkeyPatch.context() as mp:
        whole = _rows(events, policy, False, mp)
        # The plain state after the first part, both ways: the same objects and scopes.
        mp.setenv("KVTRACE_NATIVE", "0")
        python = Reconstructor(BOOK, policy)
        mp.setenv("KVTRACE_NATIVE", "1")
        compiled = Reconstructor(BOOK, policy)
        done: list[LookupResult] = []
        for event in events[:cut]:
            python.feed(event)
            done += compiled.feed(event)
        exported = compiled.capture().state
        assert isinstance(exported, CacheState)
        assert exported.tables.keys() == {k for k, t in python.state.tables.items() if t}
        assert all(exported.tables[k] == t for k, t in python.state.tables.items() if t)
        assert exported.bulk == python.state.bulk
        assert (exported.changes, exported.leased, exported.tenants) == \
            (python.state.changes, python.state.leased, python.state.tenants)
        assert (exported.fleet, exported.slots, exported.names, exported.models, exported.holders) == \
            (python.state.fleet, python.state.slots, python.state.names, python.state.models, python.state.holders)
        if not cut:
            return
        # A snapshot taken by either state, resumed by either, the rest gives the whole run's rows
        # (the objects travel packed: analysis.packed, written and read by both).
        print_ = snapshot.fingerprint(BOOK, policy)
        for taker in (compiled, python):
            row = snapshot.take(taker, events[cut - 1], print_)
            assert row.objects == compiled.state.object_count()
            for native in (True, False):
                mp.setenv("KVTRACE_NATIVE", "1" if native else "0")
                resumed = snapshot.resume(row, BOOK, policy)
                assert isinstance(resumed.state, NativeState) == native
                rest = list(resumed.run(events[cut:]))
                assert sorted(done + rest, key=_key) == sorted(whole, key=_key)


def _key(r: LookupResult) -> tuple[int, int, int]:
    return (r.ts_ns, r.source_id, r.seq)


def test_a_long_stream_gives_the_same_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tens of thousands of objects born, moved, invalidated and forgotten over a small key space:
    the compiled table grows, deletes and reuses its slots, and every lookup's row still agrees."""
    events = long_stream()
    python = _rows(events, Policy(), False, monkeypatch)
    compiled = _rows(events, Policy(), True, monkeypatch)
    assert compiled == python
    reasons = collections.Counter(r.reason for r in python)
    assert all(reasons[g] > 100 for g in (GapReason.NONE, GapReason.CHECKSUM_MISMATCH, GapReason.INVALIDATED,
                                          GapReason.TENANT_MISMATCH, GapReason.SPECULATIVE_ROLLBACK)), reasons
    assert sum(r.restore_host_bytes > 0 for r in python) > 100 and sum(r.restore_disk_bytes > 0 for r in python) > 100


@pytest.mark.parametrize("native", [False, True], ids=["python", "compiled"])
def test_a_lease_ends_at_its_expiry_time_and_key_zero_names_no_block(native: bool,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Edges the drawn streams reach rarely, pinned for both states: a lookup at exactly the
    lease's expiry finds it expired, and a chain's key 0 is never a held block."""
    base = dict(engine="vllm", instance="i", model="dense", component=ComponentKind.FULL_ATTENTION, source_id=1)
    events = [
        Event(kind=EventKind.COMMIT, ts_ns=BASE, seq=0, tier=Tier.DEVICE, block_key=1, more_keys=[2],
              lease_expiry_ns=BASE + 10, **base),
        Event(kind=EventKind.COMMIT, ts_ns=BASE, seq=1, tier=Tier.DEVICE, block_key=0, **base),
        Event(kind=EventKind.LOOKUP, ts_ns=BASE + 9, seq=2, request_id="before", prompt_tokens=5,
              group_block_keys=[[1, 2]], **base),
        Event(kind=EventKind.LOOKUP, ts_ns=BASE + 10, seq=3, request_id="at", prompt_tokens=5,
              group_block_keys=[[1, 2]], **base),
        Event(kind=EventKind.LOOKUP, ts_ns=BASE + 10, seq=4, request_id="zero", prompt_tokens=5,
              group_block_keys=[[0, 1]], **base),
    ]
    rows = {r.request_id: r for r in _rows(events, Policy(), native, monkeypatch)}
    assert (rows["before"].recoverable_hit_tokens, rows["before"].reason) == (4, GapReason.NONE)
    assert (rows["at"].logical_hit_tokens, rows["at"].recoverable_hit_tokens, rows["at"].reason) == \
        (4, 0, GapReason.LEASE_EXPIRED)
    assert rows["zero"].logical_hit_tokens == 0


@pytest.mark.parametrize("native", [False, True], ids=["python", "compiled"])
def test_keys_in_tuples_or_any_sequence_are_read(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Shims build events in process with whatever sequence their engine hands them (SGLang's
    and LMCache's give tuples): a run's keys and a lookup's chains are read from any of them."""
    base = dict(engine="sglang", instance="i", model="dense", component=ComponentKind.FULL_ATTENTION, source_id=1)
    events = [
        Event(kind=EventKind.COMMIT, ts_ns=BASE, seq=0, tier=Tier.DEVICE, block_key=1, more_keys=(2, 3), **base),
        Event(kind=EventKind.EVICT, ts_ns=BASE + 1, seq=1, tier=Tier.DEVICE, block_key=3, more_keys=range(4, 5),
              **base),
        Event(kind=EventKind.LOOKUP, ts_ns=BASE + 2, seq=2, request_id="tuple", prompt_tokens=9,
              group_block_keys=((1, 2, 3, 4),), **base),
        Event(kind=EventKind.LOOKUP, ts_ns=BASE + 3, seq=3, request_id="range", prompt_tokens=9,
              group_block_keys=[range(1, 5)], **base),
    ]  # type: ignore[arg-type]
    rows = {r.request_id: r for r in _rows(events, Policy(), native, monkeypatch)}
    assert rows["tuple"].logical_hit_tokens == rows["range"].logical_hit_tokens == 4


def test_a_snapshot_of_the_earlier_format_still_resumes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Snapshots stored before the objects were packed (kvts2: every object a msgpack array)
    are read as they were, by either state."""
    import base64
    import zlib

    events = long_stream()
    cut = len(events) // 2
    whole = _rows(events, Policy(), True, monkeypatch)
    first = Reconstructor(BOOK, Policy())
    done = [r for e in events[:cut] for r in first.feed(e)]
    row = snapshot.take(first, events[cut - 1], snapshot.fingerprint(BOOK, Policy()))
    old = b"kvts2" + zlib.compress(msgspec.msgpack.encode(first.capture()))
    row = msgspec.structs.replace(row, state=base64.b64encode(old).decode())
    for native in (True, False):
        monkeypatch.setenv("KVTRACE_NATIVE", "1" if native else "0")
        rest = list(snapshot.resume(row, BOOK, Policy()).run(events[cut:]))
        assert sorted(done + rest, key=_key) == sorted(whole, key=_key)


def test_a_snapshot_whose_records_name_what_is_not_there_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A damaged snapshot (a record's table id past the stored list) is refused with a reason,
    by either state, never loaded half-way: the run then reads the history instead."""
    import base64
    import zlib

    events = long_stream()[:2000]
    rec = Reconstructor(BOOK, Policy())
    for e in events:
        rec.feed(e)
    row = snapshot.take(rec, events[-1], snapshot.fingerprint(BOOK, Policy()))
    payload = base64.b64decode(row.state)
    stored = msgspec.msgpack.decode(zlib.decompress(payload[5:]))
    assert stored[1][0] and stored[1][3]  # tables and records
    stored[1][0] = []  # the tables the records name, gone
    bad = payload[:5] + zlib.compress(msgspec.msgpack.encode(stored))
    row = msgspec.structs.replace(row, state=base64.b64encode(bad).decode())
    for native in (True, False):
        monkeypatch.setenv("KVTRACE_NATIVE", "1" if native else "0")
        with pytest.raises(snapshot.SnapshotError, match="out of range"):
            snapshot.resume(row, BOOK, Policy())
