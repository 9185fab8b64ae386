"""The emitting API shims call: a process-wide emitter that is a no-op until configured.

Shims do `em = get_emitter()` once and guard event construction with `if em.enabled:`, so a
process without kvtrace configured pays one attribute read per hook and builds nothing.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Protocol

from kvtrace.schema.events import Event
from kvtrace.schema.records import EmitterStats


class Emitter(Protocol):
    enabled: bool

    def emit(self, event: Event) -> None: ...

    def sampled(self, key: int, rate: float) -> bool: ...

    def stats(self) -> EmitterStats: ...

    def force_flush(self, timeout_millis: int = 10000) -> bool: ...

    def shutdown(self) -> bool: ...


class NoopEmitter:
    """What every process has until kvtrace is configured; costs nothing."""

    enabled = False
    source_id = 0

    def emit(self, event: Event) -> None:
        return None

    def sampled(self, key: int, rate: float) -> bool:
        return False

    def stats(self) -> EmitterStats:
        return EmitterStats(ts_ns=0, source_id=0)

    def force_flush(self, timeout_millis: int = 10000) -> bool:
        return True

    def shutdown(self) -> bool:
        return True


def key_sampled(key: int, rate: float) -> bool:
    """Whether per-key sampling at `rate` keeps `key`: a pure function of both, so every process
    that asks about one request gets the same answer."""
    return rate >= 1.0 or (key * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF) / 2**64 < rate


def request_key(request_id: object) -> int:
    """A request id as the 64-bit key `Emitter.sampled` takes: the same in every process and
    on every host (Python's `hash` of a string is salted per process), so the prefill and the
    decode instance of one request, or an engine and its out-of-process resolver, sample it
    alike."""
    return int.from_bytes(hashlib.blake2b(str(request_id).encode("utf-8"), digest_size=8).digest(), "little")


_NOOP = NoopEmitter()
_current: Emitter = _NOOP
_lock = threading.Lock()


def get_emitter() -> Emitter:
    return _current


def set_emitter(emitter: Emitter | None) -> Emitter:
    """Install the process-wide emitter (None restores the no-op); returns the previous one."""
    global _current
    with _lock:
        previous, _current = _current, (emitter if emitter is not None else _NOOP)
    return previous
