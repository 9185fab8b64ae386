"""The fleet view of a lookup, case by case: which instances are judged, which wins a tie, what
a dead object leaves in the index, and what a model or a namespace keeps apart."""

from __future__ import annotations

import msgspec

from kvtrace.analysis.evaluate import Policy
from kvtrace.analysis.fleet import candidates
from kvtrace.analysis.reconstruct import Reconstructor, reconstruct
from kvtrace.analysis.snapshot import fingerprint, resume, take
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import ComponentKind, EventKind, Tier
from kvtrace.schema.recipes import GroupSpec, Recipe, dense
from kvtrace.schema.verdicts import GapReason

FLEET = Policy(fleet=True)
BASE = dict(engine="vllm", model="m", component=ComponentKind.FULL_ATTENTION, block_size=16)


def _commit(instance: str, keys: list[int], ts: int, tier: Tier = Tier.DEVICE, **kw) -> Event:
    return Event(kind=EventKind.COMMIT, ts_ns=ts, seq=ts, instance=instance, tier=tier, block_key=keys[0],
                 more_keys=keys[1:], token_start=0, token_end=16 * len(keys), **{**BASE, **kw})


def _lookup(instance: str, ts: int, keys: list[int], **kw) -> Event:
    return Event(kind=EventKind.LOOKUP, ts_ns=ts, seq=ts, instance=instance, request_id=f"r{ts}",
                 prompt_tokens=16 * len(keys) + 1, group_block_keys=[keys], **{**BASE, **kw})


def _one(events: list[Event], recipe: Recipe | None = None, policy: Policy = FLEET):
    (row,) = reconstruct(events, recipe or dense(), policy)
    return row


def test_the_instance_holding_the_longer_prefix_is_the_best_even_one_block_past_here():
    chain = [1, 2, 3, 4]
    row = _one([_commit("a", chain[:2], 1), _commit("b", chain[:3], 2), _commit("c", chain[:1], 3),
                _lookup("a", 10, chain)])
    assert (row.logical_hit_tokens, row.recoverable_hit_tokens) == (32, 32)
    assert (row.seen_anywhere_tokens, row.recoverable_anywhere_tokens, row.best_instance) == (48, 48, "b")
    assert row.routing_regret_tokens == 16 and row.fleet_reason is GapReason.NONE


def test_a_tie_goes_to_the_lookup_s_own_instance_then_to_the_first_by_name():
    chain = [1, 2, 3]
    row = _one([_commit("c", chain, 1), _commit("b", chain, 2), _commit("a", chain[:1], 3), _lookup("a", 10, chain)])
    assert (row.recoverable_anywhere_tokens, row.best_instance, row.routing_regret_tokens) == (48, "b", 32)
    row = _one([_commit("c", chain, 1), _commit("a", chain, 2), _lookup("a", 10, chain)])
    assert (row.recoverable_anywhere_tokens, row.best_instance, row.routing_regret_tokens) == (48, "a", 0)
    # c is judged first (it holds a block more), but its third is uncommitted: b ties it, by name.
    created = Event(kind=EventKind.CREATE, ts_ns=2, seq=2, instance="c", tier=Tier.DEVICE, block_key=3,
                    token_start=32, token_end=48, **BASE)
    row = _one([_commit("c", chain[:2], 1), created, _commit("b", chain[:2], 3), _lookup("a", 10, chain)])
    assert (row.seen_anywhere_tokens, row.recoverable_anywhere_tokens, row.best_instance) == (48, 32, "b")


def test_seen_elsewhere_but_not_recoverable_there_names_the_reason_there():
    chain = [1, 2, 3]
    created = Event(kind=EventKind.CREATE, ts_ns=2, seq=2, instance="b", tier=Tier.DEVICE, block_key=3,
                    token_start=32, token_end=48, **BASE)
    row = _one([_commit("a", chain[:1], 1), _commit("b", chain[:2], 1), created, _lookup("a", 10, chain)])
    assert (row.seen_anywhere_tokens, row.recoverable_anywhere_tokens, row.best_instance) == (48, 32, "b")
    assert row.fleet_reason is GapReason.UNCOMMITTED


def test_a_block_evicted_everywhere_leaves_the_index_and_other_models_and_namespaces_stay_apart():
    chain = [1, 2]
    evict = Event(kind=EventKind.EVICT, ts_ns=5, seq=5, instance="b", tier=Tier.DEVICE, block_key=1, more_keys=[2],
                  **BASE)
    rec = Reconstructor(dense(), FLEET)
    for e in (_commit("b", chain, 1), _commit("c", chain, 2, model="other"), evict):
        rec.feed(e)
    lookup = _lookup("a", 10, chain)
    assert candidates(rec.state, dense(), lookup, 100) == []  # b's blocks died, c is another model
    assert all(b not in hold or hold[b] for hold in rec.state.holders.values() for b in chain)
    # Another tenant's blocks on b: seen there by hash, not recoverable for this tenant.
    row = _one([_commit("b", chain, 1, tenant="t2"), _lookup("a", 10, chain, tenant="t1")])
    assert (row.seen_anywhere_tokens, row.recoverable_anywhere_tokens) == (32, 0)
    assert row.fleet_reason is GapReason.TENANT_MISMATCH and row.best_instance == ""


def test_a_mamba_checkpoint_elsewhere_is_found_from_its_one_block():
    recipe = Recipe(name="m", groups=(GroupSpec(group_id=0, component=ComponentKind.MAMBA, block_size=16),))
    mamba = {**BASE, "component": ComponentKind.MAMBA}
    commit = Event(kind=EventKind.COMMIT, ts_ns=1, seq=1, instance="b", tier=Tier.HOST, block_key=3,
                   token_start=32, token_end=48, nbytes=4096, **mamba)
    lookup = Event(kind=EventKind.LOOKUP, ts_ns=10, seq=10, instance="a", request_id="r", prompt_tokens=60,
                   group_block_keys=[[1, 2, 3]], **mamba)
    row = _one([commit, lookup], recipe)
    assert (row.seen_anywhere_tokens, row.recoverable_anywhere_tokens, row.best_instance) == (48, 48, "b")
    assert row.best_restore_bytes == 4096  # on b, the checkpoint must come back from host memory


def test_without_the_fleet_view_each_instance_is_its_own_fleet():
    chain = [1, 2, 3]
    row = _one([_commit("b", chain, 1), _commit("a", chain[:1], 2), _lookup("a", 10, chain)], policy=Policy())
    assert (row.seen_anywhere_tokens, row.recoverable_anywhere_tokens, row.best_instance) == (16, 16, "a")
    assert row.routing_regret_tokens == 0


def test_the_index_travels_in_a_snapshot_and_the_fleet_names_its_own_fingerprint():
    chain = [1, 2, 3]
    events = [_commit("b", chain, 1), _commit("a", chain[:1], 2), _lookup("a", 10, chain)]
    rec = Reconstructor(dense(), FLEET)
    rec.feed(events[0])
    row = take(rec, events[0], fingerprint(dense(), FLEET))
    assert fingerprint(dense(), FLEET) != fingerprint(dense(), Policy())
    resumed = resume(row, dense(), FLEET)
    assert resumed.state.holders == rec.state.holders and resumed.state.fleet
    out = [r for e in events[1:] for r in resumed.feed(e)] + resumed.finish()
    assert msgspec.structs.asdict(out[0]) == msgspec.structs.asdict(_one(events))
