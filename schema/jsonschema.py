"""JSON Schema for the wire API, derived by msgspec from the same Structs."""

from __future__ import annotations

from typing import Any

import msgspec

from kvtrace.schema.events import SCHEMA_VERSION, WIRE_REQUIRED, Event
from kvtrace.schema.wire import WIRE_VERSION, Batch


def event_json_schema() -> dict[str, Any]:
    """JSON Schema (2020-12) of one event, as JSONL ingest and the HTTP API accept it."""
    out = msgspec.json.schema(Event)
    out["$defs"]["Event"]["required"] = list(WIRE_REQUIRED)
    out["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    out["$id"] = f"https://kvtrace.dev/schema/event.v{SCHEMA_VERSION}.json"
    return out


def batch_json_schema() -> dict[str, Any]:
    """JSON Schema of a batch (the msgpack wire format has the same shape)."""
    out = msgspec.json.schema(Batch)
    out["$defs"]["Event"]["required"] = list(WIRE_REQUIRED)
    out["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    out["$id"] = f"https://kvtrace.dev/schema/batch.v{WIRE_VERSION}.json"
    return out
