"""The check every engine's tests run on what kvtrace wrapped: a wrapper must wear its original's
face (signature, annotations, name, docstring), because engines read them (vLLM converts a
utility call's arguments by the called method's annotations)."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Iterable
from typing import Any


def _hints(obj: Any) -> Any:
    try:
        return typing.get_type_hints(obj)
    except Exception as exc:  # noqa: BLE001 - an engine's own forward reference: it must fail the same way
        return f"unresolvable: {type(exc).__name__}"


def face_differences(original: Any, wrapped: Any) -> list[str]:
    """What an engine reading `wrapped` would see differently from `original` (empty: nothing)."""
    out = []
    try:
        before, after = inspect.signature(original), inspect.signature(wrapped)
    except (TypeError, ValueError) as exc:  # a builtin without a signature: then neither may have one
        before, after = f"none ({exc})", _signature_or_none(wrapped)
    if str(before) != str(after):
        out.append(f"signature {after} instead of {before}")
    if _hints(original) != _hints(wrapped):
        out.append(f"annotations {_hints(wrapped)} instead of {_hints(original)}")
    for attr in ("__name__", "__qualname__", "__doc__"):
        if getattr(original, attr, None) != getattr(wrapped, attr, None):
            out.append(f"{attr} {getattr(wrapped, attr, None)!r} instead of {getattr(original, attr, None)!r}")
    return out


def _signature_or_none(obj: Any) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError) as exc:
        return f"none ({exc})"


def unfaithful(wrapped: Iterable[tuple[Any, str, Any]]) -> dict[str, list[str]]:
    """Of (object or class, name, original) triples, the methods now in place whose face differs
    from their original's, by `Owner.name`."""
    found = {}
    for owner, name, original in wrapped:
        raw = original.__func__ if isinstance(original, (classmethod, staticmethod)) else original
        now = inspect.getattr_static(owner, name) if isinstance(owner, type) else getattr(owner, name)
        now = now.__func__ if isinstance(now, (classmethod, staticmethod)) else now
        diffs = face_differences(raw, now)
        if diffs:
            label = owner.__name__ if isinstance(owner, type) else type(owner).__name__
            found[f"{label}.{name}"] = diffs
    return found
