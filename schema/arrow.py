"""Arrow / Parquet schema derived from the stored Structs, and columnar conversion.

Arrow is the columnar hand-off between every store: ClickHouse inserts and queries, Parquet
exports DuckDB reads, and polars frames. Conversion transposes rows once; no per-value Python
dispatch beyond that.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from functools import cache
from operator import attrgetter
from typing import Any

import msgspec
import pyarrow as pa

from kvtrace.schema.events import SCHEMA_VERSION, Event
from kvtrace.schema.fields import FieldSpec, field_specs

SCHEMA_METADATA_KEY = b"kvtrace.schema_version"


def arrow_type(spec: FieldSpec) -> pa.DataType:
    out: pa.DataType = getattr(pa, spec.column.arrow)()
    for _ in range(spec.depth):
        out = pa.list_(out)
    return out


@cache
def arrow_schema(struct: type[msgspec.Struct] = Event) -> pa.Schema:
    """The Arrow schema of a stored Struct, tagged with the schema version it was made by."""
    fields = [
        pa.field(s.name, arrow_type(s), nullable=False, metadata={"doc": s.doc} if s.doc else None)
        for s in field_specs(struct)
    ]
    return pa.schema(fields, metadata={SCHEMA_METADATA_KEY: str(SCHEMA_VERSION).encode()})


def to_arrow(records: Sequence[msgspec.Struct], struct: type[msgspec.Struct] = Event) -> pa.Table:
    """Columnar table of records; enum members are stored by value.

    Column by column, each gathered with one C-level attribute getter: no per-row objects, so
    the cyclic GC is never woken (transposing `astuple` rows woke it, and in an engine process
    its full collections scanned the engine's whole heap), and pausing it is not ours to do in
    another program's process. A column holding only its field's default (most of the wide
    event's columns, for any one kind) is made without converting its values. About 1.4x
    faster than the row transpose; it matters where a batch becomes Arrow on a hot path (the
    columnar wire, the store sink).
    """
    schema = arrow_schema(struct)
    if not records:
        return schema.empty_table()
    n = len(records)
    arrays = []
    for (name, default), f in zip(_defaults(struct), schema, strict=True):
        values = list(map(attrgetter(name), records))
        if default is not None and values.count(default) == n:
            arrays.append(pa.repeat(pa.scalar(default, f.type), n))
        else:
            arrays.append(pa.array(values, type=f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


@cache
def _defaults(struct: type[msgspec.Struct]) -> tuple[tuple[str, Any], ...]:
    """Each field's name, and its default as a column value where a column of only that value
    can be made without looking at the values' types (None elsewhere)."""
    out = []
    for s in field_specs(struct):
        default = s.default.value if isinstance(s.default, enum.Enum) else s.default
        # Only where equality is exact: "" equals only (enum) strings and [] only lists, whereas
        # 0 == False == 0.0 == -0.0, so counting an int, bool or float default would skip the
        # conversion that refuses a bool in an integer column (or turn -0.0 into 0.0).
        out.append((s.name, default if isinstance(default, str | list) else None))
    return tuple(out)


def conform(table: pa.Table, struct: type[msgspec.Struct] = Event) -> pa.Table:
    """Cast a table from any reader (ClickHouse, Parquet, DuckDB) to the canonical schema.

    Columns an older writer did not have are filled with the field's default, so files written
    by an earlier schema version still load.
    """
    schema = arrow_schema(struct)
    specs = {s.name: s for s in field_specs(struct)}
    arrays = []
    for f in schema:
        if f.name in table.column_names:
            col = table.column(f.name)
            if pa.types.is_dictionary(col.type):
                col = col.cast(col.type.value_type)
            arrays.append(col.cast(f.type))
        else:
            default = specs[f.name].default
            default = default.value if hasattr(default, "value") else default
            arrays.append(pa.repeat(pa.scalar(default, f.type), table.num_rows))
    return pa.Table.from_arrays(arrays, schema=schema)


def iter_rows(table: pa.Table) -> Iterator[dict[str, Any]]:
    """Plain dict rows of a table, batch by batch, for validation."""
    for batch in table.to_batches(max_chunksize=65536):
        yield from batch.to_pylist()


_EVENTS = msgspec.json.Decoder(list[Event])


def from_arrow(table: pa.Table) -> list[Event]:
    """Events of a table that already passed validation (the store, our own exports).

    The rows go through one columnar JSON encoding (polars, in Rust) and one typed msgspec
    decode (in C): about twice as fast as building a dict per row in Python. polars is imported
    here, not with the module: an engine that only encodes Arrow (the columns wire) needs
    pyarrow alone.
    """
    import polars as pl

    if not table.num_rows:
        return []
    return _EVENTS.decode(pl.from_arrow(conform(table)).write_json())  # type: ignore[union-attr]


