"""The fleet view of one lookup: what every instance of its model held for it when it arrived.

A router sends a request to one instance; whether that was the right one is a question about
the others, at that moment. Each lookup is judged on its own instance (`evaluate`), then on
each other instance that could hold part of its prefix, by the same rules: the longest hash hit
on any of them is *seen anywhere*, the longest recoverable prefix is *recoverable anywhere*, on
the *best instance*. Their differences name where a request's cacheable tokens went:

    prompt -> seen anywhere -> recoverable anywhere -> recoverable here -> adopted
       never seen   seen, not recoverable   routing regret    local loss

The work per lookup stays bounded in a large fleet: `CacheState`'s fleet index says, per block
key, which instances hold it (a bit mask), so the candidates come from one get per block, and a
candidate is judged only when the last block it holds could beat the best found so far (a hit
at boundary p needs the block just before p in some group: every completeness rule includes it).
"""

from __future__ import annotations

from functools import reduce
from operator import or_

import msgspec

from kvtrace.analysis.evaluate import Evaluation, Policy, hit_cap
from kvtrace.analysis.native_state import NativeState, evaluate_on
from kvtrace.analysis.state import CacheState
from kvtrace.schema.events import Event
from kvtrace.schema.recipes import Recipe
from kvtrace.schema.verdicts import GapReason


class FleetView(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One lookup's fleet numbers, in tokens (kept with a lookup until its adopt)."""

    seen: int  # the longest hash hit on any instance of the model
    recoverable: int  # the longest recoverable prefix on any of them
    best_instance: str  # where `recoverable` is ("" when 0; the lookup's own instance on a tie)
    reason: GapReason  # why `seen` was not recoverable where it was seen (NONE when it was, somewhere)
    restore_bytes: int  # to fetch from slower tiers on the best instance


def alone(lookup: Event, own: Evaluation) -> FleetView:
    """The fleet view of an instance that is its own fleet."""
    reason = own.reason if own.recoverable < own.logical else GapReason.NONE
    return FleetView(own.logical, own.recoverable, lookup.instance if own.recoverable else "", reason,
                     sum(own.restore_bytes.values()))


def candidates(state: CacheState | NativeState, recipe: Recipe, lookup: Event, cap: int) -> list[tuple[int, str]]:
    """The other instances holding any of the lookup's blocks, each with a bound no hit of its
    can pass (the boundary just after the last block it holds in any group, at most `cap`),
    longest bound first, then by name."""
    own = state.slots.get(lookup.instance)
    own_bit = 0 if own is None else 1 << own
    model = state.models.get(lookup.instance, lookup.model)
    chains = lookup.group_block_keys
    bound: dict[int, int] = {}  # an instance's bit -> its bound
    for g in recipe.groups:
        hold = state.holders.get((model, g.group_id))
        if not hold or g.group_id >= len(chains):
            continue
        keys = chains[g.group_id]
        masks = list(map(hold.get, keys))  # in C
        left = reduce(or_, filter(None, masks), 0) & ~own_bit
        b = g.block_size
        # From the end of the chain: each instance's last held block, once per instance.
        for i in range(len(masks) - 1, -1, -1):
            if not left:
                break
            mask = masks[i]
            if mask is None or not mask & left or keys[i] == 0:  # key 0 names no block
                continue
            new, left = mask & left, left & ~mask
            top = (i + 1) * b
            while new:
                low = new & -new
                if bound.get(low, 0) < top:
                    bound[low] = top
                new ^= low
    names = state.names
    found = [(min(top, cap), names[low.bit_length() - 1]) for low, top in bound.items()]
    return sorted((c for c in found if c[0] > 0), key=lambda c: (-c[0], c[1]))


def judge(state: CacheState | NativeState, recipe: Recipe, lookup: Event, own: Evaluation, policy: Policy) -> FleetView:
    """The lookup's fleet view, from its own evaluation and those of the instances that could
    beat it. Ties go to the lookup's own instance, then to the first instance by name, so every
    path names the same one."""
    here = alone(lookup, own)
    found = candidates(state, recipe, lookup, hit_cap(lookup, policy))
    if not found:
        return here
    mine = lookup.instance
    seen, seen_at, seen_reason = own.logical, mine, here.reason
    best, best_at, restore = own.recoverable, here.best_instance, here.restore_bytes

    def wins(value: int, name: str, than: int, holder: str) -> bool:
        return value > than or (value == than > 0 and holder != mine and name < holder)

    for top, name in found:
        if top < best:  # no later one can pass either number (recoverable <= seen <= bound)
            break
        if not (wins(top, name, seen, seen_at) or wins(top, name, best, best_at)):
            continue
        ev = evaluate_on(state, recipe, lookup, policy, instance=name)
        if wins(ev.logical, name, seen, seen_at):
            seen, seen_at = ev.logical, name
            seen_reason = ev.reason if ev.recoverable < ev.logical else GapReason.NONE
        if wins(ev.recoverable, name, best, best_at):
            best, best_at, restore = ev.recoverable, name, sum(ev.restore_bytes.values())
    return FleetView(seen, best, best_at, seen_reason if best < seen else GapReason.NONE, restore)
