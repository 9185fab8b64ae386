"""The reconstructor's live objects stay out of the garbage collector's way: with a million of
them, a collector that walked each one made up half of the time spent applying events."""

from __future__ import annotations

import gc

import pytest

from kvtrace.analysis import snapshot
from kvtrace.analysis.evaluate import Policy
from kvtrace.analysis.native_state import NativeState, available
from kvtrace.analysis.reconstruct import Reconstructor
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import ComponentKind, EventKind, Tier
from kvtrace.schema.recipes import load_recipe


def _events() -> list[Event]:
    base = dict(engine="vllm", instance="i", model="m", component=ComponentKind.FULL_ATTENTION, block_size=16)
    return [
        Event(kind=EventKind.COMMIT, ts_ns=1, seq=0, tier=Tier.DEVICE, block_key=1, more_keys=[2, 3, 4], **base),
        Event(kind=EventKind.OFFLOAD, ts_ns=2, seq=1, src_tier=Tier.DEVICE, dst_tier=Tier.HOST, block_key=1,
              more_keys=[2], **base),
        Event(kind=EventKind.EVICT, ts_ns=3, seq=2, tier=Tier.DEVICE, block_key=2, more_keys=[3], **base),
        Event(kind=EventKind.LOOKUP, ts_ns=4, seq=3, request_id="r", prompt_tokens=80,
              group_block_keys=[[1, 2, 3, 4, 5]], **base),
    ]


def _untracked(rec: Reconstructor) -> None:
    objects = dict(rec.state.items())
    if isinstance(rec.state, NativeState):  # held in C: nothing there for the collector to walk
        assert not gc.is_tracked(rec.state._core)
        return
    assert objects
    assert not any(map(gc.is_tracked, rec.state.tables.values()))
    for obj in objects.values():
        assert not gc.is_tracked(obj) and not gc.is_tracked(obj.copies), obj
        assert obj.commit is None or not gc.is_tracked(obj.commit)


@pytest.mark.parametrize("native", [False, True], ids=["python", "compiled"])
def test_live_objects_are_never_tracked_by_the_garbage_collector(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTRACE_NATIVE", "1" if native else "0")
    assert available() == native  # the compiled state is built wherever the tests run
    rec = Reconstructor(load_recipe("dense"))
    assert isinstance(rec.state, NativeState) == native
    events = _events()
    for event in events:
        rec.feed(event)
    _untracked(rec)
    tiers = {key[2]: set(obj.copies) for key, obj in rec.state.items()}
    assert tiers == {1: {"device", "host"}, 2: {"host"}, 4: {"device"}}  # 3 lost its only copy
    (result,) = rec.finish()
    # Blocks 1 and 2 held (2 on the host only), 3 gone: a hit of two blocks, one to restore.
    assert (result.logical_hit_tokens, result.recoverable_hit_tokens, result.resident_hit_tokens) == (32, 32, 16)

    # The same after a snapshot: what a resumed run decodes is as untracked.
    again = Reconstructor(load_recipe("dense"))
    for event in events[:3]:
        again.feed(event)
    row = snapshot.take(again, events[2], snapshot.fingerprint(load_recipe("dense"), Policy()))
    resumed = snapshot.resume(row, load_recipe("dense"), Policy())
    _untracked(resumed)
    resumed.feed(events[3])
    assert resumed.finish() == [result]
