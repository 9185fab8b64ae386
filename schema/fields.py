"""Reads a stored Struct's annotations into plain field specs that every format derives from."""

from __future__ import annotations

import enum
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any

import msgspec

from kvtrace.schema.columns import Column, Sorted

_LABEL = Column("LowCardinality(String)", "string")


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """One event field as storage sees it: a scalar column type nested `depth` lists deep."""

    name: str
    column: Column
    depth: int
    enum_type: type[enum.Enum] | None
    is_sorted: bool
    default: Any
    doc: str

    @property
    def clickhouse_type(self) -> str:
        out = self.column.clickhouse
        for _ in range(self.depth):
            out = f"Array({out})"
        return out


def _unwrap(tp: Any) -> tuple[Any, list[Any]]:
    """Split Annotated[...] into the bare type and all its metadata, flattening nesting."""
    extras: list[Any] = []
    while typing.get_origin(tp) is typing.Annotated:
        args = typing.get_args(tp)
        tp, extras = args[0], [*args[1:], *extras]
    return tp, extras


def _spec(name: str, tp: Any, default: Any) -> FieldSpec:
    depth = 0
    metas: list[Any] = []
    tp, extras = _unwrap(tp)
    metas += extras
    while typing.get_origin(tp) is list:
        depth += 1
        tp, extras = _unwrap(typing.get_args(tp)[0])
        metas += extras
    enum_type = tp if isinstance(tp, type) and issubclass(tp, enum.Enum) else None
    column = next((m for m in metas if isinstance(m, Column)), _LABEL if enum_type else None)
    if column is None:
        raise TypeError(f"field {name!r} has no Column marker; give it one in schema.columns")
    doc = next((m.description for m in metas if isinstance(m, msgspec.Meta) and m.description), "")
    return FieldSpec(
        name=name,
        column=column,
        depth=depth,
        enum_type=enum_type,
        is_sorted=any(isinstance(m, Sorted) for m in metas),
        default=default,
        doc=doc,
    )


def _struct_info(struct: type[msgspec.Struct]) -> msgspec.inspect.StructType:
    info = msgspec.inspect.type_info(struct)
    if not isinstance(info, msgspec.inspect.StructType):
        raise TypeError(f"{struct!r} is not a msgspec Struct")
    return info


@cache
def field_specs(struct: type[msgspec.Struct]) -> tuple[FieldSpec, ...]:
    """Every field of a stored Struct (the event, a quarantine row, ...), in Struct order."""
    hints = typing.get_type_hints(struct, include_extras=True)
    info = _struct_info(struct)
    out = []
    for f in info.fields:
        default = f.default if f.default is not msgspec.NODEFAULT else None
        if f.default_factory is not msgspec.NODEFAULT:
            default = f.default_factory()
        out.append(_spec(f.name, hints[f.name], default))
    return tuple(out)


@cache
def required_fields(struct: type[msgspec.Struct]) -> frozenset[str]:
    """Fields a record must carry, whatever else it holds."""
    return frozenset(f.name for f in _struct_info(struct).fields if f.required)
