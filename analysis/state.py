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
  bounded by live objects); the SQL paths number these lives ("generations") to match.

`ord` is the event's position in the stream, which totally orders events.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter

import msgspec

from kvtrace.schema.events import Event
from kvtrace.schema.kinds import OBJECT_KINDS, EventKind, Reason, Tier

ObjectKey = tuple[str, int, int]  # instance, group_id, block_key

IDENTITY_FIELDS = ("model", "model_revision", "adapter", "transform", "kv_dtype", "layout", "epoch")
"""Fields that must match between the request and the state it reuses (tenant is separate)."""

_WRITES = frozenset({EventKind.CREATE, EventKind.COMMIT, EventKind.OFFLOAD, EventKind.LOAD})
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
    copies: dict[Tier, Copy] = msgspec.field(default_factory=dict)
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

    objects: dict[ObjectKey, ObjectState] = field(default_factory=dict)
    bulk: dict[str, dict[BulkKey, tuple[int, Reason]]] = field(default_factory=dict)

    def apply(self, event: Event, ord: int) -> None:
        kind = event.kind
        if kind not in OBJECT_KINDS:  # requests, usage samples and probes change no state
            return
        if kind is EventKind.INVALIDATE and event.block_key == 0:
            scopes = self.bulk.setdefault(event.instance, {})
            scopes[(event.tier, event.tenant, event.adapter)] = (ord, event.reason)
            return
        if event.more_keys:  # a run: the same fact for each block
            for block_key in (event.block_key, *event.more_keys):
                self._apply_one(event, kind, (event.instance, event.group_id, block_key), ord)
        else:
            self._apply_one(event, kind, (event.instance, event.group_id, event.block_key), ord)

    def _apply_one(self, event: Event, kind: EventKind, key: ObjectKey, ord: int) -> None:
        obj = self.objects.get(key)
        if kind in _WRITES:
            if obj is None:
                obj = self.objects[key] = ObjectState()
            transfer = kind in _TRANSFERS
            tier = event.dst_tier if transfer else event.tier
            obj.copies[tier] = Copy(kind is not EventKind.CREATE, event.nbytes, event.checksum, ord)
            if kind is EventKind.COMMIT:
                obj.commit = Commit(identity_of(event), event.tenant, event.checksum, event.nbytes)
                obj.lease_expiry_ns = event.lease_expiry_ns
            elif transfer and event.lease_expiry_ns:
                obj.lease_expiry_ns = event.lease_expiry_ns
        elif obj is None:
            return  # an eviction or invalidation of something not held anywhere
        elif kind is EventKind.EVICT:
            obj.copies.pop(event.tier, None)
            if not obj.copies:
                del self.objects[key]
        elif kind is EventKind.INVALIDATE:
            obj.invalidated_ord, obj.invalidated_reason = ord, event.reason

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

    def get(self, instance: str, group_id: int, block_key: int) -> ObjectState | None:
        return self.objects.get((instance, group_id, block_key))
