"""The state of every cached object, rebuilt by applying lifecycle events in stream order.

An object is one block of one cache group on one instance: (instance, group_id, block_key).
The rules are chosen so that each fact is "the last event of some kind before the lookup",
which is exactly what an as-of join computes; that is how the ClickHouse and DuckDB paths
reproduce this state without replaying it (see `analysis.sql`):

- each tier's copy is the last create / commit / transfer-in / evict on that tier; a copy is
  committed when written by a commit or a transfer (engines move only published blocks);
- identity, tenant and the reference checksum come from the object's last commit; the lease
  from its last commit or leased transfer;
- a copy is invalidated when an invalidation (of the object, or a bulk one matching it) came
  after the copy was written: a copy written later holds fresh state;
- a copy whose checksum differs from the committed one is corrupt, the others are not;
- an object that loses its last copy is forgotten, and its history with it (so memory is
  bounded by live objects); the SQL paths mark where each life began to match.

`ord` is the event's position in the stream, which totally orders events.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Protocol

import msgspec

from kvtrace.schema.events import Event
from kvtrace.schema.kinds import OBJECT_KINDS, EventKind, Reason, Tier

ObjectKey = tuple[str, int, int]  # instance, group_id, block_key

IDENTITY_FIELDS = ("model", "model_revision", "adapter", "transform", "kv_dtype", "layout", "epoch")
"""Fields that must match between the request and the state it reuses (tenant is separate)."""

_WRITES = frozenset({EventKind.CREATE, EventKind.COMMIT, EventKind.OFFLOAD, EventKind.LOAD})
_TIER_KEY = {tier: str(tier.value) for tier in Tier}  # ObjectState.copies' keys: see there
_TRANSFERS = frozenset({EventKind.OFFLOAD, EventKind.LOAD})


# msgspec Structs, laid out as arrays: the live objects are what a snapshot stores (see
# `analysis.snapshot`), and Structs decode several times faster than dataclasses.
class Copy(msgspec.Struct, array_like=True, gc=False):
    """One tier's copy, as its last write left it."""

    committed: bool
    nbytes: int
    checksum: int
    ord: int


class Commit(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """What the object's last commit published."""

    identity: tuple[str, str, str, str, str, str, int]  # IDENTITY_FIELDS
    tenant: str
    checksum: int
    nbytes: int


class ObjectState(msgspec.Struct, array_like=True, gc=False):
    # Keyed by the tier's value, a plain str: a dict whose keys and values the garbage collector
    # cannot track stays untracked itself, so a million live objects add nothing to each full
    # collection (keyed by the enum, every one was tracked: half of `apply`'s time went to the
    # collector). Look-ups by Tier still work (a StrEnum hashes and compares as its value).
    copies: dict[str, Copy] = msgspec.field(default_factory=dict)
    commit: Commit | None = None
    lease_expiry_ns: int = 0
    invalidated_ord: int = 0
    invalidated_reason: Reason = Reason.NONE

    @property
    def tenant(self) -> str:
        return self.commit.tenant if self.commit is not None else ""

    @property
    def adapter(self) -> str:
        return str(self.commit.identity[2]) if self.commit is not None else ""


identity_of: Callable[[Event], tuple[str, str, str, str, str, str, int]] = attrgetter(*IDENTITY_FIELDS)
"""An event's IDENTITY_FIELDS as one tuple, read in C (a tenth of the live path's time as a
generator)."""


BulkKey = tuple[Tier, str, str]  # tier, tenant, adapter ("" / NONE: any)


@dataclass(slots=True)
class CacheState:
    """Every live object, and the latest bulk invalidation of each scope per instance.

    Bulk invalidations are kept by scope (tier, tenant, adapter) rather than applied to every
    object at once: an invalidation is an O(1) update, and the few scopes bound the memory.
    """

    # Live objects, one table per (instance, group) keyed by block key: a lookup or a run reads
    # a group's table once, then one int-keyed get per block (a 3-tuple built and hashed per
    # block was the largest single cost of judging a lookup).
    tables: dict[tuple[str, int], dict[int, ObjectState]] = field(default_factory=dict)
    bulk: dict[str, dict[BulkKey, tuple[int, Reason]]] = field(default_factory=dict)
    # What lets a verdict skip work it would redo for nothing (see `Reconstructor._result`): per
    # instance, how many state events it has had, whether any named a lease (then validity
    # changes with time alone), and the tenants its objects may carry ("" for an object no
    # commit published).
    changes: dict[str, int] = field(default_factory=dict)
    leased: set[str] = field(default_factory=set)
    tenants: dict[str, set[str]] = field(default_factory=dict)
    # The fleet index (kept when `fleet`, see `analysis.fleet`): which instances hold each block
    # key, per (model, group), as a bit mask of instance slots. It changes only when an object is
    # born or dies, so it costs nothing per event beyond those; a lookup finds the instances that
    # could hold any of its prefix with one get per block, not a scan of every instance.
    fleet: bool = False
    slots: dict[str, int] = field(default_factory=dict)  # instance -> its bit in the masks
    names: list[str] = field(default_factory=list)  # slot -> instance
    models: dict[str, str] = field(default_factory=dict)  # instance -> the model its blocks are indexed under
    holders: dict[tuple[str, int], dict[int, int]] = field(default_factory=dict)

    def apply(self, event: Event, ord: int) -> None:
        kind = event.kind
        if kind not in OBJECT_KINDS:  # requests, usage samples and probes change no state
            return
        changes = self.changes
        changes[event.instance] = changes.get(event.instance, 0) + 1
        if kind is EventKind.INVALIDATE and event.block_key == 0:
            scopes = self.bulk.setdefault(event.instance, {})
            scopes[(event.tier, event.tenant, event.adapter)] = (ord, event.reason)
            return
        # A run (more_keys) is the same fact for each of its blocks: what the fact writes is
        # built once and shared (Copy and Commit are never changed after they are made).
        instance = event.instance
        table = self.tables.get(scope := (instance, event.group_id))
        keys = (event.block_key, *event.more_keys) if event.more_keys else (event.block_key,)
        if kind in _WRITES:
            if table is None:
                table = self.tables[scope] = {}
            transfer = kind in _TRANSFERS
            tier = _TIER_KEY[event.dst_tier if transfer else event.tier]
            copy = Copy(kind is not EventKind.CREATE, event.nbytes, event.checksum, ord)
            # A commit sets the lease it names, even none; a transfer only one it names.
            commit = Commit(identity_of(event), event.tenant, event.checksum, event.nbytes) \
                if kind is EventKind.COMMIT else None
            lease = event.lease_expiry_ns if commit is not None or transfer else 0
            if lease:
                self.leased.add(instance)
            tenants = self.tenants.get(instance)
            if tenants is None:
                tenants = self.tenants[instance] = set()
            tenants.add(event.tenant if commit is not None else "")
            fleet, hold, bit = self.fleet, None, 0  # the index's table, read at the first birth only
            for block_key in keys:
                obj = table.get(block_key)
                if obj is None:
                    table[block_key] = ObjectState({tier: copy}, commit, lease)
                    if fleet:
                        if hold is None:
                            hold, bit = self._index(instance, event.model, event.group_id)
                        hold[block_key] = hold.get(block_key, 0) | bit
                else:
                    obj.copies[tier] = copy
                    if commit is not None:
                        obj.commit, obj.lease_expiry_ns = commit, lease
                    elif lease:
                        obj.lease_expiry_ns = lease
        elif table is None:  # an eviction or invalidation of something not held anywhere
            return
        elif kind is EventKind.EVICT:
            tier = _TIER_KEY[event.tier]
            fleet, hold, bit = self.fleet, None, 0
            for block_key in keys:
                obj = table.get(block_key)
                if obj is not None:  # else an eviction of something not held anywhere
                    copies = obj.copies
                    copies.pop(tier, None)
                    if not copies:
                        del table[block_key]
                        if fleet:
                            if hold is None:
                                hold, bit = self._index(instance, event.model, event.group_id)
                            if left := hold.pop(block_key, 0) & ~bit:
                                hold[block_key] = left
        elif kind is EventKind.INVALIDATE:
            reason = event.reason
            for block_key in keys:
                obj = table.get(block_key)
                if obj is not None:
                    obj.invalidated_ord, obj.invalidated_reason = ord, reason

    def _index(self, instance: str, model: str, group_id: int) -> tuple[dict[int, int], int]:
        return fleet_index(self, instance, model, group_id)

    def invalidation(self, instance: str, obj: ObjectState, tier: Tier) -> tuple[int, Reason]:
        """The latest invalidation that applies to the object's copy on `tier`: (ord, reason)."""
        best = (obj.invalidated_ord, obj.invalidated_reason)
        scopes = self.bulk.get(instance)
        if scopes:
            tenant, adapter = obj.tenant, obj.adapter
            for t in {Tier.NONE, tier}:
                for n in {"", tenant}:
                    for a in {"", adapter}:
                        hit = scopes.get((t, n, a))
                        if hit is not None and hit[0] > best[0]:
                            best = hit
        return best

    def changes_of(self, instance: str) -> int:
        """How many state events the instance has had: equal counts, no change between."""
        return self.changes.get(instance, 0)

    def get(self, instance: str, group_id: int, block_key: int) -> ObjectState | None:
        table = self.tables.get((instance, group_id))
        return table.get(block_key) if table is not None else None

    def tenant_of(self, instance: str, group_id: int, block_key: int) -> str | None:
        """The tenant of the object's last commit ("" if none), None when no such object."""
        obj = self.get(instance, group_id, block_key)
        return None if obj is None else obj.tenant

    def object_count(self) -> int:
        return sum(map(len, self.tables.values()))

    def items(self) -> Iterator[tuple[ObjectKey, ObjectState]]:
        """Every live object with its (instance, group_id, block_key)."""
        for (instance, group), table in self.tables.items():
            for block_key, obj in table.items():
                yield (instance, group, block_key), obj


class _Indexed(Protocol):
    slots: dict[str, int]
    names: list[str]
    models: dict[str, str]
    holders: dict[tuple[str, int], dict[int, int]]


def fleet_index(state: _Indexed, instance: str, model: str, group_id: int) -> tuple[dict[int, int], int]:
    """The fleet index's table for the instance's blocks of `group_id`, and the instance's bit.
    An instance's blocks are indexed under the model of its first event that wrote one (the
    Python and the compiled state keep the index the same way)."""
    slot = state.slots.get(instance)
    if slot is None:
        slot = state.slots[instance] = len(state.names)
        state.names.append(instance)
        state.models[instance] = model
    scope = (state.models[instance], group_id)
    hold = state.holders.get(scope)
    if hold is None:
        hold = state.holders[scope] = {}
    return hold, 1 << slot
