"""The event model: the one source of truth for Python types, ClickHouse DDL, Arrow and JSON.

Shims import only this package (and `kvtrace.instrumentation.api`); it depends on msgspec and
the standard library, plus pyarrow for the columnar helpers in `kvtrace.schema.arrow`.
"""

from kvtrace.schema.events import FIELD_NAMES, REQUIRED_BY_KIND, SCHEMA_VERSION, Event
from kvtrace.schema.kinds import ComponentKind, EventKind, Reason, Tier, Transform
from kvtrace.schema.records import EmitterStats, Rejection
from kvtrace.schema.validation import InvalidEvent, ensure_valid, event_from_builtins, problems

__all__ = [
    "FIELD_NAMES",
    "REQUIRED_BY_KIND",
    "SCHEMA_VERSION",
    "ComponentKind",
    "EmitterStats",
    "Event",
    "EventKind",
    "InvalidEvent",
    "Reason",
    "Rejection",
    "Tier",
    "Transform",
    "ensure_valid",
    "event_from_builtins",
    "problems",
]
