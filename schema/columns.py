"""Column type markers carried inside `typing.Annotated` on the event fields.

The event Struct is the one source of truth. Each field's annotation says, once, how the value
is stored: the ClickHouse type, the Arrow type and the integer range. The DDL, Arrow schema,
JSON Schema and range checks are all read off these markers, so they cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import msgspec


@dataclass(frozen=True, slots=True)
class Column:
    """Storage facts for one scalar type.

    `clickhouse` is the column type, `arrow` names a pyarrow type factory, `low` / `high` bound
    integers (msgspec cannot express a uint64 upper bound, so range checks read these), and
    `codec` is the ClickHouse compression codec that pays off for the value's shape.
    """

    clickhouse: str
    arrow: str
    low: int | None = None
    high: int | None = None
    codec: str | None = None


@dataclass(frozen=True, slots=True)
class Sorted:
    """Marks a column whose values arrive nearly sorted (timestamps, sequence numbers).

    Delta coding turns such a series into small numbers, so the DDL gives it a Delta codec.
    """

    codec: str = "CODEC(Delta, ZSTD(1))"


U8 = Annotated[int, msgspec.Meta(ge=0, le=2**8 - 1), Column("UInt8", "uint8", 0, 2**8 - 1)]
U16 = Annotated[int, msgspec.Meta(ge=0, le=2**16 - 1), Column("UInt16", "uint16", 0, 2**16 - 1)]
U32 = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1), Column("UInt32", "uint32", 0, 2**32 - 1)]
U64 = Annotated[int, msgspec.Meta(ge=0), Column("UInt64", "uint64", 0, 2**64 - 1)]
I64 = Annotated[int, Column("Int64", "int64", -(2**63), 2**63 - 1)]
TimeNs = Annotated[int, msgspec.Meta(ge=0), Column("Int64", "int64", 0, 2**63 - 1, codec="CODEC(T64, ZSTD(1))")]
DurationNs = Annotated[int, msgspec.Meta(ge=0), Column("UInt64", "uint64", 0, 2**63 - 1, codec="CODEC(T64, ZSTD(1))")]
# Hashes are random: compression cannot help, so they are stored plain.
Hash64 = Annotated[int, msgspec.Meta(ge=0), Column("UInt64", "uint64", 0, 2**64 - 1)]
Label = Annotated[str, Column("LowCardinality(String)", "string")]
Text = Annotated[str, Column("String", "string", codec="CODEC(ZSTD(1))")]
Flag = Annotated[bool, Column("Bool", "bool_")]
F64 = Annotated[float, Column("Float64", "float64")]
