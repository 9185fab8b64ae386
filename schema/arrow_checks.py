"""`validation.clean`, column-wise: which rows of an events table can be stored as they are.

The columnar ingest path asks this once per batch instead of once per row. Rows it flags go to
the row path (`validation.problems` through `event_from_builtins`), which names their fault, so
this only has to be exact about which rows are clean; a property test holds it to `clean` on
the same events. Arrow can say things a typed event cannot (a null, an enum value that is not
one), and such rows are flagged too.

The rules are read off the schema where they can be (enum columns, integer bounds narrower than
the Arrow type, the fields each kind requires); the rest mirror `problems` one for one.
"""

from __future__ import annotations

import sys
from functools import cache

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrace.schema.arrow import arrow_schema
from kvtrace.schema.events import REQUIRED_BY_KIND, SCHEMA_VERSION, Event
from kvtrace.schema.fields import FieldSpec, field_specs
from kvtrace.schema.kinds import EVICT_REASONS, INVALIDATE_REASONS, EventKind
from kvtrace.schema.validation import MEASUREMENTS, recipe_problem

_FLOAT_MAX = sys.float_info.max


def _type_range(t: pa.DataType) -> tuple[int, int]:
    info = np.iinfo(t.to_pandas_dtype())
    return int(info.min), int(info.max)


def _innermost(t: pa.DataType) -> pa.DataType:
    while pa.types.is_list(t):
        t = t.value_type
    return t


@cache
def _narrow_bounds() -> tuple[tuple[str, int, int], ...]:
    """Integer columns whose allowed range is narrower than their Arrow type's: the only
    range checks Arrow's types leave to do."""
    out = []
    for spec, f in zip(field_specs(Event), arrow_schema(), strict=True):
        low, high = spec.column.low, spec.column.high
        if low is None or high is None or spec.enum_type is not None:
            continue
        if (low, high) != _type_range(_innermost(f.type)):
            if spec.depth:
                raise RuntimeError(f"list column {spec.name} has bounds narrower than its type: check them here")
            out.append((spec.name, low, high))
    return tuple(out)


@cache
def _enum_columns() -> tuple[tuple[FieldSpec, pa.Array], ...]:
    return tuple((s, pa.array([m.value for m in s.enum_type], pa.string()))
                 for s in field_specs(Event) if s.enum_type is not None)


def _flat(arr: pa.Array, depth: int) -> tuple[pa.Array, np.ndarray]:
    """The innermost values of a list array `depth` deep, and the row each came from."""
    rows = np.arange(len(arr))
    for _ in range(depth):
        parents = pc.list_parent_indices(arr).to_numpy(zero_copy_only=False)
        rows = rows[parents]
        arr = pc.list_flatten(arr)
    return arr, rows


def _rows_where(arr: pa.Array, depth: int, bad_values: pa.Array | np.ndarray | None, n: int) -> np.ndarray:
    """Rows with a null at any level of a column, or (given) a bad innermost value."""
    bad = np.zeros(n, dtype=bool)
    level = arr
    rows = np.arange(n)
    for d in range(depth + 1):
        if level.null_count:
            bad[rows[~np.asarray(level.is_valid())]] = True
        if d < depth:
            parents = pc.list_parent_indices(level).to_numpy(zero_copy_only=False)
            rows = rows[parents]
            level = pc.list_flatten(level)
    if bad_values is not None and len(rows):
        bad[rows[np.asarray(bad_values, dtype=bool)]] = True
    return bad


def _lit(arr: pa.Array, value: object) -> pa.Scalar:
    """A literal of the column's own type: comparing a uint64 column with a plain int would
    cast the column to int64 and fail on keys past 2**63."""
    return pa.scalar(value, _innermost(arr.type))


def _true(mask: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A boolean compute result as numpy, null counted as false (most have no null to fill)."""
    return np.asarray(pc.fill_null(mask, False) if mask.null_count else mask)


def _empty(arr: pa.Array, spec: FieldSpec) -> np.ndarray:
    """Rows holding the field's empty value (what `not getattr(event, name)` tests)."""
    if spec.depth:
        return _true(pc.equal(pc.list_value_length(arr), 0))
    if pa.types.is_string(arr.type):
        return _true(pc.equal(arr, ""))
    if pa.types.is_boolean(arr.type):
        return _true(pc.invert(arr))
    return _true(pc.equal(arr, _lit(arr, 0)))


def clean_rows(table: pa.Table) -> np.ndarray:
    """Per row: True when the row is an event of this schema version that `problems` would
    find nothing wrong with. `table` must have the canonical schema (`arrow.conform`)."""
    n = table.num_rows
    if not n:
        return np.zeros(0, dtype=bool)
    # A batch read from one IPC message is one chunk a column: taken as it is (combining copies).
    col = {name: (c.chunk(0) if (c := table.column(name)).num_chunks == 1 else c.combine_chunks())
           for name in table.column_names}
    specs = {s.name: s for s in field_specs(Event)}
    bad = np.zeros(n, dtype=bool)

    # Nulls anywhere, and enum values that are not members.
    enums = {s.name: values for s, values in _enum_columns()}
    for name, spec in specs.items():
        arr = col[name]
        if name in enums:
            flat, _ = _flat(arr, spec.depth)
            outside = np.asarray(pc.invert(pc.fill_null(pc.is_in(flat, value_set=enums[name]), True)))
            bad |= _rows_where(arr, spec.depth, outside, n)
        elif arr.null_count or spec.depth:
            bad |= _rows_where(arr, spec.depth, None, n)

    bad |= ~_true(pc.equal(col["schema_version"], _lit(col["schema_version"], SCHEMA_VERSION)))
    bad |= ~_true(pc.greater(col["ts_ns"], _lit(col["ts_ns"], 0)))
    bad |= ~_true(pc.not_equal(col["source_id"], _lit(col["source_id"], 0)))
    for name, low, high in _narrow_bounds():
        bad |= ~_true(pc.and_(pc.greater_equal(col[name], _lit(col[name], low)),
                                 pc.less_equal(col[name], _lit(col[name], high))))
    for name in MEASUREMENTS:  # NaN compares false, as it fails isfinite()
        bad |= ~_true(pc.and_(pc.greater_equal(col[name], 0.0), pc.less_equal(col[name], _FLOAT_MAX)))
    bad |= ~_true(pc.greater_equal(col["token_end"], col["token_start"]))
    bad |= ~_true(pc.equal(pc.list_value_length(col["reused_tiers"]), pc.list_value_length(col["reused_tokens"])))

    kind = col["kind"]
    for k, names in REQUIRED_BY_KIND.items():
        of_kind = _true(pc.equal(kind, k.value))
        if of_kind.any():
            for name in names:
                bad |= of_kind & _empty(col[name], specs[name])
    reason = col["reason"]
    for k, allowed in ((EventKind.EVICT, EVICT_REASONS), (EventKind.INVALIDATE, INVALIDATE_REASONS)):
        stray = pc.invert(pc.is_in(reason, value_set=pa.array([r.value for r in allowed], pa.string())))
        bad |= _true(pc.and_(pc.and_(pc.equal(kind, k.value), pc.not_equal(reason, "")), stray))
    more = col["more_keys"]
    has_more = _true(pc.greater(pc.list_value_length(more), 0))
    if has_more.any():
        keys, rows = _flat(more, 1)
        zero = np.zeros(n, dtype=bool)
        zero[rows[_true(pc.equal(keys, _lit(keys, 0)))]] = True
        lookup_or_adopt = _true(pc.is_in(kind, value_set=pa.array([EventKind.LOOKUP.value, EventKind.ADOPT.value])))
        bad |= has_more & (lookup_or_adopt | _true(pc.equal(col["block_key"], _lit(col["block_key"], 0))) | zero)
    bad |= _true(pc.and_(pc.equal(kind, EventKind.LOOKUP.value),
                         pc.greater(col["reported_hit_tokens"], col["prompt_tokens"])))
    attach = np.flatnonzero(_true(pc.equal(kind, EventKind.ATTACH.value)))
    if attach.size:  # rare (one per engine start): each recipe decoded as the row check does
        recipes = col["recipe"].take(pa.array(attach)).to_pylist()
        bad[attach] |= np.array([bool(text) and bool(recipe_problem(text)) for text in recipes], dtype=bool)
    return ~bad
