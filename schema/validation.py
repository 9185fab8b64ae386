"""Turns untrusted rows into events, or into rejections that name the row, field and fault.

Types and ranges are checked by msgspec while decoding; what a type cannot say (which fields a
kind needs, end >= start, uint64 bounds, the schema version) is checked here. A bad row never
takes its batch down: callers get the good events and a `Rejection` for each bad row.
"""

from __future__ import annotations

import math
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

import msgspec

from kvtrace.schema.events import REQUIRED_BY_KIND, SCHEMA_VERSION, WIRE_REQUIRED, Event
from kvtrace.schema.fields import field_specs
from kvtrace.schema.kinds import EVICT_REASONS, INVALIDATE_REASONS, EventKind
from kvtrace.schema.recipes import RecipeError, recipe_from_json
from kvtrace.schema.records import Rejection

Upgrade = Callable[[dict[str, Any]], dict[str, Any]]

UPGRADES: dict[int, Upgrade] = {}
"""Rewrites a row of version v into version v + 1, for changes that are not a pure addition.

Added fields need no entry: rows that lack them take the field's default.
"""


MEASUREMENTS = ("probe_max_abs_diff", "probe_mean_kl", "probe_max_kl", "noise_floor")
"""The float columns: JSON cannot carry NaN or infinity, and a negative distance is a bug."""


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with one event."""

    field: str
    reason: str


class InvalidEvent(ValueError):
    """An event that cannot be stored; `field` names the culprit ('' for the whole row)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}" if field else reason)
        self.field = field
        self.reason = reason


_PATH = re.compile(r"at `\$((?:\.[A-Za-z_][A-Za-z0-9_]*|\[\d+\])*)`")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def _field_of(message: str) -> str:
    if m := _MISSING.search(message):
        return m.group(1)
    if m := _PATH.search(message):
        return m.group(1).lstrip(".")
    return ""


@cache
def _int_bounds(struct: type[msgspec.Struct] = Event) -> tuple[tuple[str, int, int, int], ...]:
    return tuple(
        (s.name, s.depth, s.column.low, s.column.high)
        for s in field_specs(struct)
        if s.column.low is not None and s.column.high is not None and s.enum_type is None
    )


def _out_of_range(value: Any, depth: int, low: int, high: int) -> Iterator[tuple[int, ...]]:
    if depth == 0:
        if isinstance(value, int) and not low <= value <= high:
            yield ()
        return
    for i, item in enumerate(value):
        for path in _out_of_range(item, depth - 1, low, high):
            yield (i, *path)


def range_problems(record: msgspec.Struct) -> list[Problem]:
    """Integers outside their column's range (what msgspec cannot check for uint64 columns)."""
    out = []
    for name, depth, low, high in _int_bounds(type(record)):
        for path in _out_of_range(getattr(record, name), depth, low, high):
            out.append(Problem(name + "".join(f"[{i}]" for i in path), f"out of range [{low}, {high}]"))
    return out


@cache
def _int64_bounds(struct: type[msgspec.Struct] = Event) -> tuple[tuple[str, int, int, int], ...]:
    """The bounds msgspec does not enforce on a msgpack decode: msgpack integers fit in
    [-2**63, 2**64 - 1] and msgspec checks the narrower columns' `Meta`, leaving int64 columns."""
    return tuple(b for b in _int_bounds(struct) if b[3] == 2**63 - 1)


def problems(event: Event, msgpack_decoded: bool = False) -> list[Problem]:
    """Everything wrong with an already typed event; empty when it can be stored.

    `msgpack_decoded`: the event came from a typed msgpack decode, so only the int64 columns'
    ranges are left to check (the ingest fast path).
    """
    out: list[Problem] = []
    if not 1 <= event.schema_version <= SCHEMA_VERSION:
        out.append(
            Problem(
                "schema_version",
                f"unknown schema version {event.schema_version} (this reader knows 1..{SCHEMA_VERSION})",
            )
        )
    if msgpack_decoded:
        for name, depth, low, high in _int64_bounds():
            for path in _out_of_range(getattr(event, name), depth, low, high):
                out.append(Problem(name + "".join(f"[{i}]" for i in path), f"out of range [{low}, {high}]"))
    else:
        out += range_problems(event)
    if event.ts_ns <= 0:
        out.append(Problem("ts_ns", "must be a positive Unix time in nanoseconds"))
    if event.source_id == 0:
        out.append(Problem("source_id", "must be non-zero (the emitter draws a random one)"))
    for name in MEASUREMENTS:
        value = getattr(event, name)
        if not (math.isfinite(value) and value >= 0.0):  # NaN compares false: caught here too
            out.append(Problem(name, f"{value!r}: a measurement must be finite and not negative"))
    if event.token_end < event.token_start:
        out.append(
            Problem("token_end", f"token_end {event.token_end} < token_start {event.token_start}")
        )
    for name in REQUIRED_BY_KIND[event.kind]:
        if not getattr(event, name):
            out.append(Problem(name, f"required for a {event.kind.value} event"))
    if event.kind is EventKind.EVICT and event.reason and event.reason not in EVICT_REASONS:
        out.append(Problem("reason", f"{event.reason.value!r} is not an evict reason"))
    if (
        event.kind is EventKind.INVALIDATE
        and event.reason
        and event.reason not in INVALIDATE_REASONS
    ):
        out.append(Problem("reason", f"{event.reason.value!r} is not an invalidate reason"))
    if event.more_keys:
        if event.kind in (EventKind.LOOKUP, EventKind.ADOPT) or not event.block_key:
            out.append(Problem("more_keys", "only object events with a block_key can name more blocks"))
        elif 0 in event.more_keys:
            out.append(Problem("more_keys", "0 is not a block key (it means every block, on invalidate)"))
    if len(event.reused_tiers) != len(event.reused_tokens):
        out.append(
            Problem(
                "reused_tokens",
                f"{len(event.reused_tokens)} counts for {len(event.reused_tiers)} reused_tiers",
            )
        )
    if event.reported_hit_tokens > event.prompt_tokens and event.kind is EventKind.LOOKUP:
        out.append(
            Problem(
                "reported_hit_tokens",
                f"hit {event.reported_hit_tokens} exceeds prompt_tokens {event.prompt_tokens}",
            )
        )
    if event.kind is EventKind.ATTACH and event.recipe and (why := recipe_problem(event.recipe)):
        out.append(Problem("recipe", why))
    return out


def recipe_problem(text: str) -> str:
    """Why an attach event's recipe is no recipe; "" when it is one (the analysis would judge the
    engine's lookups by it, so a broken one is refused here rather than there)."""
    try:
        recipe_from_json(text)
    except RecipeError as exc:
        return str(exc)
    return ""


_INT64_MAX = 2**63 - 1
_FLOAT_MAX = sys.float_info.max
_LOOKUP_ADOPT = (EventKind.LOOKUP, EventKind.ADOPT)


def clean(event: Event) -> bool:
    """Whether `problems(event, msgpack_decoded=True)` would be empty, at a third of its cost.

    The collector's fast path asks this of every received row and builds `problems`' messages
    only for a batch with a bad row. The two must agree (a property test holds them to it), so
    a rule added to `problems` is added here too.
    """
    e = event
    if not (1 <= e.schema_version <= SCHEMA_VERSION and 0 < e.ts_ns <= _INT64_MAX
            and 0 <= e.lease_expiry_ns <= _INT64_MAX and 0 <= e.duration_ns <= _INT64_MAX
            and e.source_id != 0 and e.token_end >= e.token_start
            and len(e.reused_tiers) == len(e.reused_tokens)):
        return False
    # NaN and infinity fail the chained comparison, as they fail isfinite().
    if not (0.0 <= e.probe_max_abs_diff <= _FLOAT_MAX and 0.0 <= e.probe_mean_kl <= _FLOAT_MAX
            and 0.0 <= e.probe_max_kl <= _FLOAT_MAX and 0.0 <= e.noise_floor <= _FLOAT_MAX):
        return False
    kind = e.kind
    for name in REQUIRED_BY_KIND[kind]:
        if not getattr(e, name):
            return False
    if e.reason:
        if kind is EventKind.EVICT and e.reason not in EVICT_REASONS:
            return False
        if kind is EventKind.INVALIDATE and e.reason not in INVALIDATE_REASONS:
            return False
    if e.more_keys and (kind in _LOOKUP_ADOPT or not e.block_key or 0 in e.more_keys):
        return False
    if kind is EventKind.ATTACH and recipe_problem(e.recipe):
        return False
    return not (kind is EventKind.LOOKUP and e.reported_hit_tokens > e.prompt_tokens)


if {name for name, *_ in _int64_bounds()} != {"ts_ns", "lease_expiry_ns", "duration_ns"} or set(MEASUREMENTS) != {
        "probe_max_abs_diff", "probe_mean_kl", "probe_max_kl", "noise_floor"}:
    raise RuntimeError("schema columns changed: update validation.clean() to match problems()")


def ensure_valid(event: Event) -> Event:
    """Return the event, or raise InvalidEvent naming the first problem."""
    found = problems(event)
    if found:
        raise InvalidEvent(found[0].field, found[0].reason)
    return event


def _upgrade(row: dict[str, Any]) -> dict[str, Any]:
    version = row.get("schema_version", SCHEMA_VERSION)
    # Only real versions are walked up; 0, negatives and bools are left for validation to reject.
    if type(version) is int and version >= 1:
        while version < SCHEMA_VERSION:
            if version in UPGRADES:
                row = UPGRADES[version](row)
            version += 1
            row["schema_version"] = version
    return row


def event_from_builtins(row: Any) -> Event:
    """Validate one decoded row (a dict from JSON, msgpack or Arrow) into an event.

    Rows written by an older schema are upgraded first, so a newer reader accepts them.
    """
    if not isinstance(row, dict):
        raise InvalidEvent("", f"expected an object, got {type(row).__name__}")
    for name in WIRE_REQUIRED:
        if name not in row:
            raise InvalidEvent(name, f"missing required field `{name}`")
    if row.get("schema_version", SCHEMA_VERSION) != SCHEMA_VERSION:
        row = _upgrade(dict(row))
    try:
        event = msgspec.convert(row, Event)
    except msgspec.ValidationError as exc:
        raise InvalidEvent(_field_of(str(exc)), str(exc)) from None
    return ensure_valid(event)


def event_from_json(line: bytes | str) -> Event:
    """Decode and validate one JSON object."""
    try:
        row = msgspec.json.decode(line)
    except msgspec.DecodeError as exc:
        raise InvalidEvent("", f"not valid JSON: {exc}") from None
    return event_from_builtins(row)


def _raw_text(row: Any) -> str:
    if isinstance(row, bytes | bytearray):
        return bytes(row).decode("utf-8", "replace")
    if isinstance(row, str):
        return row
    try:
        return msgspec.json.encode(row).decode()
    except (TypeError, ValueError):
        return repr(row)


def validate_rows(
    rows: Iterable[Any],
    origin: str,
    first_row: int = 1,
    decode: Callable[[Any], Event] = event_from_builtins,
) -> tuple[list[Event], list[Rejection]]:
    """Split rows into valid events and rejections; one bad row never costs the others."""
    return validate_numbered(enumerate(rows, start=first_row), origin, decode)


def validate_numbered(
    rows: Iterable[tuple[int, Any]],
    origin: str,
    decode: Callable[[Any], Event] = event_from_builtins,
) -> tuple[list[Event], list[Rejection]]:
    """Like validate_rows, for rows that carry their own 1-based numbers (file lines)."""
    good: list[Event] = []
    bad: list[Rejection] = []
    now = time.time_ns()
    for index, row in rows:
        try:
            good.append(decode(row))
        except InvalidEvent as exc:
            bad.append(
                Rejection(
                    received_ns=now,
                    origin=origin,
                    row=index,
                    field=exc.field,
                    reason=exc.reason,
                    raw=_raw_text(row)[:65536],
                )
            )
    return good, bad
