"""The web dashboard's time range: relative ranges, ISO-8601 or Unix-seconds bounds, and which
clock a relative range counts back from.

A relative range ("last 1h") ends now when the store holds events that recent. When its newest
event is older than the range (a replayed trace keeps its trace's time; a collector that
stopped), it ends at the newest event instead, so "last 1h" shows the last hour of data rather
than an empty page; the page says which clock applied. Pure functions: the caller reads the
store's bounds and the wall clock.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timezone
from enum import StrEnum

RANGES: dict[str, int | None] = {"15m": 900, "1h": 3600, "6h": 6 * 3600, "24h": 86400, "7d": 7 * 86400, "all": None}
RANGE_NAMES = {"15m": "last 15 minutes", "1h": "last hour", "6h": "last 6 hours", "24h": "last 24 hours",
               "7d": "last 7 days", "all": "everything stored"}
CUSTOM = "custom"
REFRESH: dict[str, int] = {"off": 0, "10s": 10, "30s": 30, "1m": 60}
_UNIX = re.compile(r"\d{1,12}(\.\d*)?")


class BadInput(ValueError):
    """A query parameter the dashboard cannot read; the message names it and says what works."""


class Clock(StrEnum):
    WALL = "wall"  # a relative range ending now
    NEWEST_EVENT = "newest_event"  # a relative range ending at the store's newest event
    STORED = "stored"  # everything stored
    FIXED = "fixed"  # explicit from/to


@dataclass(frozen=True, slots=True)
class Window:
    from_s: int
    to_s: int
    range_key: str  # a key of RANGES, or CUSTOM
    clock: Clock

    def describe(self, now_s: int) -> str:
        """One sentence for the page: the range, in UTC, and the clock it counts from."""
        span = f"{utc(self.from_s)} to {utc(self.to_s)} UTC"
        if self.clock is Clock.WALL:
            return f"Showing the {RANGE_NAMES[self.range_key]}, ending now: {span}."
        if self.clock is Clock.NEWEST_EVENT:
            return (f"Showing the {RANGE_NAMES[self.range_key]} of data, ending at the newest stored event "
                    f"({_ago(now_s - self.to_s)} ago): {span}. Relative ranges count back from the newest event "
                    "when nothing is newer than the range (a replayed trace keeps its own clock).")
        if self.clock is Clock.STORED:
            return f"Showing everything stored: {span}."
        return f"Showing {span}."


def utc(seconds: int) -> str:
    return f"{datetime.fromtimestamp(seconds, timezone.utc):%Y-%m-%d %H:%M:%S}"


def iso(seconds: int) -> str:
    return f"{datetime.fromtimestamp(seconds, timezone.utc):%Y-%m-%dT%H:%M:%SZ}"


def _ago(seconds: int) -> str:
    seconds = max(0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}".replace(".0 ", " ")
    return f"{seconds} s"


def parse_instant(name: str, text: str) -> int:
    """Unix seconds from Unix seconds or ISO-8601 (a date, or a date and time; no zone means UTC)."""
    value = text.strip()
    if _UNIX.fullmatch(value):
        return int(float(value))
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise BadInput(f"{name}={text!r} is neither an ISO-8601 time (e.g. 2025-06-15T12:00:00Z or 2025-06-15) "
                       "nor Unix seconds") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    seconds = int(moment.timestamp())
    if seconds < 0:
        raise BadInput(f"{name}={text!r} is before 1970")
    return seconds


def parse_choice(name: str, text: str, choices: dict[str, object] | tuple[str, ...]) -> str:
    if text not in choices:
        raise BadInput(f"{name}={text!r} is not one of {', '.join(choices)}")
    return text


def parse_positive(name: str, text: str) -> int | None:
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise BadInput(f"{name}={text!r} is not a whole number of seconds, 1 or more")
    return int(text)


def resolve(range_key: str, start: str, end: str, stored: tuple[int, int], now_s: int) -> Window:
    """The window a request asks for. Explicit bounds win unless a relative range is named;
    a missing bound is the store's."""
    lo, hi = stored
    if range_key and range_key != CUSTOM:
        parse_choice("range", range_key, RANGES)
    explicit = bool(start or end) and range_key in ("", CUSTOM)
    if explicit:
        from_s = parse_instant("from", start) if start else lo
        to_s = parse_instant("to", end) if end else hi
        if from_s > to_s:
            raise BadInput(f"from ({iso(from_s)}) is after to ({iso(to_s)})")
        return Window(from_s, to_s, CUSTOM, Clock.FIXED)
    span = RANGES.get(range_key or "all")
    if span is None:
        return Window(lo, hi, "all", Clock.STORED)
    if hi == 0 or hi >= now_s - span:  # an empty store, or data within the range: the wall clock
        return Window(now_s - span, now_s, range_key, Clock.WALL)
    return Window(hi - span, hi, range_key, Clock.NEWEST_EVENT)
