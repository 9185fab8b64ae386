"""Pure evaluation of one lookup against the cache state: logical, recoverable, resident.

For each group the request's blocks are classified once (present? usable? on device?), then
candidate boundaries are scanned from the top with O(1) checks per group using prefix sums,
so a lookup costs O(blocks), not O(blocks^2), even for 100k-token prompts.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from itertools import accumulate
from operator import attrgetter

from kvtrace.analysis.state import IDENTITY_FIELDS, CacheState, ObjectState, identity_of
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import ComponentKind, Reason, Tier
from kvtrace.schema.recipes import GroupSpec, Recipe
from kvtrace.schema.verdicts import MISSING_REASON, GapReason


@dataclass(frozen=True, slots=True)
class Policy:
    """Choices a deployment makes about what counts as reusable."""

    shared_tenants: frozenset[str] = frozenset()  # namespaces every tenant may reuse
    keep_one_token: bool = True  # engines compute at least the last prompt token
    # Judge each lookup on every instance of its model too: what was seen and recoverable
    # anywhere in the fleet when it arrived (see `analysis.fleet`; the streaming path, which
    # reads every instance in one order). Off, the fleet is each instance alone, and the fleet
    # columns repeat the instance's own numbers.
    fleet: bool = False
    # Engines that are KV stores, not model runners (LMCache): asked about a whole token sequence,
    # they may serve all of it. The one-token rule belongs to the engine that computes, not to them.
    stores: frozenset[str] = frozenset({"lmcache"})


@dataclass(frozen=True, slots=True)
class BlockCheck:
    present: bool
    usable: bool
    resident: bool
    reason: GapReason
    detail: str
    restore_tier: Tier  # lowest-latency tier holding a usable copy when not resident
    restore_bytes: int


_MISSING = {component: BlockCheck(False, False, False, reason, "", Tier.NONE, 0)
            for component, reason in MISSING_REASON.items()}  # frozen: one per component, shared


def _missing(component: ComponentKind) -> BlockCheck:
    return _MISSING[component]


class CopyStatus(IntEnum):
    """How close one copy is to usable; the best copy of a block names its reason."""

    INVALIDATED = 1
    UNCOMMITTED = 2
    CORRUPT = 3
    OK = 4


def check_object(
    state: CacheState, instance: str, obj: ObjectState | None, component: ComponentKind, request: Event, policy: Policy
) -> BlockCheck:
    """Is this block usable by this request now? The first failing rule names the reason.

    Copy rules first (a block is usable through any good copy), then object rules on its last
    commit: tenant, identity, lease.
    """
    if obj is None or not obj.copies:
        return _missing(component)
    commit = obj.commit
    good: list[Tier] = []
    best = CopyStatus.INVALIDATED
    invalidated_by = (0, Reason.NONE)
    for tier, copy in obj.copies.items():
        inv = state.invalidation(instance, obj, tier)
        if inv[0] > copy.ord:
            status = CopyStatus.INVALIDATED
            invalidated_by = max(invalidated_by, inv, key=lambda x: x[0])
        elif not copy.committed:
            status = CopyStatus.UNCOMMITTED
        elif commit is not None and commit.checksum and copy.checksum and copy.checksum != commit.checksum:
            status = CopyStatus.CORRUPT
        else:
            status = CopyStatus.OK
            good.append(tier)
        best = max(best, status)
    reason, detail = GapReason.NONE, ""
    if best is CopyStatus.INVALIDATED:
        why = invalidated_by[1]
        reason = GapReason.SPECULATIVE_ROLLBACK if why is Reason.ROLLBACK else GapReason.INVALIDATED
        detail = why.value
    elif best is CopyStatus.UNCOMMITTED:
        reason = GapReason.UNCOMMITTED
    elif best is CopyStatus.CORRUPT:
        reason = GapReason.CHECKSUM_MISMATCH
    elif commit is None:
        reason, detail = GapReason.UNCOMMITTED, "no commit seen"
    elif commit.tenant != request.tenant and commit.tenant not in policy.shared_tenants:
        reason, detail = GapReason.TENANT_MISMATCH, f"tenant: {commit.tenant} != {request.tenant}"
    else:
        for name, have, want in zip(IDENTITY_FIELDS, commit.identity, identity_of(request), strict=True):
            # Empty means "not reported", except for the adapter, where it means the base model.
            if have != want and (name == "adapter" or (have and want)):
                if component is ComponentKind.INDEXER and name == "epoch":
                    reason = GapReason.INDEXER_OUT_OF_SYNC
                else:
                    reason = GapReason.IDENTITY_MISMATCH
                detail = f"{name}: {have} != {want}"
                break
        else:
            if obj.lease_expiry_ns and obj.lease_expiry_ns <= request.ts_ns:
                reason = GapReason.LEASE_EXPIRED
    if reason is not GapReason.NONE:
        return BlockCheck(True, False, False, reason, detail, Tier.NONE, 0)
    if Tier.DEVICE in good:
        return BlockCheck(True, True, True, GapReason.NONE, "", Tier.DEVICE, 0)
    source = Tier(min(good, key=_TIER_RANK.__getitem__))  # copies are keyed by the tier's value
    nbytes = obj.copies[source].nbytes or (commit.nbytes if commit is not None else 0)
    return BlockCheck(True, True, False, GapReason.NOT_RESIDENT, source.value, source, nbytes)


_TIER_RANK = {Tier.DEVICE: 0, Tier.HOST: 1, Tier.DISK: 2, Tier.REMOTE: 3, Tier.NONE: 4}


_PRESENT, _USABLE, _RESIDENT = attrgetter("present"), attrgetter("usable"), attrgetter("resident")


class _GroupView:
    """One group's blocks for one request, with prefix sums for O(1) range checks."""

    __slots__ = ("group", "checks", "_present", "_usable", "_resident")

    def __init__(self, group: GroupSpec, checks: list[BlockCheck], none_held: bool = False) -> None:
        self.group = group
        self.checks = checks
        if none_held:  # every sum is 0: one list of zeros serves all three (never written to)
            self._present = self._usable = self._resident = [0] * (len(checks) + 1)
            return
        self._present = list(accumulate(map(_PRESENT, checks), initial=0))  # in C: bools add up as ints
        self._usable = list(accumulate(map(_USABLE, checks), initial=0))
        self._resident = list(accumulate(map(_RESIDENT, checks), initial=0))

    def hash_hit(self, cap: int) -> int:
        """What this group's own hash lookup finds: the longest boundary (a multiple of its block
        size, at most `cap`) whose needed blocks are all present, valid or not. For full
        attention that is the run of present blocks from the start; for a sliding window, the
        last window that is complete; for Mamba, the last checkpoint. A boundary that needs no
        block of this group (a tail group at a compressed boundary) is no hit of its own."""
        if not self._present[-1]:  # nothing of this group is held: no boundary can be a hit
            return 0
        b = self.group.block_size
        for p in range(cap // b * b, 0, -b):
            blocks = self.group.needed(p)
            if blocks and blocks.stop <= len(self.checks) and \
                    self._present[blocks.stop] - self._present[blocks.start] == len(blocks):
                return p
        return 0

    def _all(self, sums: list[int], blocks: range) -> bool:
        if not blocks:
            return True
        if blocks.stop > len(self.checks):
            return False
        return sums[blocks.stop] - sums[blocks.start] == len(blocks)

    def usable_at(self, p: int) -> bool:
        return self._all(self._usable, self.group.needed(p))

    def resident_at(self, p: int) -> bool:
        return self._all(self._resident, self.group.needed(p))

    def first_failure(self, p: int) -> tuple[GapReason, str] | None:
        for i in self.group.needed(p):
            if i >= len(self.checks):
                return MISSING_REASON[self.group.component], "block beyond the request's key chain"
            check = self.checks[i]
            if not check.usable:
                return check.reason, check.detail
        return None


@dataclass(frozen=True, slots=True)
class Evaluation:
    logical: int
    recoverable: int
    resident: int
    reason: GapReason
    reason_group: int
    reason_detail: str
    group_logical: tuple[int, ...]
    restore_bytes: dict[Tier, int]


def hit_cap(lookup: Event, policy: Policy) -> int:
    """The longest hit a lookup can have: its prompt, less the last token where the engine must
    compute it (see Policy.keep_one_token)."""
    keep = policy.keep_one_token and lookup.engine not in policy.stores
    return max(lookup.prompt_tokens - 1 if keep else lookup.prompt_tokens, 0)


def evaluate(
    state: CacheState, recipe: Recipe, lookup: Event, policy: Policy = Policy(), explain_up_to: int = 0,
    instance: str | None = None,
) -> Evaluation:
    """The three hit numbers for one lookup event, and why recoverable stops where it does;
    on `instance` when given (what another instance of the fleet held for this request).

    The reason explains why the aligned logical hit (or, when re-checking at adopt time,
    `explain_up_to`: what was recoverable at lookup) is not recoverable.
    """
    chains = lookup.group_block_keys
    views = []
    tables = state.tables
    if instance is None:
        instance = lookup.instance
    for g in recipe.groups:
        keys = chains[g.group_id] if g.group_id < len(chains) else []
        component, missing = g.component, _MISSING[g.component]
        table = tables.get((instance, g.group_id))
        found = list(map(table.get, keys)) if table else [None] * len(keys)  # in C
        if found.count(None) == len(found):  # nothing of the chain is held: no block to check
            views.append(_GroupView(g, [missing] * len(found), none_held=True))
            continue
        if 0 in table:  # type: ignore[operator]  # key 0 names no block, whatever holds it
            found = [None if k == 0 else obj for k, obj in zip(keys, found, strict=True)]
        checks = [missing if obj is None else check_object(state, instance, obj, component, lookup, policy)
                  for obj in found]
        views.append(_GroupView(g, checks))
    cap = hit_cap(lookup, policy)

    # What a hash lookup reports: the best hit any group's own lookup finds (present keys by the
    # group's rule), whatever the state of those objects and whatever the other groups hold.
    group_logical = [v.hash_hit(cap) for v in views]
    logical = max(group_logical, default=0)

    step = recipe.alignment
    top = logical // step * step
    recoverable = top
    while recoverable > 0 and not all(v.usable_at(recoverable) for v in views):
        recoverable -= step
    resident = recoverable
    while resident > 0 and not all(v.resident_at(resident) for v in views):
        resident -= step

    # The reason is the first failing group at the boundary the request wanted: the aligned
    # logical hit (what the hash promised) or, re-checking at adopt, what was recoverable then.
    reason, group_id, detail = GapReason.NONE, -1, ""
    target = explain_up_to // step * step if explain_up_to else top
    if recoverable < target:
        for v in views:
            failure = v.first_failure(target)
            if failure is not None:
                (reason, detail), group_id = failure, v.group.group_id
                break
    elif top < logical:
        reason, detail = GapReason.MISALIGNED, f"logical {logical} is not a multiple of {step}"

    restore: dict[Tier, int] = {}
    if resident < recoverable:
        for v in views:
            for i in v.group.needed(recoverable):
                check = v.checks[i]
                if not check.resident:
                    restore[check.restore_tier] = restore.get(check.restore_tier, 0) + check.restore_bytes
    return Evaluation(
        logical=logical,
        recoverable=recoverable,
        resident=resident,
        reason=reason,
        reason_group=group_id,
        reason_detail=detail,
        group_logical=tuple(group_logical),
        restore_bytes=restore,
    )
