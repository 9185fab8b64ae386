"""The streaming reconstructor: one pass over events in time order, one result per lookup.

Memory is bounded by live objects plus lookups still waiting for their adopt (capped), not by
the length of the trace, so the same code runs offline over a file and inside the collector
over a live stream.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrace.analysis.columnar import Prepared, feed_batch, prepare
from kvtrace.analysis.evaluate import Evaluation, Policy
from kvtrace.analysis.fleet import FleetView, alone, judge
from kvtrace.analysis.native_state import NativeState, available, evaluate_on
from kvtrace.analysis.requests import CHANGES, LOOKUP_ROW, Lane, evaluation, plan, results, verdict_table
from kvtrace.analysis.state import CacheState
from kvtrace.schema.arrow import conform, from_arrow
from kvtrace.schema.events import Event, adopted_tokens
from kvtrace.schema.kinds import EventKind, Tier
from kvtrace.schema.recipes import Recipe, RecipeBook, recipe_from_json
from kvtrace.schema.verdicts import GapReason, LookupResult, classify


@dataclass(slots=True)
class _Pending:
    lookup: Event
    recipe: Recipe
    at_lookup: Evaluation
    changes: int  # the instance's state changes when it was judged (CacheState.changes_of)
    fleet: FleetView | None = None  # judged on the fleet too (Policy.fleet)


_NO_TENANTS: frozenset[str] = frozenset()
# A table of chunks is fed as one batch up to this many rows: the live path's tables are runs cut
# at the watermark (a few thousand rows each), and a batch's resolving has a fixed cost.
_COMBINE = 1 << 17


def _after_attaches(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The batches, each cut after its attach rows. Why: an attach can publish the recipe of the
    lookups after it, so `requests.plan` leaves those to the event path (~4x the CPU per event);
    cut there, the rows after it are planned once the attach has been fed. An engine attaches
    once per start, and the live judge's first chunk of a fresh engine held ~60k events."""
    for batch in batches:
        if not batch.num_rows:
            continue
        kinds = batch.column("kind")
        attaches = np.flatnonzero(pc.equal(kinds, EventKind.ATTACH.value).to_numpy(zero_copy_only=False))
        start = 0
        for row in attaches.tolist():
            if row + 1 < batch.num_rows:
                yield batch.slice(start, row + 1 - start)
                start = row + 1
        yield batch.slice(start) if start else batch


class PublishedRecipe(msgspec.Struct, array_like=True):
    source_id: int
    engine: str
    model: str
    instance: str
    recipe: Recipe


class ReconstructorState(msgspec.Struct, kw_only=True):
    """Everything a Reconstructor carries from one event to the next, as plain data: resuming
    from it and feeding the rest of the stream gives the rows feeding the whole stream gives
    (see `analysis.snapshot`, which stores it)."""

    events_seen: int
    unmatched_adopts: int
    pending_overflow: int
    state: CacheState
    pending: list[_Pending]
    published: list[PublishedRecipe]


class Reconstructor:
    """Feed events in (ts_ns, source_id, seq) order; collect LookupResults as they complete.

    The recipes are the book given, with every engine's own recipe added as its attach event
    arrives; a given recipe the events contradict (the engine's own recipe, or a commit's block
    span or group) raises `RecipeMismatch` rather than judge lookups by a wrong recipe.
    """

    def __init__(
        self,
        recipes: RecipeBook | Recipe | None = None,
        policy: Policy = Policy(),
        max_pending: int = 100_000,
    ) -> None:
        self.recipes = RecipeBook.of(recipes)
        self.policy = policy
        self.state: CacheState | NativeState = _new_state(policy)
        self.max_pending = max_pending
        self._pending: OrderedDict[tuple[str, str], _Pending] = OrderedDict()
        # The block size of each group of a given recipe, by (engine, model); None: none given.
        self._limits: dict[tuple[str, str], tuple[int, ...] | None] = {}
        self.events_seen = 0
        self.unmatched_adopts = 0
        self.pending_overflow = 0
        # Where set, `feed_table` puts the verdicts it judges from the columns here, as tables,
        # instead of returning them (the live judge's: its verdicts go to the store as a table).
        self.verdict_tables: list[pa.Table] | None = None

    def capture(self, objects: bool = True) -> ReconstructorState:
        """The state after the last event fed (shared, not copied: encode it before feeding on);
        without the live objects when not `objects` (a snapshot stores them packed)."""
        instances = self.recipes.instances
        if isinstance(self.state, NativeState):
            state = self.state.to_cache_state(objects)
        else:
            state = self.state if objects else dataclasses.replace(self.state, tables={})
        return ReconstructorState(
            events_seen=self.events_seen, unmatched_adopts=self.unmatched_adopts,
            pending_overflow=self.pending_overflow,
            state=state,
            pending=list(self._pending.values()),
            published=[PublishedRecipe(src, engine, model, instances.get((src, engine, model), ""), recipe)
                       for (src, engine, model), recipe in self.recipes.published.items()],
        )

    @classmethod
    def resume(
        cls,
        captured: ReconstructorState,
        recipes: RecipeBook | Recipe | None = None,
        policy: Policy = Policy(),
        max_pending: int = 100_000,
    ) -> Reconstructor:
        """A reconstructor that goes on where `captured` stopped, with the same given recipes and
        policy (the snapshot's fingerprint says which); the engines' recipes are published again,
        so a given recipe they contradict is refused here as it was there."""
        rec = cls(recipes, policy, max_pending)
        for p in captured.published:
            rec.recipes = rec.recipes.publish(p.source_id, p.engine, p.model, p.recipe, p.instance)
        rec.state = NativeState.from_cache_state(captured.state, policy.shared_tenants) \
            if isinstance(rec.state, NativeState) else captured.state
        rec.events_seen = captured.events_seen
        rec.unmatched_adopts = captured.unmatched_adopts
        rec.pending_overflow = captured.pending_overflow
        rec._pending = OrderedDict(((p.lookup.instance, p.lookup.request_id), p) for p in captured.pending)
        return rec

    def pending_since(self, since_ns: int, until_ns: int) -> bool:
        """Is any lookup made in [since_ns, until_ns) still waiting for its adopt?"""
        return any(since_ns <= p.lookup.ts_ns < until_ns for p in self._pending.values())

    def recipe_for(self, model: str, engine: str = "", source_id: int = 0) -> Recipe:
        return self.recipes.resolve(model, engine, source_id)

    def feed(self, event: Event) -> list[LookupResult]:
        self.events_seen += 1
        kind = event.kind
        if kind is EventKind.LOOKUP:
            return self._on_lookup(event)
        if kind is EventKind.ADOPT:
            pending = self._pending.pop((event.instance, event.request_id), None)
            if pending is None:
                self.unmatched_adopts += 1
                return []
            return [self._result(pending, event)]
        if kind is EventKind.COMMIT:
            self._check_commit(event)
        elif kind is EventKind.ATTACH:
            self.recipes = self.recipes.publish(event.source_id, event.engine, event.model,
                                                recipe_from_json(event.recipe), event.instance)
        self.state.apply(event, self.events_seen)
        return []

    def feed_table(self, table: pa.Table, feed: Callable[[Event], list[LookupResult]] | None = None,
                   bail: Callable[[], bool] = lambda: False, requests: bool = True) -> list[LookupResult]:
        """`feed` (default: this one's) each of a table's events, in its row order (stream order),
        and return what it returned, with the verdicts judged from the columns in their place.
        Where the compiled state serves, object rows are applied from the columns themselves
        (analysis.columnar) and, with `requests`, lookups whose adopt follows in the same stretch
        are judged there too (analysis.requests); `feed` is called for the other rows; once
        `bail()` is true, for every row. The rows are those of feeding every event."""
        use = feed or self.feed
        out: list[LookupResult] = []
        if not isinstance(self.state, NativeState) or self.policy.fleet or bail():
            for event in from_arrow(table):
                out += use(event)
            return out
        table = conform(table)
        if table.num_rows <= _COMBINE and table.num_columns and table.column(0).num_chunks > 1:
            table = table.combine_chunks()  # one batch: each costs ~4 ms of fixed work (analysis.requests)
        for batch in _after_attaches(table.to_batches()):
            if not self._spans_fit(batch):  # a commit the given recipe may refuse: as events, in order
                for event in from_arrow(pa.Table.from_batches([batch])):
                    out += use(event)
                continue
            base = self.events_seen

            def one(event: Event, row: int, base: int = base) -> list[LookupResult]:
                self.events_seen = base + row  # each row's stream position, as feeding every event gives
                return use(event)

            prepared = prepare(self.state, batch)
            lane = plan(self.state, batch, prepared, self.recipes, self.policy,
                        self.max_pending - len(self._pending)) if requests else None
            if lane is None:
                got, done = feed_batch(self.state, batch, base, one, bail, prepared)
            else:
                got, done = self._feed_lane(batch, base, one, bail, prepared, lane)
            self.events_seen = base + done
            out += got
        return out

    def _feed_lane(self, batch: pa.RecordBatch, base: int, feed: Callable[[Event, int], list[LookupResult]],
                   bail: Callable[[], bool], prepared: Prepared, lane: Lane) -> tuple[list[LookupResult], int]:
        """`columnar.feed_batch`, the lane's lookups and adopts judged in the core's pass and
        their verdicts made at the end of each stretch, in stream order."""
        core = self.state._core  # type: ignore[union-attr]
        n, specials, out = batch.num_rows, lane.specials, []
        events = from_arrow(pa.Table.from_batches([batch.take(pa.array(specials))])) if specials else []
        core.load_columns((lane.kind, *prepared.columns[1:]), prepared.instances, prepared.tenants)
        try:
            core.load_requests(lane.buffers, lane.specs, lane.width)
            apply, pos, done = core.apply_rows, 0, 0
            for row, event in zip(specials, events, strict=True):
                if row > pos:
                    apply(pos, row, base)
                    done = self._settle(batch, lane, done, row, out)
                out += feed(event, row)
                pos = row + 1
                if bail():
                    for i, late in enumerate(from_arrow(pa.Table.from_batches([batch.slice(pos)])) if pos < n else []):
                        out += feed(late, pos + i)
                    return out, n
            if pos < n:
                apply(pos, n, base)
                self._settle(batch, lane, done, n, out)
        finally:
            core.load_columns(None, [], [])
        return out, n

    def _settle(self, batch: pa.RecordBatch, lane: Lane, i: int, stop: int, out: list[LookupResult]) -> int:
        """The verdicts of the lane's requests before row `stop`, from `lane.requests[i]` on, as
        feeding their events makes them; a lookup still waiting for its adopt at `stop` is kept
        as an event feeding it would keep. Returns the index of the next request.

        Why two ways: a stretch whose lookups are of distinct requests, none of them waiting
        already, is settled from its columns at once (each adopt closes the lookup `plan`
        paired it with; the lookups left wait). Only a request looked up again, which closes
        the lookup before it without an adopt, is walked row by row."""
        requests = lane.requests
        j = int(np.searchsorted(requests, stop, side="left"))
        rows = requests[i:j]
        if not len(rows):
            return j
        lookup = lane.kind[rows] == LOOKUP_ROW
        lk, ad = rows[lookup], rows[~lookup]
        codes = lane.code[lk]
        pending = self._pending
        if len(np.unique(codes)) == len(codes) and not self._any_waiting(lane, lk, codes):
            their = lane.buffers[1][ad]  # each adopt's lookup (`plan`'s pairs)
            self._made(lane, [], their, ad, out)
            waiting = lk[~np.isin(lk, their)]
            self._keep_waiting(batch, lane, [lane.key(r) for r in waiting.tolist()], waiting.tolist())
            return j
        waiting: dict[tuple[str, str], int] = {}
        made: list[LookupResult | int] = []  # in stream order; an int: the lane's verdict of that number
        lookups: list[int] = []
        adopts: list[int] = []
        for row in rows.tolist():
            key = lane.key(row)
            if lane.kind[row] == LOOKUP_ROW:
                previous = pending.pop(key, None)  # looked up again: the first closed without an adopt
                if previous is not None:
                    if waiting.pop(key, None) is None:
                        made.append(self._result(previous, None))
                    else:
                        made.append(len(lookups))
                        lookups.append(previous)  # type: ignore[arg-type]
                        adopts.append(-1)
                pending[key] = waiting[key] = row  # type: ignore[assignment]
            else:
                closed = pending.pop(key)
                del waiting[key]
                made.append(len(lookups))
                lookups.append(closed)  # type: ignore[arg-type]
                adopts.append(row)
        self._made(lane, made, lookups, adopts, out)
        self._keep_waiting(batch, lane, list(waiting), list(waiting.values()))
        return j

    def _any_waiting(self, lane: Lane, lookups: np.ndarray, codes: np.ndarray) -> bool:
        """Is a request of these lookups waiting already (looked up before, no adopt yet)?"""
        pending = self._pending
        if not pending:
            return False
        if len(pending) <= len(lookups):
            return bool(np.isin(codes, lane.codes_of(pending)).any())
        return any(lane.key(r) in pending for r in lookups.tolist())

    def _made(self, lane: Lane, made: list[LookupResult | int], lookups: Sequence[int], adopts: Sequence[int],
              out: list[LookupResult]) -> None:
        """The lane's verdicts of `lookups` (each closed at the adopt beside it, -1: none) in their
        places in `made` (an int there: the verdict of that number; none: in their order), the
        lane's live verdicts as a table and the rest as results."""
        if not len(lookups):
            out.extend(made)  # type: ignore[arg-type]
        elif self.verdict_tables is not None:
            self.verdict_tables.append(verdict_table(lane, self.state, lookups, adopts))  # type: ignore[arg-type]
            out.extend(x for x in made if type(x) is not int)  # type: ignore[misc]
        else:
            built = results(lane, self.state, list(lookups), list(adopts))  # type: ignore[arg-type]
            out.extend((built[x] if type(x) is int else x for x in made) if made else built)  # type: ignore[misc]

    def _keep_waiting(self, batch: pa.RecordBatch, lane: Lane, keys: list[tuple[str, str]], rows: list[int]) -> None:
        """Lookups still waiting for their adopt at the end of a stretch, kept as feeding their
        events keeps them."""
        if not rows:
            return
        kept = from_arrow(pa.Table.from_batches([batch.take(pa.array(rows))]))
        for key, row, event in zip(keys, rows, kept, strict=True):
            self._pending[key] = _Pending(event, lane.recipes[lane.recipe_of[row]], evaluation(lane, self.state, row),
                                          int(lane.out[row, CHANGES]))

    def _spans_fit(self, batch: pa.RecordBatch) -> bool:
        """Do all the batch's commits fit the recipes given (no `check_commits` to run)?"""
        if self.recipes.default is None and not self.recipes.scoped:
            return True
        rows = np.flatnonzero(pc.equal(batch.column("kind"), EventKind.COMMIT.value).to_numpy(zero_copy_only=False))
        if not len(rows):
            return True
        commits = batch.take(pa.array(rows))
        group = commits.column("group_id").to_numpy().astype(np.int64)
        span = (commits.column("token_end").to_numpy().astype(np.int64) -
                commits.column("token_start").to_numpy().astype(np.int64)) // \
            (1 + pc.list_value_length(commits.column("more_keys")).to_numpy(zero_copy_only=False))
        pairs = list(zip(commits.column("engine").to_pylist(), commits.column("model").to_pylist(), strict=True))
        for scope in set(pairs):
            limits = self._limits_of(scope)
            if limits is None:
                continue
            mine = np.array([p == scope for p in pairs])
            g = group[mine]
            if (g >= len(limits)).any() or (span[mine] > np.array(limits)[np.minimum(g, len(limits) - 1)]).any():
                return False
        return True

    def _limits_of(self, scope: tuple[str, str]) -> tuple[int, ...] | None:
        """The block size of each group of the recipe given for (engine, model); None: none given."""
        limits = self._limits.get(scope, ())
        if limits == ():
            given = self.recipes.given(scope[1], scope[0])
            limits = self._limits[scope] = None if given is None else tuple(g.block_size for g in given.groups)
        return limits

    def _check_commit(self, event: Event) -> None:
        """A commit's blocks must fit the recipe given for its model (see RecipeBook.check_commits)."""
        limits = self._limits_of((event.engine, event.model))
        if limits is None:
            return
        span = (event.token_end - event.token_start) // (1 + len(event.more_keys))
        if event.group_id >= len(limits) or span > limits[event.group_id]:
            self.recipes.check_commits(event.engine, event.model, event.group_id, span)

    def _on_lookup(self, event: Event) -> list[LookupResult]:
        out = []
        key = (event.instance, event.request_id)
        if (previous := self._pending.pop(key, None)) is not None:
            out.append(self._result(previous, None))  # looked up again (preempted): close the first
        recipe = self.recipe_for(event.model, event.engine, event.source_id)
        own = evaluate_on(self.state, recipe, event, self.policy)
        fleet = judge(self.state, recipe, event, own, self.policy) if self.policy.fleet else None
        self._pending[key] = _Pending(event, recipe, own, self.state.changes_of(event.instance), fleet)
        if len(self._pending) > self.max_pending:
            _, oldest = self._pending.popitem(last=False)
            self.pending_overflow += 1
            out.append(self._result(oldest, None))
        return out

    def close_source(self, instance: str, source_id: int) -> list[LookupResult]:
        """Close the lookups of one emitter that ended (its process is gone: no adopt can
        come), without waiting for the end of the stream; their verdicts are what `finish`
        would give them."""
        keys = [k for k, p in self._pending.items() if k[0] == instance and p.lookup.source_id == source_id]
        return [self._result(self._pending.pop(k), None) for k in keys]

    def finish(self) -> list[LookupResult]:
        """Close every lookup still waiting for its adopt."""
        out = [self._result(p, None) for p in self._pending.values()]
        self._pending.clear()
        return out

    def run(self, events: Iterable[Event]) -> Iterator[LookupResult]:
        for event in events:
            yield from self.feed(event)
        yield from self.finish()

    # -- results -------------------------------------------------------------------------------
    def _result(self, pending: _Pending, adopt: Event | None) -> LookupResult:
        lookup, ev = pending.lookup, pending.at_lookup
        recoverable, resident, reason = ev.recoverable, ev.resident, ev.reason
        group, detail = ev.reason_group, ev.reason_detail
        adopted = recomputed = 0
        cross = False
        if adopt is not None:
            adopted = adopted_tokens(adopt)
            recomputed = adopt.recomputed_tokens
            # Judged again at use, unless nothing could have changed since the lookup: no state
            # event of its instance came between, and none of its objects has a lease (else
            # time alone can end their validity). The usual case: an engine adopts right after
            # its lookup.
            state, instance = self.state, lookup.instance
            if state.changes_of(instance) != pending.changes or instance in state.leased:
                at_use = evaluate_on(state, pending.recipe, lookup, self.policy, recoverable, adopt.ts_ns)
                if at_use.recoverable < recoverable:
                    recoverable = at_use.recoverable
                    resident = min(resident, at_use.resident)
                    reason, group, detail = GapReason.CHANGED_BEFORE_USE, at_use.reason_group, at_use.reason.value
            # Reuse across tenants needs an object of another tenant on the instance.
            if adopted and not state.tenants.get(instance, _NO_TENANTS) <= {lookup.tenant}:
                cross = self._cross_tenant(pending, adopted)
        step = pending.recipe.alignment
        verdict = classify(ev.logical, ev.logical // step * step, recoverable, resident)
        restore = ev.restore_bytes
        fleet = pending.fleet or alone(lookup, ev)
        return LookupResult(
            ts_ns=lookup.ts_ns,
            source_id=lookup.source_id,
            seq=lookup.seq,
            instance=lookup.instance,
            request_id=lookup.request_id,
            model=lookup.model,
            tenant=lookup.tenant,
            prompt_tokens=lookup.prompt_tokens,
            reported_hit_tokens=lookup.reported_hit_tokens,
            preemptions=lookup.preemptions,
            computed_before_preemption=lookup.computed_before_preemption,
            logical_hit_tokens=ev.logical,
            recoverable_hit_tokens=recoverable,
            resident_hit_tokens=resident,
            adopted_tokens=adopted,
            recomputed_tokens=recomputed,
            adopt_seen=adopt is not None,
            verdict=verdict,
            reason=reason,
            reason_group=group,
            reason_detail=detail,
            unsafe_reuse=adopted > recoverable,
            missed_reuse=adopt is not None and recoverable > adopted,
            cross_tenant=cross,
            restore_host_bytes=restore.get(Tier.HOST, 0),
            restore_disk_bytes=restore.get(Tier.DISK, 0),
            restore_remote_bytes=restore.get(Tier.REMOTE, 0),
            group_logical_tokens=list(ev.group_logical),
            seen_anywhere_tokens=fleet.seen,
            recoverable_anywhere_tokens=fleet.recoverable,
            best_instance=fleet.best_instance,
            routing_regret_tokens=fleet.recoverable - ev.recoverable,
            fleet_reason=fleet.reason,
            best_restore_bytes=fleet.restore_bytes,
        )

    def _cross_tenant(self, pending: _Pending, adopted: int) -> bool:
        """Did the adopted prefix include state committed under another tenant namespace?"""
        lookup = pending.lookup
        for g in pending.recipe.groups:
            chain = lookup.group_block_keys[g.group_id] if g.group_id < len(lookup.group_block_keys) else []
            for i in g.needed(adopted // g.block_size * g.block_size):
                if i < len(chain):
                    tenant = self.state.tenant_of(lookup.instance, g.group_id, chain[i])
                    if tenant is not None and tenant != lookup.tenant:
                        return True
        return False


def _new_state(policy: Policy) -> CacheState | NativeState:
    """The compiled state where it is built (analysis.native_state), else the Python one."""
    if not available():
        return CacheState(fleet=policy.fleet)
    return NativeState(policy.shared_tenants, fleet=policy.fleet)


def reconstruct(
    events: Iterable[Event], recipes: RecipeBook | Recipe | None = None, policy: Policy = Policy()
) -> list[LookupResult]:
    """Every lookup's result, for events already in stream order."""
    return list(Reconstructor(recipes, policy).run(events))
