"""Fenced method wrapping, shared by the engine shims.

A shim wraps methods of one engine object (never its class, so two engines in a process keep
their own hooks): the original runs first and its result is returned unchanged; the hook then
reads it, and any error in the hook is handed to the shim's failure counter instead of the
engine. A missing method (another engine release) logs once and leaves that hook off.

Each shim keeps what it wrapped in one `HookSet`, made with its engine's name, its logger and
its failure counter, and puts everything back with `restore()`. Where a hook must sit on a class
(the engine builds the object in a process kvtrace never sees before, or calls the method on the
class), `patch_class` does it, once per process.

Every wrapper wears its original's face (`transparent`): name, qualified name, docstring,
annotations and signature. Engines read them: vLLM converts a utility call's msgpack arguments
by the annotations of the method it calls (`inspect.signature`), so a bare `*args, **kwargs`
wrapper on `EngineCore.add_lora` handed the adapter in as a raw list and killed the engine core.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

_MISSING = object()


def transparent(original: Any, wrapper: Callable[..., Any]) -> Callable[..., Any]:
    """`wrapper`, wearing `original`'s name, qualified name, module, docstring and annotations,
    with `__wrapped__` pointing at it: `inspect.signature` and `typing.get_type_hints` then read
    the original's (its module's globals too, for annotations written as strings)."""
    functools.update_wrapper(wrapper, original)
    # What the original's __dict__ held comes along (an engine's own markers), except that it was
    # abstract: the wrapper is not, and a class whose methods say so cannot be built.
    wrapper.__dict__.pop("__isabstractmethod__", None)
    return wrapper


_class_patches: list[tuple[type, str, Any]] = []  # (class, name, what vars(class) held before)


def patch_class(cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Put `make(original)` in place of `cls.name`, wearing the original's face; a classmethod or
    staticmethod stays one (`make` gets and returns the plain function). False, and nothing done,
    when the class has no such method. Every patch is listed by `class_patches()`."""
    try:
        raw = inspect.getattr_static(cls, name)
    except AttributeError:
        return False
    kind = type(raw) if isinstance(raw, (classmethod, staticmethod)) else None
    function = raw.__func__ if kind is not None else raw
    wrapper = transparent(function, make(function))
    setattr(cls, name, kind(wrapper) if kind is not None else wrapper)
    _class_patches.append((cls, name, raw))
    return True


def class_patches() -> list[tuple[type, str, Any]]:
    """What `patch_class` replaced in this process: (class, name, the attribute it held before)."""
    return list(_class_patches)


def _holds_itself(obj: Any, name: str, current: Any) -> bool:
    """Whether `obj.name` is the object's own attribute rather than its class's method, told
    without reading `obj.__dict__`: on CPython 3.11+ that read turns the object's inline
    attribute values into a dict for good, and every attribute access of the engine's own code
    on that object (a block pool's, per block) falls off its fast path: a few percent of a vLLM
    step for nothing."""
    for klass in type(obj).__mro__:
        found = vars(klass).get(name, _MISSING)
        if found is not _MISSING:
            break
    else:
        return True
    bind = getattr(type(found), "__get__", None)
    try:
        return bool(current != (bind(found, obj, type(obj)) if bind is not None else found))
    except Exception:  # noqa: BLE001 - an odd attribute: treat it as the object's own
        return True


class HookSet:
    """The methods one shim has wrapped, and what was there before.

    `wrap_after` and `wrap_before` build the fenced wrappers every shim uses; `replace` puts a
    wrapper a shim wrote by hand (one that needs more than a hook before or after) in place.
    Each wrapper is one closure over the original: a wrapped call costs the same whichever way
    it was made. `restore()` undoes them in reverse order, and is safe to call again.
    """

    __slots__ = ("_saved", "engine", "failed", "log")

    def __init__(self, engine: str, log: logging.Logger, failed: Callable[[str], None]) -> None:
        self.engine = engine  # as log lines name it: "SGLang", "vLLM", "LMCache"
        self.log = log
        self.failed = failed  # told the hook's method name when a hook raises
        self._saved: list[tuple[Any, str, Any, bool]] = []  # (object, name, original, the object's own)

    def __len__(self) -> int:
        """How many methods are wrapped now."""
        return len(self._saved)

    def wrapped(self) -> list[tuple[Any, str, Any]]:
        """What is wrapped now: (object, name, the method before the wrap)."""
        return [(obj, name, original) for obj, name, original, _ in self._saved]

    def _original(self, obj: Any, name: str) -> Any:
        original = getattr(obj, name, None) if obj is not None else None
        if original is None:
            self.log.warning("kvtrace: %s's %s has no %s; that hook is off", self.engine, type(obj).__name__,
                             name)
        return original

    def wrap_after(self, obj: Any, name: str, after: Callable[..., None]) -> bool:
        """Call `after(result, *args, **kwargs)` after `obj.name`; False when there is no such method."""
        original = self._original(obj, name)
        if original is None:
            return False
        failed = self.failed

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            try:
                after(result, *args, **kwargs)
            except Exception:  # noqa: BLE001 - the engine must never see kvtrace fail
                failed(name)
            return result

        self.replace(obj, name, wrapper)
        return True

    def wrap_before(self, obj: Any, name: str, before: Callable[..., None]) -> bool:
        """Call `before(*args, **kwargs)` ahead of `obj.name`, for hooks inside it that need to know
        which call they are in; False when there is no such method."""
        original = self._original(obj, name)
        if original is None:
            return False
        failed = self.failed

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                before(*args, **kwargs)
            except Exception:  # noqa: BLE001 - the engine must never see kvtrace fail
                failed(name)
            return original(*args, **kwargs)

        self.replace(obj, name, wrapper)
        return True

    def replace(self, obj: Any, name: str, wrapper: Callable[..., Any]) -> None:
        """Put `wrapper`, written by hand around the method `obj.name` (which must exist: the
        wrapper calls it), in its place, wearing the method's face; `restore` puts the method
        back. A wrapper written so fences its own hooks: the engine's call must run and return
        as it would."""
        original = getattr(obj, name)
        self._saved.append((obj, name, original, _holds_itself(obj, name, original)))
        setattr(obj, name, transparent(original, wrapper))

    def restore(self) -> None:
        """Put every wrapped method back, the last wrapped first: an attribute the object had of
        its own is set again, a method it took from its class shows through again."""
        saved, self._saved = self._saved, []
        for obj, name, original, own in reversed(saved):
            if own:
                setattr(obj, name, original)
            else:
                try:
                    delattr(obj, name)
                except AttributeError:  # taken off already
                    pass
