"""Fenced method wrapping, shared by the engine shims.

A shim wraps methods of one engine object (never its class, so two engines in a process keep
their own hooks): the original runs first and its result is returned unchanged; the hook then
reads it, and any error in the hook is handed to the shim's failure counter instead of the
engine. A missing method (another engine release) logs once and leaves that hook off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any


def wrap_after(obj: Any, name: str, after: Callable[..., None], failed: Callable[[str], None],
               saved: list[tuple[Any, str, Any]], log: logging.Logger, engine: str) -> bool:
    """Call `after(result, *args, **kwargs)` after `obj.name`; False when there is no such method."""
    original = getattr(obj, name, None) if obj is not None else None
    if original is None:
        log.warning("kvtrace: %s's %s has no %s; that hook is off", engine, type(obj).__name__, name)
        return False

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        try:
            after(result, *args, **kwargs)
        except Exception:  # noqa: BLE001 - the engine must never see kvtrace fail
            failed(name)
        return result

    saved.append((obj, name, original))
    setattr(obj, name, wrapper)
    return True


def wrap_before(obj: Any, name: str, before: Callable[..., None], failed: Callable[[str], None],
                saved: list[tuple[Any, str, Any]], log: logging.Logger, engine: str) -> bool:
    """Call `before(*args, **kwargs)` ahead of `obj.name`, for hooks inside it that need to know
    which call they are in; False when there is no such method."""
    original = getattr(obj, name, None) if obj is not None else None
    if original is None:
        log.warning("kvtrace: %s's %s has no %s; that hook is off", engine, type(obj).__name__, name)
        return False

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            before(*args, **kwargs)
        except Exception:  # noqa: BLE001 - the engine must never see kvtrace fail
            failed(name)
        return original(*args, **kwargs)

    saved.append((obj, name, original))
    setattr(obj, name, wrapper)
    return True
