"""A batch of events fed to the reconstructor from its Arrow columns.

Why: on the live path most of a verdict's cost was making an `Event` per row (decoding ~6 us
an event, more than the compiled state's work on it) and then reading it back attribute by
attribute. Object events (create, commit, offload, load, evict, invalidate) are most of a
stream and only change the cache state, so here they never become Python objects: their
columns are resolved once per batch, vectorized (enum codes, (instance, group) tables, commit
identities), and the compiled core applies them row by row (`_native.c`'s `apply_rows`). The
other rows (lookups, adopts, attaches, bulk invalidations, probes, ...) are decoded, in one
go, and fed as events in their place in the stream, so the state each lookup sees is the
state the event-by-event feed would give: tests/test_columnar.py checks the rows are equal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from kvtrace.analysis.native_state import _KINDS, _REASON_CODE, _TIER_CODE, NativeState
from kvtrace.schema.arrow import from_arrow
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import EventKind, Transform

_OTHER = -1  # a row fed as an event
_KIND_CODE = {k.value: code for k, code in _KINDS.items()}
_COMMIT, _OFFLOAD, _LOAD, _INVALIDATE = (_KINDS[k] for k in (EventKind.COMMIT, EventKind.OFFLOAD, EventKind.LOAD,
                                                              EventKind.INVALIDATE))
_LAST_WRITE = max(_KINDS[k] for k in (EventKind.CREATE, EventKind.COMMIT, EventKind.OFFLOAD, EventKind.LOAD))
_TIER_OF_VALUE = {t.value: code for t, code in _TIER_CODE.items()}
_REASON_OF_VALUE = {r.value: code for r, code in _REASON_CODE.items()}
_IDENTITY_STRINGS = ("model", "model_revision", "adapter", "transform", "kv_dtype", "layout")


@dataclass(slots=True)
class Prepared:
    """A batch resolved for the core: `columns` (`load_columns`' buffers), the strings their
    indices name, and the rows to feed as events."""

    columns: tuple[np.ndarray, ...]
    instances: list[str]
    tenants: list[str]
    others: np.ndarray  # row numbers, ascending


def _codes(column: pa.Array, of_value: dict[str, int]) -> np.ndarray:
    """A string column as the core's int8 codes (-1 for a value it has none for)."""
    encoded = column.dictionary_encode()
    table = np.array([of_value.get(v, -1) for v in encoded.dictionary.to_pylist()] or [-1], dtype=np.int8)
    return table[encoded.indices.to_numpy(zero_copy_only=False)]


def _strings(column: pa.Array) -> tuple[np.ndarray, list[str]]:
    encoded = column.dictionary_encode()
    return np.ascontiguousarray(encoded.indices.to_numpy(zero_copy_only=False), dtype=np.int32), \
        encoded.dictionary.to_pylist()


def prepare(state: NativeState, batch: pa.RecordBatch) -> Prepared:
    """Resolve a batch (in the canonical schema, see `schema.arrow.conform`) for `apply_rows`:
    tables and identities are interned in `state` as applying the events one by one would."""
    n = batch.num_rows
    kind = _codes(batch.column("kind"), _KIND_CODE)
    key = batch.column("block_key").to_numpy()
    kind[(kind == _INVALIDATE) & (key == 0)] = _OTHER  # a bulk invalidation: its scope is the event's strings
    objects = kind >= 0
    inst, instances = _strings(batch.column("instance"))
    group = batch.column("group_id").to_numpy().astype(np.int64)
    table = np.full(n, -1, dtype=np.int32)
    if objects.any():
        scope = inst.astype(np.int64) << 16 | group
        found, where = np.unique(scope[objects], return_inverse=True)
        writing = set(np.unique(scope[objects & (kind <= _LAST_WRITE)]).tolist())
        ids = []
        for s in found.tolist():
            name, g = instances[s >> 16], s & 0xFFFF
            if s in writing:  # a write makes the instance's table (evictions and invalidations only look)
                state._instance(name)
                ids.append(state._table((name, g)))
            else:
                ids.append(state._tables.get((name, g), -1))
        table[objects] = np.array(ids, dtype=np.int32)[where]
    transfer = (kind == _OFFLOAD) | (kind == _LOAD)
    tier = np.where(transfer, _codes(batch.column("dst_tier"), _TIER_OF_VALUE),
                    _codes(batch.column("tier"), _TIER_OF_VALUE)).astype(np.int8)
    reason = _codes(batch.column("reason"), _REASON_OF_VALUE)
    tenant, tenants = _strings(batch.column("tenant"))
    identity = np.zeros(n, dtype=np.int32)
    commits = np.flatnonzero(kind == _COMMIT)
    if len(commits):
        identity[commits] = _identities(state, batch, commits)
    more = batch.column("more_keys")
    offsets = np.ascontiguousarray(more.offsets.to_numpy(), dtype=np.int32)
    values = np.ascontiguousarray(more.values.to_numpy(zero_copy_only=False), dtype=np.uint64)
    columns = (kind, table, inst, tier, reason, identity, np.ascontiguousarray(tenant), np.ascontiguousarray(key),
               offsets, values, np.ascontiguousarray(batch.column("nbytes").to_numpy()),
               np.ascontiguousarray(batch.column("checksum").to_numpy()),
               np.ascontiguousarray(batch.column("lease_expiry_ns").to_numpy(), dtype=np.int64))
    return Prepared(columns, instances, tenants, np.flatnonzero(~objects))


def _identities(state: NativeState, batch: pa.RecordBatch, rows: np.ndarray) -> np.ndarray:
    """The identity id of each of `rows` (commits), each distinct identity interned once."""
    picked = pa.array(rows)
    parts, values = [], []
    for name in _IDENTITY_STRINGS:
        encoded = batch.column(name).take(picked).dictionary_encode()
        parts.append(encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64))
        values.append(encoded.dictionary.to_pylist())
    epoch = batch.column("epoch").take(picked).to_numpy().view(np.int64)
    parts.append(epoch)
    if all(len(v) == 1 for v in values) and epoch.min() == epoch.max():
        distinct, where = np.zeros((1, 7), dtype=np.int64), np.zeros(len(rows), dtype=np.int64)
        distinct[0, 6] = epoch[0]
    else:
        distinct, where = np.unique(np.stack(parts, axis=1), axis=0, return_inverse=True)
    ids = []
    for row in distinct.tolist():
        model, revision, adapter, transform, dtype, layout = (values[i][row[i]] for i in range(6))
        ids.append(state._identity((model, revision, adapter, Transform(transform), dtype, layout,
                                    row[6] & 0xFFFFFFFFFFFFFFFF)))
    return np.array(ids, dtype=np.int32)[np.asarray(where).reshape(-1)]


def feed_batch(state: NativeState, batch: pa.RecordBatch, base_ord: int,
               feed: Callable[[Event, int], list], bail: Callable[[], bool],
               prepared: Prepared | None = None) -> tuple[list, int]:
    """Apply a batch's object rows in the core and `feed(event, row)` the others, in stream
    order (row i's stream position is base_ord + i + 1). Once `bail()` turns true after an
    event fed (a model refused, say), every later row is fed as an event. Returns what `feed`
    returned, in order, and the rows done. (`prepared`: the batch's `prepare`, when done.)"""
    if prepared is None:
        prepared = prepare(state, batch)
    core = state._core
    out: list = []
    others = prepared.others.tolist()
    events = from_arrow(pa.Table.from_batches([batch.take(pa.array(prepared.others))])) if others else []
    core.load_columns(prepared.columns, prepared.instances, prepared.tenants)  # type: ignore[attr-defined]
    try:
        apply = core.apply_rows  # type: ignore[attr-defined]
        pos = 0
        for row, event in zip(others, events, strict=True):
            if row > pos:
                apply(pos, row, base_ord)
            out += feed(event, row)
            pos = row + 1
            if bail():
                rest = batch.num_rows - pos
                if rest:
                    for i, late in enumerate(from_arrow(pa.Table.from_batches([batch.slice(pos)]))):
                        out += feed(late, pos + i)
                return out, batch.num_rows
        if pos < batch.num_rows:
            apply(pos, batch.num_rows, base_ord)
    finally:
        core.load_columns(None, [], [])  # type: ignore[attr-defined]
    return out, batch.num_rows
