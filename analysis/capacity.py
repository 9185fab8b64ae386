"""Capacity planning from one pass over the events: LRU stack distances per cache group.

The requests' lookups name every block of their prompt, per group (`group_block_keys`): that is
the workload's reference string. For an LRU cache of C blocks, a block is resident at a lookup
exactly when fewer than C distinct blocks were referenced since its previous reference (its
stack distance; Mattson et al., 1970). One pass computes every distance (a Fenwick tree over
reference times), and from them the hit of every request at every capacity at once, without
replaying each capacity.

Per group the distances give, at a boundary p, the largest distance among the blocks p needs
(`GroupSpec.needed`: every earlier block for full attention, the window's blocks for a sliding
window, the one checkpoint at p for Mamba). A request resumes at p under capacity C when that
largest distance is below C. Groups are sized separately, since window and recurrent state need
their own budget: a group's curve holds the other groups unlimited.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import polars as pl

from kvtrace.schema.events import Event
from kvtrace.schema.kinds import ComponentKind, EventKind
from kvtrace.schema.recipes import Recipe

NEVER = math.inf


class _Fenwick:
    """Counts over reference times (one mark per block, at its latest reference); doubles its
    size as time runs on, rebuilt from the point values it keeps alongside."""

    def __init__(self, size: int = 1 << 12) -> None:
        self.size = size
        self.points = [0] * size
        self.tree = [0] * (size + 1)

    def add(self, i: int, value: int) -> None:
        if i >= self.size:
            self._grow(i + 1)
        self.points[i] += value
        i += 1
        while i <= self.size:
            self.tree[i] += value
            i += i & -i

    def prefix(self, i: int) -> int:
        """Marks at times < i."""
        i = min(i, self.size)
        total = 0
        while i > 0:
            total += self.tree[i]
            i -= i & -i
        return total

    def _grow(self, need: int) -> None:
        size = self.size
        while size < need:
            size *= 2
        self.points += [0] * (size - self.size)
        self.size = size
        tree = [0] * (size + 1)
        for i, v in enumerate(self.points, start=1):  # O(n) build: add each node into its parent
            tree[i] += v
            parent = i + (i & -i)
            if parent <= size:
                tree[parent] += tree[i]
        self.tree = tree


@dataclass(slots=True)
class _Stack:
    """LRU stack distances for one group's blocks."""

    marks: _Fenwick
    last: dict[int, int]
    now: int = 0
    live: int = 0

    def distance(self, key: int) -> float:
        t = self.last.get(key)
        return NEVER if t is None else self.live - self.marks.prefix(t + 1)

    def drop(self, key: int) -> None:
        """The block left the cache by policy (not for lack of room): it no longer takes space."""
        t = self.last.pop(key, None)
        if t is not None:
            self.marks.add(t, -1)
            self.live -= 1

    def touch(self, key: int) -> None:
        t = self.last.get(key)
        if t is not None:
            self.marks.add(t, -1)
        else:
            self.live += 1
        self.marks.add(self.now, 1)
        self.last[key] = self.now
        self.now += 1


@dataclass(frozen=True, slots=True)
class RequestDistances:
    """For one lookup: per group and per boundary (in alignment steps), the largest stack
    distance among the blocks that boundary needs (inf when one was never seen)."""

    request_id: str
    model: str
    tenant: str
    prompt_tokens: int
    step: int  # tokens per boundary step
    need: tuple[tuple[float, ...], ...]  # [group][k] for boundary p = (k + 1) * step

    def hit_tokens(self, capacity: Sequence[float]) -> int:
        """The furthest boundary every group can serve with these capacities (in blocks)."""
        best = 0
        for k in range(len(self.need[0]) if self.need else 0):
            if all(group[k] < c for group, c in zip(self.need, capacity, strict=True)):
                best = (k + 1) * self.step
        return best

    def reusable_tokens(self) -> int:
        return self.hit_tokens([NEVER] * len(self.need)) if self.need else 0


def request_distances(events: Iterable[Event], recipe: Recipe,
                      free_outside_window: bool = True) -> list[RequestDistances]:
    """One pass over the lookups (in stream order) of one model's events.

    `free_outside_window`: a sliding-window group keeps only the blocks of a prompt's last
    window once it is computed (what engines do), so only those take room in its budget.
    """
    stacks = [_Stack(_Fenwick(), {}) for _ in recipe.groups]
    step = recipe.alignment
    out = []
    for e in events:
        if e.kind is not EventKind.LOOKUP or not e.group_block_keys:
            continue
        chains = e.group_block_keys
        cap = max(e.prompt_tokens - 1, 0)  # an engine always computes the last prompt token
        steps = cap // step
        need: list[tuple[float, ...]] = []
        for g, stack in zip(recipe.groups, stacks, strict=True):
            chain = chains[g.group_id] if g.group_id < len(chains) else []
            d = [stack.distance(k) for k in chain]
            per: list[float] = []
            for k in range(steps):
                idx = g.needed((k + 1) * step)
                per.append(max((d[i] if i < len(d) else NEVER for i in idx), default=0.0))
            need.append(tuple(per))
        for g, stack in zip(recipe.groups, stacks, strict=True):  # the whole prompt is then referenced
            chain = chains[g.group_id] if g.group_id < len(chains) else []
            for key in chain:
                stack.touch(key)
            if free_outside_window and g.component is ComponentKind.SLIDING_WINDOW:
                keep = g.needed(len(chain) * g.block_size)
                for i, key in enumerate(chain):
                    if i not in keep:
                        stack.drop(key)
        out.append(RequestDistances(e.request_id, e.model, e.tenant, e.prompt_tokens, step, tuple(need)))
    return out


def capacity_curve(distances: Sequence[RequestDistances], recipe: Recipe,
                   capacities: Iterable[int]) -> pl.DataFrame:
    """Per group and capacity (blocks of that group, others unlimited): the tokens every request
    could resume from, and their share of prompt tokens."""
    prompt = sum(r.prompt_tokens for r in distances) or 1
    rows = []
    for g in recipe.groups:
        for c in capacities:
            limits = [NEVER] * len(recipe.groups)
            limits[g.group_id] = c
            hit = sum(r.hit_tokens(limits) for r in distances)
            rows.append({"group": g.group_id, "component": g.component.value, "capacity_blocks": c,
                         "hit_tokens": hit, "hit_rate": hit / prompt})
    return pl.DataFrame(rows, schema={"group": pl.Int64, "component": pl.Utf8, "capacity_blocks": pl.Int64,
                                      "hit_tokens": pl.Int64, "hit_rate": pl.Float64})


@dataclass(frozen=True, slots=True)
class CapacityNeed:
    group: int
    component: str
    blocks: int  # pages of this group's block size
    requests: float
    prefix: float


def capacity_needed(distances: Sequence[RequestDistances], recipe: Recipe, requests: float = 0.99,
                    prefix: float = 0.99) -> list[CapacityNeed]:
    """Per group (others unlimited): the fewest blocks so that `requests` of the requests keep
    `prefix` of what they could reuse with unlimited capacity."""
    out = []
    for g in recipe.groups:
        needs = []
        for r in distances:
            reusable = r.reusable_tokens()
            if reusable <= 0:
                needs.append(0)
                continue
            want = prefix * reusable
            others_ok = [all(grp[k] < NEVER for h, grp in enumerate(r.need) if h != g.group_id)
                         for k in range(len(r.need[g.group_id]))]
            # smallest capacity that serves some boundary >= want: 1 + that boundary's need
            best = min((r.need[g.group_id][k] for k in range(len(others_ok))
                        if others_ok[k] and (k + 1) * r.step >= want), default=NEVER)
            needs.append(int(best) + 1 if best < NEVER else 0)
        needs.sort()
        idx = min(len(needs) - 1, max(0, math.ceil(requests * len(needs)) - 1)) if needs else 0
        out.append(CapacityNeed(g.group_id, g.component.value, needs[idx] if needs else 0, requests, prefix))
    return out


def reuse_intervals(events: Iterable[Event], recipe: Recipe) -> pl.DataFrame:
    """Time from a block's commit to each later lookup that hits it (per model and tenant of the
    lookup): how long reusable state has to stay around to be reused."""
    committed: dict[tuple[int, int], int] = {}
    rows: list[tuple[str, str, int, int]] = []
    for e in events:
        if e.kind is EventKind.COMMIT:
            for key in (e.block_key, *e.more_keys):
                committed[(e.group_id, key)] = e.ts_ns
        elif e.kind is EventKind.LOOKUP and e.group_block_keys:
            for g, (chain, hit) in enumerate(zip(e.group_block_keys, e.group_hit_tokens, strict=False)):
                if g >= len(recipe.groups):
                    break
                for key in chain[: hit // recipe.groups[g].block_size]:
                    t = committed.get((g, key))
                    if t is not None and e.ts_ns >= t:
                        rows.append((e.model, e.tenant, g, e.ts_ns - t))
    return pl.DataFrame(rows, schema={"model": pl.Utf8, "tenant": pl.Utf8, "group": pl.Int64, "interval_ns": pl.Int64},
                        orient="row")


def reuse_summary(intervals: pl.DataFrame) -> pl.DataFrame:
    """Reuse-interval distribution per model and tenant: count and quantiles, in seconds."""
    s = pl.col("interval_ns") / 1e9
    return (intervals.group_by("model", "tenant")
            .agg(pl.len().alias("reuses"), s.quantile(0.5).alias("p50_s"), s.quantile(0.9).alias("p90_s"),
                 s.quantile(0.99).alias("p99_s"), s.max().alias("max_s"))
            .sort("model", "tenant"))
