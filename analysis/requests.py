"""Lookups and adopts judged from a batch's columns, inside the compiled state's pass over it.

Why: with object events applied from their columns (`analysis.columnar`), what was left of a
live verdict's cost was the request rows: each lookup and adopt decoded into an `Event`
(~3 us), the evaluation's call and wrapper (~5 us), a Python stop in the batch's pass per row,
and the result built from them. Sampled on the collector benchmark, that was ~3/4 of the judge
process, which could not keep up with ingest. Here a lookup whose adopt follows it in the same
stretch of the batch (the usual case: an engine adopts right after it looks up) never becomes
an `Event`: the core evaluates the lookup where it stands in the stream, and at the adopt
evaluates it again when its instance changed in between or holds leases, and checks reuse
across tenants, as `Reconstructor._result` does; the verdict is then made from those numbers.

Everything else keeps the event-by-event path, in its place in the stream: the rows the core
does not judge (attaches, probes, bulk invalidations, usage samples, lookups after an attach or
of a model without a recipe) split the batch into stretches, an adopt whose lookup is not in its
stretch is fed as an event, and a lookup still waiting for its adopt at the end of a stretch
becomes the `Event` and `Evaluation` the reconstructor keeps for it. The rows are the ones
feeding every event gives (tests/test_columnar.py, tests/test_requests.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrace.analysis.columnar import Prepared, _identities
from kvtrace.analysis.evaluate import Evaluation, Policy
from kvtrace.analysis.native_state import _COMPONENT, _GAP_CODE, _GAPS, NativeState
from kvtrace.analysis.packed import TIERS
from kvtrace.schema.kinds import EventKind, Tier
from kvtrace.schema.recipes import Recipe, RecipeBook, UnknownModel
from kvtrace.schema.verdicts import MISSING_REASON, GapReason, LookupResult, Verdict

LOOKUP_ROW, ADOPT_ROW = -2, -3  # `_native.c`'s K_LOOKUP_ROW, K_ADOPT_ROW
# RQ_OUT's columns (`_native.c`'s O_ enum) and flags.
_LOGICAL, _RECOVERABLE, _RESIDENT, _REASON, _GROUP, _DKIND, _DARG, _DARG2, _CHANGES, _FLAGS = range(10)
_NOUT = 10
_CHANGED, _CROSS, _TIERS_SHIFT = 1, 2, 8
_HOST, _DISK, _REMOTE = (TIERS.index(t) for t in (Tier.HOST, Tier.DISK, Tier.REMOTE))
_VERDICTS = (Verdict.MISS, Verdict.HIT, Verdict.PARTIAL)  # `classify`'s rule, vectorized in `results`
_LOOKUP_FIELDS = ("ts_ns", "source_id", "seq", "request_id", "model", "tenant", "prompt_tokens",
                  "reported_hit_tokens")


@dataclass(slots=True)
class Lane:
    """A batch's request rows, loaded for the core (`buffers`), and what the results are made of."""

    kind: np.ndarray  # the prepared kind column, request rows marked LOOKUP_ROW / ADOPT_ROW
    specials: list[int]  # the other non-object rows, fed as events
    requests: list[int]  # the request rows, ascending
    keys: dict[int, tuple[str, str]]  # row -> (instance, request_id)
    pair: dict[int, int]  # adopt row -> its lookup's row
    recipes: list[Recipe]
    recipe_of: np.ndarray  # per row: its lookup's recipe (index into `recipes`)
    identity: np.ndarray
    buffers: tuple[np.ndarray, ...]
    specs: tuple[tuple[tuple, int], ...]
    width: int
    fields: dict[int, tuple]  # lookup row -> _LOOKUP_FIELDS' values
    adopted: np.ndarray
    recomputed: np.ndarray

    @property
    def out(self) -> np.ndarray:
        return self.buffers[12]

    @property
    def group_logical(self) -> np.ndarray:
        return self.buffers[13]

    @property
    def restore(self) -> np.ndarray:
        return self.buffers[14]


def plan(state: NativeState, batch: pa.RecordBatch, prepared: Prepared, recipes: RecipeBook, policy: Policy,
         room: int) -> Lane | None:
    """The batch's lookups and adopts the core can judge, and what it needs to; None when there
    are none, or when its lookups could overflow those waiting for an adopt (`room` more fit:
    the event path then closes the oldest at the lookup that overflows)."""
    others = prepared.others
    if not len(others):
        return None
    kinds = batch.column("kind").take(pa.array(others)).to_numpy(zero_copy_only=False)
    lookup, adopt = kinds == EventKind.LOOKUP.value, kinds == EventKind.ADOPT.value
    if not lookup.any() or not adopt.any() or lookup.sum() > room:
        return None
    attach = others[kinds == EventKind.ATTACH.value]
    if len(attach):  # an attach can publish the recipe of a later lookup: those go as events
        lookup &= others < attach[0]
    rows = others[lookup | adopt]
    taken = batch.take(pa.array(rows))
    ids = taken.column("request_id").to_pylist()
    names = [prepared.instances[i] for i in prepared.columns[2][rows].tolist()]
    is_lookup = dict(zip(rows.tolist(), lookup[lookup | adopt].tolist(), strict=True))
    # Each lookup's recipe, resolved once per (model, engine, source): a lookup without one is an event.
    where = {r: i for i, r in enumerate(rows.tolist())}
    triples = list(zip(taken.column("model").to_pylist(), taken.column("engine").to_pylist(),
                       taken.column("source_id").to_pylist(), strict=True))
    book: dict[tuple, int] = {}
    found: list[Recipe] = []
    recipe_of = np.full(batch.num_rows, -1, dtype=np.int32)
    special = set(others[~(lookup | adopt)].tolist())
    for r, ok in is_lookup.items():
        if not ok:
            continue
        triple = triples[where[r]]
        idx = book.get(triple)
        if idx is None:
            try:
                recipe = recipes.resolve(*triple)
            except UnknownModel:
                idx = -1
            else:
                idx = next((i for i, x in enumerate(found) if x is recipe), len(found))
                if idx == len(found):
                    found.append(recipe)
            book[triple] = idx
        if idx < 0:
            special.add(r)
        recipe_of[r] = idx
    # Pair each adopt with its lookup in the same stretch (no event row between them); an adopt
    # left without one is an event, which can split a stretch: until nothing changes.
    order = others.tolist()
    while True:
        pair: dict[int, int] = {}
        last: dict[tuple[str, str], int] = {}
        unpaired = []
        for r in order:
            if r in special:
                last.clear()
                continue
            i = where[r]
            key = (names[i], ids[i])
            if is_lookup[r]:
                last[key] = r
            elif (looked := last.pop(key, None)) is not None:
                pair[r] = looked
            else:
                unpaired.append(r)
        if not unpaired:
            break
        special.update(unpaired)
    requests = [r for r in order if r not in special]
    lookups = [r for r in requests if is_lookup[r]]
    if not lookups or len(lookups) > room:
        return None
    n = batch.num_rows
    kind = prepared.columns[0].copy()
    kind[lookups] = LOOKUP_ROW
    adopts = list(pair)
    kind[adopts] = ADOPT_ROW
    lk = np.array(lookups)
    # Per lookup: instance id, identity, tenant id, time, hit cap, chains, and per group its table.
    inst_code = prepared.columns[2]
    instance_id = np.full(n, 0xFFFFFFFF, dtype=np.uint32)
    width = max(len(r.groups) for r in found)
    tables = np.full((n, width), -1, dtype=np.int32)
    combos = np.unique(inst_code[lk].astype(np.int64) << 16 | recipe_of[lk])
    for c in combos.tolist():
        i, ridx = c >> 16, c & 0xFFFF
        name = prepared.instances[i]
        mine = lk[(inst_code[lk] == i) & (recipe_of[lk] == ridx)]
        instance_id[mine] = state._instances.get(name, 0xFFFFFFFF)
        tables[mine, : len(found[ridx].groups)] = [state._tables.get((name, g.group_id), -1)
                                                  for g in found[ridx].groups]
    identity = np.zeros(n, dtype=np.int32)
    identity[lk] = _identities(state, batch, lk)
    tenant_codes = prepared.columns[6]
    tenant_id = np.zeros(n, dtype=np.int32)
    for t in np.unique(tenant_codes[lk]).tolist():
        tenant_id[lk[tenant_codes[lk] == t]] = state._string(prepared.tenants[t])
    ts = np.ascontiguousarray(batch.column("ts_ns").to_numpy(), dtype=np.int64)
    prompt = batch.column("prompt_tokens").to_numpy().astype(np.int64)
    cap = prompt
    if policy.keep_one_token:
        stores = np.isin(np.asarray(batch.column("engine").to_pylist(), dtype=object), list(policy.stores))
        cap = np.maximum(np.where(stores, prompt, prompt - 1), 0)
    outer, inner, keys = _chains(batch.column("group_block_keys"))
    pairs = np.full(n, -1, dtype=np.int32)
    pairs[adopts] = list(pair.values())
    adopted = _sums(batch.column("reused_tokens"))
    out = np.zeros((n, _NOUT), dtype=np.int64)
    buffers = (recipe_of, pairs, instance_id, identity, tenant_id, ts, np.ascontiguousarray(cap, dtype=np.int64),
               adopted, outer, inner, keys, tables, out, np.zeros((n, width), dtype=np.int64),
               np.zeros((n, len(TIERS)), dtype=np.uint64))
    specs = tuple((tuple((g.group_id, _COMPONENT.get(g.component, 0), g.block_size, g.window, g.ratio,
                          _GAP_CODE[MISSING_REASON[g.component]]) for g in r.groups), r.alignment) for r in found)
    rows_l = lk.tolist()
    values = [taken.column(f).take(pa.array([where[r] for r in rows_l])).to_pylist() for f in _LOOKUP_FIELDS]
    fields = {r: (names[where[r]], *v) for r, *v in zip(rows_l, *values, strict=True)}
    return Lane(kind, sorted(special), requests, {r: (names[where[r]], ids[where[r]]) for r in requests}, pair,
                found, recipe_of, identity, buffers, specs, width, fields, adopted,
                batch.column("recomputed_tokens").to_numpy().astype(np.int64))


def _chains(column: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A list<list<uint64>> column as offsets into offsets into values, whatever its slicing."""
    groups = pc.fill_null(pc.list_value_length(column), 0).to_numpy(zero_copy_only=False)
    flat = pc.list_flatten(column)
    blocks = pc.fill_null(pc.list_value_length(flat), 0).to_numpy(zero_copy_only=False)
    outer = np.zeros(len(groups) + 1, dtype=np.int32)
    np.cumsum(groups, out=outer[1:])
    inner = np.zeros(len(blocks) + 1, dtype=np.int32)
    np.cumsum(blocks, out=inner[1:])
    keys = np.ascontiguousarray(pc.list_flatten(flat).to_numpy(zero_copy_only=False), dtype=np.uint64)
    return outer, inner, keys


def _sums(column: pa.Array) -> np.ndarray:
    """Each row's sum of a list<uint> column (`adopted_tokens`)."""
    lengths = pc.fill_null(pc.list_value_length(column), 0).to_numpy(zero_copy_only=False)
    values = pc.list_flatten(column).to_numpy(zero_copy_only=False).astype(np.int64)
    ends = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(values, out=ends[1:])
    bounds = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=bounds[1:])
    return np.ascontiguousarray(ends[bounds[1:]] - ends[bounds[:-1]])


def evaluation(lane: Lane, state: NativeState, row: int) -> Evaluation:
    """The lookup of `row`'s evaluation where it stood, as `NativeState.evaluate` gives it."""
    o = lane.out[row].tolist()
    tiers = o[_FLAGS] >> _TIERS_SHIFT
    ng = len(lane.recipes[lane.recipe_of[row]].groups)
    detail = state._detail_for(o[_DKIND], o[_DARG], o[_DARG2], lane.fields[row][6],
                               state._identity_list[lane.identity[row]]) if o[_DKIND] else ""
    restore = lane.restore[row].tolist()
    return Evaluation(logical=o[_LOGICAL], recoverable=o[_RECOVERABLE], resident=o[_RESIDENT], reason=_GAPS[o[_REASON]],
                      reason_group=o[_GROUP], reason_detail=detail,
                      group_logical=tuple(lane.group_logical[row, :ng].tolist()),
                      restore_bytes={TIERS[t]: restore[t] for t in range(len(TIERS)) if tiers >> t & 1})


def results(lane: Lane, state: NativeState, rows: list[int], adopts: list[int]) -> list[LookupResult]:
    """The verdicts of the lookups of `rows`, each adopted at the row of `adopts` beside it (-1:
    never), as `Reconstructor._result` makes them: the numbers for all at once, then a result each."""
    lk, ad = np.array(rows), np.array(adopts)
    own, at_use = lane.out[lk], lane.out[np.maximum(ad, 0)]
    seen = ad >= 0
    logical, recoverable, resident = own[:, _LOGICAL], own[:, _RECOVERABLE], own[:, _RESIDENT]
    # Judged again at the adopt and found shorter: the adopt's numbers, and why.
    changed = seen & (at_use[:, _FLAGS] & _CHANGED > 0) & (at_use[:, _RECOVERABLE] < recoverable)
    now_recoverable = np.where(changed, at_use[:, _RECOVERABLE], recoverable)
    now_resident = np.where(changed, np.minimum(resident, at_use[:, _RESIDENT]), resident)
    adopted = np.where(seen, lane.adopted[np.maximum(ad, 0)], 0)
    steps = np.array([r.alignment for r in lane.recipes], dtype=np.int64)[lane.recipe_of[lk]]
    aligned = logical // steps * steps
    hit = (now_recoverable >= aligned) & (now_resident >= now_recoverable)
    verdicts = np.where(logical <= 0, 0, np.where(hit, 1, 2)).tolist()
    restore = lane.restore[lk]
    tiers = own[:, _FLAGS] >> _TIERS_SHIFT
    named = (tiers[:, None] >> np.arange(len(TIERS))) & 1
    best_restore = (restore * named.astype(np.uint64)).sum(axis=1).tolist()
    widths = [len(r.groups) for r in lane.recipes]
    group_logical = [lane.group_logical[r, : widths[lane.recipe_of[r]]].tolist() for r in rows] \
        if len(set(widths)) > 1 else lane.group_logical[lk, : widths[0]].tolist()
    reasons, groups, dkinds = own[:, _REASON].tolist(), own[:, _GROUP].tolist(), own[:, _DKIND].tolist()
    use_reasons, use_groups = at_use[:, _REASON].tolist(), at_use[:, _GROUP].tolist()
    cross = (seen & (at_use[:, _FLAGS] & _CROSS > 0)).tolist()
    recomputed = np.where(seen, lane.recomputed[np.maximum(ad, 0)], 0).tolist()
    fields = lane.fields
    out = []
    for i, (row, logical_i, recoverable_i, rec_now, res_now, adopted_i, seen_i, changed_i) in enumerate(
            zip(rows, logical.tolist(), recoverable.tolist(), now_recoverable.tolist(), now_resident.tolist(),
                adopted.tolist(), seen.tolist(), changed.tolist(), strict=True)):
        instance, ts, source, seq, request, model, tenant, prompt, reported = fields[row]
        own_reason = _GAPS[reasons[i]]
        if changed_i:
            reason, group, detail = GapReason.CHANGED_BEFORE_USE, use_groups[i], _GAPS[use_reasons[i]].value
        else:
            reason, group = own_reason, groups[i]
            detail = state._detail_for(dkinds[i], *own[i, _DARG:_DARG2 + 1].tolist(), tenant,
                                       state._identity_list[lane.identity[row]]) if dkinds[i] else ""
        out.append(LookupResult(
            ts_ns=ts, source_id=source, seq=seq, instance=instance, request_id=request, model=model, tenant=tenant,
            prompt_tokens=prompt, reported_hit_tokens=reported, logical_hit_tokens=logical_i,
            recoverable_hit_tokens=rec_now, resident_hit_tokens=res_now, adopted_tokens=adopted_i,
            recomputed_tokens=recomputed[i], adopt_seen=seen_i, verdict=_VERDICTS[verdicts[i]], reason=reason,
            reason_group=group, reason_detail=detail, unsafe_reuse=adopted_i > rec_now,
            missed_reuse=seen_i and rec_now > adopted_i, cross_tenant=cross[i],
            restore_host_bytes=int(restore[i, _HOST]), restore_disk_bytes=int(restore[i, _DISK]),
            restore_remote_bytes=int(restore[i, _REMOTE]), group_logical_tokens=group_logical[i],
            # the fleet view of an instance that is its own fleet (analysis.fleet.alone)
            seen_anywhere_tokens=logical_i, recoverable_anywhere_tokens=recoverable_i,
            best_instance=instance if recoverable_i else "",
            fleet_reason=own_reason if recoverable_i < logical_i else GapReason.NONE,
            best_restore_bytes=best_restore[i],
        ))
    return out
