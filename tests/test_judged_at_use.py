"""A lookup is judged again when its adopt arrives, unless nothing could have changed between:
the reconstructor skips the second judgement only when no state event of the instance came in
between and no object of the instance has a lease. These cases pin what must still change the
verdict at use, with no state event in between or with one."""

from __future__ import annotations

from kvtrace.analysis.reconstruct import reconstruct
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import ComponentKind, EventKind, Tier
from kvtrace.schema.recipes import dense
from kvtrace.schema.verdicts import GapReason

BASE = dict(engine="vllm", instance="i", model="m", component=ComponentKind.FULL_ATTENTION, block_size=16)


def _run(commit_lease: int, between: list[Event], adopt_ts: int = 300, tenant: str = "") -> list:
    events = [
        Event(kind=EventKind.COMMIT, ts_ns=100, seq=0, tier=Tier.DEVICE, block_key=1, more_keys=[2],
              token_start=0, token_end=32, lease_expiry_ns=commit_lease, tenant=tenant, **BASE),
        Event(kind=EventKind.LOOKUP, ts_ns=120, seq=1, request_id="r", prompt_tokens=40,
              group_block_keys=[[1, 2, 3]], reported_hit_tokens=32, **BASE),
        *between,
        Event(kind=EventKind.ADOPT, ts_ns=adopt_ts, seq=9, request_id="r", reused_tiers=[Tier.DEVICE],
              reused_tokens=[32], recomputed_tokens=8, **BASE),
    ]
    return reconstruct(events, dense())


def test_a_lease_that_ends_between_lookup_and_adopt_with_no_event_between():
    (row,) = _run(commit_lease=200, between=[])
    assert row.logical_hit_tokens == 32
    assert row.recoverable_hit_tokens == 0
    assert row.reason is GapReason.CHANGED_BEFORE_USE
    assert row.unsafe_reuse


def test_a_lease_still_running_at_the_adopt():
    (row,) = _run(commit_lease=10_000, between=[])
    assert row.recoverable_hit_tokens == 32 and not row.unsafe_reuse and row.reason is GapReason.NONE


def test_an_eviction_between_lookup_and_adopt():
    evict = Event(kind=EventKind.EVICT, ts_ns=150, seq=2, tier=Tier.DEVICE, block_key=2, **BASE)
    (row,) = _run(commit_lease=0, between=[evict])
    assert row.recoverable_hit_tokens == 16
    assert row.reason is GapReason.CHANGED_BEFORE_USE and row.unsafe_reuse


def test_an_event_of_another_instance_between_changes_nothing():
    other = Event(kind=EventKind.EVICT, ts_ns=150, seq=2, tier=Tier.DEVICE, block_key=2,
                  **{**BASE, "instance": "j"})
    (row,) = _run(commit_lease=0, between=[other])
    assert row.recoverable_hit_tokens == 32 and not row.unsafe_reuse


def test_reuse_of_another_tenants_blocks_is_flagged():
    (row,) = _run(commit_lease=0, between=[], tenant="a")
    assert row.cross_tenant
    (row,) = _run(commit_lease=0, between=[])
    assert not row.cross_tenant
