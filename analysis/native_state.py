"""`CacheState` and `evaluate` with the per-block work compiled (`analysis/_native.c`).

The rules are `analysis.state`'s and `analysis.evaluate`'s, unchanged: this class keeps the
same facts in flat C arrays instead of a Struct per object, so a commit run or a lookup costs a
probe per block instead of a dict get, a Struct and attribute reads per block. The
reconstructor uses it where the extension was built; `KVTRACE_NATIVE=0` turns it off. The fleet
view's index (which instances hold a block key) stays in Python, kept from the births and deaths
the core reports: it changes only when an object is born or dies. Every stream the
tests draw gives the same rows through both (tests/test_native_state.py).

Strings stay on this side: instances, (instance, group) tables, tenants, adapters and identity
tuples become small ints here, once each, and a gap's detail text is written here from the
codes the core returns.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import msgspec
import numpy as np

from kvtrace.analysis.evaluate import Evaluation, Policy, evaluate, hit_cap
from kvtrace.analysis.packed import REASONS as _REASONS
from kvtrace.analysis.packed import TIERS as _TIERS
from kvtrace.analysis.packed import PackedObjects, records
from kvtrace.analysis.state import (
    IDENTITY_FIELDS,
    CacheState,
    Commit,
    Copy,
    ObjectKey,
    ObjectState,
    fleet_index,
    identity_of,
)
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import OBJECT_KINDS, ComponentKind, EventKind, Reason
from kvtrace.schema.recipes import Recipe
from kvtrace.schema.verdicts import MISSING_REASON, GapReason

try:
    from kvtrace.analysis import _native
except ImportError:  # built where a C compiler was found (setup.py): the Python state serves otherwise
    _native = None  # type: ignore[assignment]

# The core's codes, in its order (`_native.c`'s enums).
_GAPS = (
    GapReason.NONE, GapReason.MISSING_BLOCK, GapReason.WINDOW_OUT_OF_RANGE, GapReason.NO_CHECKPOINT,
    GapReason.MISSING_TAIL, GapReason.INDEXER_OUT_OF_SYNC, GapReason.NOT_RESIDENT, GapReason.LEASE_EXPIRED,
    GapReason.IDENTITY_MISMATCH, GapReason.TENANT_MISMATCH, GapReason.MISALIGNED, GapReason.UNCOMMITTED,
    GapReason.INVALIDATED, GapReason.CHECKSUM_MISMATCH, GapReason.CHANGED_BEFORE_USE,
    GapReason.SPECULATIVE_ROLLBACK,
)
_GAP_CODE = {g: i for i, g in enumerate(_GAPS)}
_TIER_CODE = {t: i for i, t in enumerate(_TIERS)}
_TIER_BY_KEY = {t.value: i for i, t in enumerate(_TIERS)}  # CacheState's copies are keyed by value
_REASON_CODE = {r: i for i, r in enumerate(_REASONS)}
_COMPONENT = {ComponentKind.SLIDING_WINDOW: 1, ComponentKind.MAMBA: 2, ComponentKind.UNCOMPRESSED_TAIL: 3,
              ComponentKind.INDEXER: 4}  # the others cover [0, p): code 0
_KINDS = {EventKind.CREATE: 0, EventKind.COMMIT: 1, EventKind.OFFLOAD: 2, EventKind.LOAD: 3,
          EventKind.INVALIDATE: 4, EventKind.EVICT: 5}  # `_native.c`'s K_ codes
assert set(_KINDS) == OBJECT_KINDS


def evaluate_on(state: CacheState | NativeState, recipe: Recipe, lookup: Event, policy: Policy,
                explain_up_to: int = 0, ts_ns: int | None = None, instance: str | None = None) -> Evaluation:
    """`analysis.evaluate.evaluate` on either state: the lookup taken at `ts_ns` when given, on
    `instance` when given."""
    if isinstance(state, NativeState):
        return state.evaluate(recipe, lookup, policy, explain_up_to, ts_ns, instance)
    if ts_ns is not None:
        lookup = msgspec.structs.replace(lookup, ts_ns=ts_ns)
    return evaluate(state, recipe, lookup, policy, explain_up_to, instance)


def _intern(ids: dict, values: list, value: object) -> int:
    """The id of `value` in (ids, values), added at the end when new (as the core's intern_in)."""
    found = ids.get(value)
    if found is None:
        found = ids[value] = len(values)
        values.append(value)
    return found


def available() -> bool:
    """Is the compiled state built here, and not turned off (KVTRACE_NATIVE=0)?"""
    return _native is not None and os.environ.get("KVTRACE_NATIVE", "1") != "0"


@dataclass(slots=True)
class NativeState:
    """A `CacheState` whose objects the compiled core holds (the fleet index, when kept, stays here)."""

    shared_tenants: frozenset[str] = frozenset()
    # As in CacheState: state events per instance, instances whose objects named a lease,
    # tenants each instance's objects may carry.
    changes: dict[str, int] = field(default_factory=dict)
    leased: set[str] = field(default_factory=set)
    tenants: dict[str, set[str]] = field(default_factory=dict)
    fleet: bool = False
    # The fleet index, as CacheState keeps it (see there and `analysis.fleet`): kept here, from
    # the births and deaths the core reports, when `fleet`.
    slots: dict[str, int] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)
    models: dict[str, str] = field(default_factory=dict)
    holders: dict[tuple[str, int], dict[int, int]] = field(default_factory=dict)
    _core: object = None
    _strings: dict[str, int] = field(default_factory=lambda: {"": 0})
    _string_list: list[str] = field(default_factory=lambda: [""])
    _identities: dict[tuple, int] = field(default_factory=dict)
    _identity_list: list[tuple] = field(default_factory=list)
    _instances: dict[str, int] = field(default_factory=dict)
    _instance_list: list[str] = field(default_factory=list)
    _tables: dict[tuple[str, int], int] = field(default_factory=dict)
    _table_list: list[tuple[str, int]] = field(default_factory=list)
    _specs: dict[int, tuple[Recipe, tuple, int]] = field(default_factory=dict)
    apply: Callable[[Event, int], None] = field(init=False)

    def __post_init__(self) -> None:
        if _native is None:
            raise RuntimeError("kvtrace's compiled state is not built here")
        shared = tuple(self._string(t) for t in sorted(self.shared_tenants))
        core = self._core = _native.State(_REASON_CODE[Reason.ROLLBACK], shared)
        # The same tables on both sides: ids the core gives out, this side reads, and back.
        core.bind(_KINDS, _TIER_CODE, _REASON_CODE, self._strings, self._string_list, self._tables, self._table_list,
                  self._instances, self._instance_list, self._identities, self._identity_list, self.changes,
                  self.leased, self.tenants)
        if self.fleet:
            core.track()
            self.apply = self._apply_indexed
        else:
            self.apply = core.apply

    def _apply_indexed(self, event: Event, ord: int) -> None:
        """apply, and the fleet index kept: an object born sets its instance's bit under its
        block key, one forgotten clears it (CacheState.apply's rule, from the core's report)."""
        changed = self._core.apply(event, ord)  # type: ignore[attr-defined]
        if changed is None:
            return
        born, died = changed
        if not born and not died:
            return
        hold, bit = fleet_index(self, event.instance, event.model, event.group_id)
        for key in born:
            hold[key] = hold.get(key, 0) | bit
        for key in died:
            if left := hold.pop(key, 0) & ~bit:
                hold[key] = left

    # -- interning -------------------------------------------------------------------------------
    def _string(self, value: str) -> int:
        return _intern(self._strings, self._string_list, value)

    def _identity(self, identity: tuple) -> int:
        found = self._identities.get(identity)
        if found is None:
            found = _intern(self._identities, self._identity_list, identity)
            self._core.identity(found, *map(self._string, identity[:6]), identity[6])  # type: ignore[attr-defined]
        return found

    def _instance(self, instance: str) -> int:
        return _intern(self._instances, self._instance_list, instance)

    def _table(self, scope: tuple[str, int]) -> int:
        return _intern(self._tables, self._table_list, scope)

    # -- CacheState's interface ------------------------------------------------------------------
    # apply(event, ord): `CacheState.apply`, the event's attributes read by the core itself (a
    # Python method here cost more than the work it passes on); bound in __post_init__.

    def changes_of(self, instance: str) -> int:
        return self.changes.get(instance, 0)

    def tenant_of(self, instance: str, group_id: int, block_key: int) -> str | None:
        """The tenant of the object's last commit ("" if none), None when no such object."""
        table = self._tables.get((instance, group_id))
        if table is None:
            return None
        found = self._core.tenant_of(table, block_key)  # type: ignore[attr-defined]
        return None if found is None else self._string_list[found]

    def object_count(self) -> int:
        return self._core.count()  # type: ignore[attr-defined]

    def evaluate(self, recipe: Recipe, lookup: Event, policy: Policy = Policy(), explain_up_to: int = 0,
                 ts_ns: int | None = None, instance: str | None = None) -> Evaluation:
        """`analysis.evaluate.evaluate` on this state, the lookup taken at `ts_ns` when given, on
        `instance` when given (what another instance of the fleet held for it)."""
        cached = self._specs.get(id(recipe))
        if cached is None or cached[0] is not recipe:
            groups = tuple((g.group_id, _COMPONENT.get(g.component, 0), g.block_size, g.window, g.ratio,
                            _GAP_CODE[MISSING_REASON[g.component]]) for g in recipe.groups)
            cached = self._specs[id(recipe)] = (recipe, groups, recipe.alignment)
        _, groups, step = cached
        if instance is None:
            instance = lookup.instance
        tables = self._tables
        args = [self._instances.get(instance, 0xFFFFFFFF), tuple(tables.get((instance, g[0]), -1) for g in groups),
                lookup.group_block_keys, groups, step, hit_cap(lookup, policy), self._identity(identity_of(lookup)),
                self._string(lookup.tenant), lookup.ts_ns if ts_ns is None else ts_ns, explain_up_to]
        try:
            out = self._core.evaluate(*args)  # type: ignore[attr-defined]
        except TypeError:  # the core reads lists and tuples of keys; any sequence serves here
            args[2] = [list(chain) for chain in lookup.group_block_keys]
            out = self._core.evaluate(*args)  # type: ignore[attr-defined]
        logical, recoverable, resident, reason, group, dkind, darg, darg2, group_logical, restore = out
        return Evaluation(
            logical=logical, recoverable=recoverable, resident=resident, reason=_GAPS[reason], reason_group=group,
            reason_detail=self._detail(dkind, darg, darg2, lookup) if dkind else "",
            group_logical=group_logical, restore_bytes={_TIERS[t]: n for t, n in restore},
        )

    def _detail(self, kind: int, a: int, b: int, lookup: Event) -> str:
        """The gap's detail text, as `check_object` and `evaluate` write it."""
        return self._detail_for(kind, a, b, lookup.tenant, identity_of(lookup))

    def _detail_for(self, kind: int, a: int, b: int, tenant: str, identity: tuple) -> str:
        """`_detail` for a lookup of this tenant and identity."""
        if kind == 1:
            return _REASONS[a].value
        if kind == 2:
            return "no commit seen"
        if kind == 3:
            return f"tenant: {self._string_list[a]} != {tenant}"
        if kind == 4:
            return f"{IDENTITY_FIELDS[a]}: {self._identity_list[b][a]} != {identity[a]}"
        if kind == 5:
            return _TIERS[a].value
        if kind == 6:
            return "block beyond the request's key chain"
        return f"logical {a} is not a multiple of {b}"

    # -- to and from the plain state (snapshots) -------------------------------------------------
    def to_cache_state(self, objects: bool = True) -> CacheState:
        """The same facts as a `CacheState` (without the objects, when not `objects`: a snapshot
        stores them packed, see `pack`)."""
        state = CacheState(changes=dict(self.changes), leased=set(self.leased),
                           tenants={k: set(v) for k, v in self.tenants.items()}, fleet=self.fleet,
                           slots=dict(self.slots), names=list(self.names), models=dict(self.models),
                           holders={k: dict(v) for k, v in self.holders.items()})
        rows, scopes = self._core.export(objects)  # type: ignore[attr-defined]
        strings, identities = self._string_list, self._identity_list
        for table, key, copies, has_commit, identity, tenant, _, checksum, nbytes, lease, inv_ord, inv in rows:
            commit = Commit(identities[identity], strings[tenant], checksum, nbytes) if has_commit else None
            copied = {_TIERS[t].value: Copy(bool(c), nb, ck, o) for t, c, nb, ck, o in copies}
            obj = ObjectState(copied, commit, lease, inv_ord, _REASONS[inv])
            state.tables.setdefault(self._table_list[table], {})[key] = obj
        for instance, tier, tenant, adapter, ord, reason in scopes:
            state.bulk.setdefault(self._instance_list[instance], {})[
                (_TIERS[tier], strings[tenant], strings[adapter])] = (ord, _REASONS[reason])
        return state

    def pack(self) -> PackedObjects:
        """The live objects as a snapshot stores them (`analysis.packed`)."""
        return PackedObjects(list(self._table_list), list(self._string_list), list(self._identity_list),
                             self._core.pack())  # type: ignore[attr-defined]

    def unpack(self, packed: PackedObjects) -> None:
        """Add a snapshot's objects, their ids renumbered to this state's."""
        rows = records(packed).copy()
        ids = []
        for instance, group in packed.tables:
            self._instance(instance)  # interned first, as a write does
            ids.append(self._table((instance, group)))
        tables = np.array(ids or [0], dtype=np.uint32)
        strings = np.array([self._string(s) for s in packed.strings] or [0], dtype=np.uint32)
        identities = np.array([self._identity(tuple(i)) for i in packed.identities] or [0], dtype=np.uint32)
        rows["table"] = tables[rows["table"]]
        rows["tenant"] = strings[rows["tenant"]]
        committed = rows["has_commit"] == 1
        rows["identity"] = np.where(committed, identities[np.where(committed, rows["identity"], 0)], 0)
        self._core.unpack(rows.tobytes(), len(self._table_list), len(self._string_list))  # type: ignore[attr-defined]

    @classmethod
    def from_cache_state(cls, state: CacheState, shared_tenants: frozenset[str] = frozenset()) -> NativeState:
        out = cls(shared_tenants, dict(state.changes), set(state.leased), {k: set(v) for k, v in state.tenants.items()},
                  state.fleet, dict(state.slots), list(state.names), dict(state.models),
                  {k: dict(v) for k, v in state.holders.items()})
        core = out._core
        for (instance, group), table in state.tables.items():
            out._instance(instance)
            core.load_objects(out._table((instance, group)), table)  # type: ignore[attr-defined]
        for instance, scopes in state.bulk.items():
            iid = out._instance(instance)
            for (tier, tenant, adapter), (ord, reason) in scopes.items():
                core.bulk(iid, _TIER_CODE[tier], out._string(tenant), out._string(adapter), ord,  # type: ignore[attr-defined]
                          _REASON_CODE[reason])
        return out

    def items(self) -> Iterator[tuple[ObjectKey, ObjectState]]:
        return self.to_cache_state().items()
