"""The state of every cached object, rebuilt by applying lifecycle events in order.

An object is one block of one cache group on one instance: (instance, group_id, block_key).
Its residency is tracked per tier from the last event that touched that tier, which is also
how the SQL paths compute it (an as-of join per tier), so the three paths agree by design.
Memory is bounded by live objects: an object with no copy left is forgotten.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtrace.schema.events import Event
from kvtrace.schema.kinds import EventKind, Reason, Tier

ObjectKey = tuple[str, int, int]  # instance, group_id, block_key

IDENTITY_FIELDS = ("model", "model_revision", "adapter", "transform", "kv_dtype", "layout", "epoch")
"""Fields that must match between the request and the state it reuses (tenant is separate)."""


@dataclass(slots=True)
class Copy:
    """One tier's copy: committed (published) or still being written."""

    committed: bool
    nbytes: int
    checksum: int


@dataclass(slots=True)
class ObjectState:
    copies: dict[Tier, Copy] = field(default_factory=dict)
    token_start: int = 0
    token_end: int = 0
    identity: tuple[object, ...] = ()
    tenant: str = ""
    lease_expiry_ns: int = 0
    checksum: int = 0  # checksum at commit; copies that disagree mark the object corrupt
    corrupt: bool = False
    invalidated: Reason = Reason.NONE
    committed_ns: int = 0

    @property
    def committed(self) -> bool:
        return any(c.committed for c in self.copies.values())


def identity_of(event: Event) -> tuple[object, ...]:
    return tuple(getattr(event, name) for name in IDENTITY_FIELDS)


@dataclass(slots=True)
class CacheState:
    """Every live object, and bulk invalidations that apply to objects committed before them."""

    objects: dict[ObjectKey, ObjectState] = field(default_factory=dict)

    def apply(self, event: Event) -> None:
        kind = event.kind
        if kind is EventKind.LOOKUP or kind is EventKind.ADOPT:
            return
        if kind is EventKind.INVALIDATE and event.block_key == 0:
            self._invalidate_all(event)
            return
        key = (event.instance, event.group_id, event.block_key)
        obj = self.objects.get(key)
        if kind is EventKind.CREATE or kind is EventKind.COMMIT:
            if obj is None or obj.invalidated is not Reason.NONE and kind is EventKind.CREATE:
                obj = ObjectState()
                self.objects[key] = obj
            committed = kind is EventKind.COMMIT
            obj.copies[event.tier] = Copy(committed, event.nbytes, event.checksum)
            obj.token_start, obj.token_end = event.token_start, event.token_end
            if committed:
                obj.identity = identity_of(event)
                obj.tenant = event.tenant
                obj.lease_expiry_ns = event.lease_expiry_ns
                obj.checksum = event.checksum
                obj.corrupt = False
                obj.invalidated = Reason.NONE
                obj.committed_ns = event.ts_ns
            return
        if obj is None:
            return  # a transfer or eviction of something we never saw created
        if kind is EventKind.OFFLOAD or kind is EventKind.LOAD:
            src = obj.copies.get(event.src_tier)
            committed = src.committed if src is not None else obj.committed
            obj.copies[event.dst_tier] = Copy(committed, event.nbytes or (src.nbytes if src else 0), event.checksum)
            if event.checksum and obj.checksum and event.checksum != obj.checksum:
                obj.corrupt = True
            if event.lease_expiry_ns:
                obj.lease_expiry_ns = event.lease_expiry_ns
        elif kind is EventKind.EVICT:
            obj.copies.pop(event.tier, None)
            if not obj.copies:
                del self.objects[key]
        elif kind is EventKind.INVALIDATE:
            obj.invalidated = event.reason

    def _invalidate_all(self, event: Event) -> None:
        """A bulk invalidation: every object on the instance (or tier) matching its identity."""
        for (instance, _, _), obj in self.objects.items():
            if instance != event.instance:
                continue
            if event.tier is not Tier.NONE and event.tier not in obj.copies:
                continue
            if event.tenant and obj.tenant != event.tenant:
                continue
            if event.adapter and obj.identity and obj.identity[2] != event.adapter:
                continue
            obj.invalidated = event.reason

    def get(self, instance: str, group_id: int, block_key: int) -> ObjectState | None:
        return self.objects.get((instance, group_id, block_key))
