"""Turns one request body into a batch to spool: decoded, validated row by row, tenant-checked.

Pure functions of bytes and a grant, so the HTTP layer stays thin and tests can fuzz this
directly. Whole-request faults (cannot decompress, not a batch, a row in another tenant's
namespace) raise `IntakeError` with the HTTP status and a message naming the fault; bad rows in
a good request become rejections and never cost the good rows.
"""

from __future__ import annotations

import contextlib
import gc
import json
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrace.collector.auth import Grant
from kvtrace.schema.arrow import to_arrow
from kvtrace.schema.arrow_checks import clean_rows
from kvtrace.schema.arrow_wire import ARROW_TYPE, TooLarge, read_stream
from kvtrace.schema.events import SCHEMA_VERSION, Event
from kvtrace.schema.records import EmitterStats, Rejection
from kvtrace.schema.validation import (
    clean,
    event_from_builtins,
    event_from_json,
    problems,
    range_problems,
    validate_numbered,
    validate_rows,
)
from kvtrace.schema.wire import CONTENT_TYPE, WIRE_VERSION, Batch, WireError, decode_batch, decode_raw_event

JSON_TYPE = "application/json"
PROTOBUF_TYPE = "application/x-protobuf"
OTLP_EVENT = "kvtrace.event"
OTLP_STATS = "kvtrace.emitter_stats"


class IntakeError(Exception):
    """The whole request is refused; `status` is the HTTP code to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Unavailable(Exception):
    """The collector cannot take the request now (its spool is full, it is stopping); answer with
    `status` and Retry-After. Unlike an `IntakeError`, the same request may succeed later."""

    def __init__(self, status: int, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class Intake:
    """What one request contributes: the batch to spool and its counts.

    Accepted events are the batch's rows, or, for a columnar request, `table` (the batch then
    carries only the envelope, stats and rejections).
    """

    batch: Batch
    received: int
    table: pa.Table | None = None
    accepted: int = 0
    quarantined: int = 0

    def __post_init__(self) -> None:
        self.accepted = len(self.batch.events) + (self.table.num_rows if self.table is not None else 0)
        self.quarantined = len(self.batch.rejections)

    def release(self) -> None:
        """Drop the decoded rows once spooled; the counts and rejections stay for the reply.
        Freeing thousands of rows is real work, better done in the worker thread than on the
        event loop that serves every connection."""
        self.batch.events = []
        self.table = None


def media_type(content_type: str | None) -> str:
    return (content_type or "").split(";", 1)[0].strip().lower()


def decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    """Undo Content-Encoding (zstd, gzip, deflate or none) without ever holding more than `limit`.

    zstd (through pyarrow's codec) costs a sender about a fifth of what gzip does for the same
    size: what the columnar HTTP sink uses.
    """
    encoding = (encoding or "identity").strip().lower()
    if encoding in ("", "identity"):
        if len(body) > limit:
            raise IntakeError(413, f"body is {len(body)} bytes; the limit is {limit}")
        return body
    if encoding == "zstd":
        try:
            stream = pa.CompressedInputStream(pa.BufferReader(body), "zstd")
            out = stream.read(limit + 1)  # inflates no further than one byte past the limit
        except OSError as exc:
            raise IntakeError(400, f"body is not valid zstd: {exc}") from None
        if len(out) > limit:
            raise IntakeError(413, f"body inflates past the limit of {limit} bytes")
        return out
    if encoding not in ("gzip", "deflate"):
        raise IntakeError(415, f"Content-Encoding {encoding!r} not supported (use zstd, gzip, deflate or none)")
    inflater = zlib.decompressobj(wbits=47 if encoding == "gzip" else 15)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise IntakeError(400, f"body is not valid {encoding}: {exc}") from None
    if len(out) > limit:
        raise IntakeError(413, f"body inflates past the limit of {limit} bytes")
    if not inflater.eof:
        raise IntakeError(400, f"body is truncated {encoding} data")
    return out


_typed = msgspec.msgpack.Decoder(Batch)


class _JsonBatch(msgspec.Struct, kw_only=True):
    """RawBatch as a sender may write it: no `rejections` (only the collector's spool carries
    them), and unknown fields ignored."""

    wire_version: int
    source_id: int
    batch_seq: int
    sent_ns: int
    events: list[msgspec.Raw] = []
    stats: EmitterStats | None = None


# Lax for the envelope only: JSON writers (JavaScript, jq) may write an integer as 1.0, which
# JSON Schema counts as an integer. Rows stay strict; a bad row is quarantined, not guessed at.
_json_envelope = msgspec.json.Decoder(_JsonBatch, strict=False)


ENVELOPE_BOUNDS = {"source_id": (0, 2**64 - 1), "batch_seq": (0, 2**63 - 1), "sent_ns": (0, 2**63 - 1)}


def _check_envelope(batch: object) -> None:
    for name, (low, high) in ENVELOPE_BOUNDS.items():
        value = getattr(batch, name)
        if not low <= value <= high:
            raise IntakeError(400, f"not a kvtrace batch: {name} {value} is out of range [{low}, {high}]")


def _envelope(data: bytes, what: str = "") -> _JsonBatch:
    """A batch's JSON envelope (a JSON batch, or a columnar batch's metadata), checked."""
    try:
        env = _json_envelope.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise IntakeError(400, f"not a kvtrace batch: {what}{exc}") from None
    _check_envelope(env)
    if env.wire_version != WIRE_VERSION:
        raise IntakeError(400, f"wire version {env.wire_version} not supported (this collector knows {WIRE_VERSION})")
    return env


def _origin(batch: _JsonBatch | Batch | object, grant: Grant) -> str:
    return f"{grant.name}:{getattr(batch, 'source_id', 0):016x}:{getattr(batch, 'batch_seq', 0)}"


def _place(events: list[Event], grant: Grant) -> bool:
    """Put every event without a tenant in the grant's home (`Grant.home`), or refuse the
    request naming the first row that reaches into another tenant's namespace. Returns whether
    any event was changed."""
    if grant.operator:
        return False
    home = grant.home
    changed = False
    for row, event in enumerate(events, start=1):
        if not event.tenant:
            if home:
                event.tenant = home
                changed = True
        elif not grant.allows(event.tenant):
            raise IntakeError(403, f"row {row}: tenant {event.tenant!r} is outside this token's namespace")
    return changed


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Decoding a batch allocates many small lists and no cycles; letting the cyclic collector
    run in between (it scans every tracked object each time) made decoding three times slower."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _fast(payload: bytes) -> Batch | None:
    """Decode a whole, clean batch in one typed pass; None sends it to the row-by-row path."""
    try:
        with no_gc():
            batch = _typed.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if batch.wire_version != WIRE_VERSION or batch.rejections:
        return None
    if batch.stats is not None and range_problems(batch.stats):
        return None
    if any(not low <= getattr(batch, name) <= high for name, (low, high) in ENVELOPE_BOUNDS.items()):
        return None
    for event in batch.events:
        if event.schema_version != SCHEMA_VERSION or not clean(event):
            return None
    return batch


def intake_batch(payload: bytes, content_type: str, grant: Grant) -> Intake:
    """A kvtrace batch in the msgpack wire format, its JSON form or as Arrow columns."""
    kind = media_type(content_type)
    received_ns = time.time_ns()
    if kind == ARROW_TYPE:
        return intake_columns(payload, grant)
    if kind == CONTENT_TYPE:
        batch = _fast(payload)
        if batch is None:
            try:
                raw = decode_batch(payload)
            except WireError as exc:
                raise IntakeError(400, str(exc)) from None
            _check_envelope(raw)
            good, bad = validate_rows(raw.events, _origin(raw, grant),
                                      decode=lambda r: event_from_builtins(decode_raw_event(r)))
            batch = Batch(source_id=raw.source_id, batch_seq=raw.batch_seq, sent_ns=raw.sent_ns, events=good,
                          stats=raw.stats, rejections=bad)
    elif kind == JSON_TYPE:
        env = _envelope(payload)
        good, bad = validate_rows(env.events, _origin(env, grant), decode=lambda r: event_from_json(bytes(r)))
        batch = Batch(source_id=env.source_id, batch_seq=env.batch_seq, sent_ns=env.sent_ns, events=good,
                      stats=env.stats, rejections=bad)
    else:
        raise IntakeError(415, f"Content-Type {content_type or '(none)'!r} not supported: send {CONTENT_TYPE}, "
                               f"{ARROW_TYPE} or {JSON_TYPE}")
    _finish(batch, grant, received_ns)
    return Intake(batch, len(batch.events) + len(batch.rejections))


def intake_columns(payload: bytes, grant: Grant) -> Intake:
    """A columnar batch (`arrow_wire`): rows checked column-wise, and only the rows that fail
    go through the row path, which names their fault; the accepted rows stay columns."""
    received_ns = time.time_ns()
    try:
        meta, table = read_stream(payload)
    except WireError as exc:
        raise IntakeError(413 if isinstance(exc, TooLarge) else 400, str(exc)) from None
    env = _envelope(meta, "envelope: ")
    ok = clean_rows(table)  # rows stored as they came
    rejections: list[Rejection] = []
    if ok.all():
        _check_tenants(table, ok, grant)
    else:
        dirty = np.flatnonzero(~ok)
        good, rejections = validate_numbered(_numbered_rows(table, dirty), _origin(env, grant))
        accepted = ok.copy()
        refused = {r.row - 1 for r in rejections}
        accepted[[i for i in dirty.tolist() if i not in refused]] = True
        _check_tenants(table, accepted, grant)
        table = table.filter(pa.array(ok))
        if good:  # rows the row path accepted after all (an older schema version, upgraded)
            table = pa.concat_tables([table, to_arrow(good)])
    if grant.home:
        tenant = table.column("tenant")
        if pc.any(pc.equal(tenant, "")).as_py():
            table = table.set_column(table.schema.get_field_index("tenant"), table.schema.field("tenant"),
                                     pc.if_else(pc.equal(tenant, ""), grant.home, tenant))
    batch = Batch(source_id=env.source_id, batch_seq=env.batch_seq, sent_ns=env.sent_ns, stats=env.stats,
                  rejections=rejections)
    _finish(batch, grant, received_ns)  # may quarantine the stats: counted as received, as in the row formats
    return Intake(batch, table.num_rows + len(batch.rejections), table=table)


def _numbered_rows(table: pa.Table, rows: np.ndarray, step: int = 8192) -> Iterator[tuple[int, dict]]:
    """The given rows as (1-based row number, dict), made a slice at a time: a batch of bad rows
    never exists as Python dicts all at once."""
    for start in range(0, len(rows), step):
        part = rows[start:start + step]
        yield from zip((part + 1).tolist(), table.take(part).to_pylist(), strict=True)


def _check_tenants(table: pa.Table, accepted: np.ndarray, grant: Grant) -> None:
    """Refuse the request, naming the first accepted row written into another tenant's namespace."""
    if grant.operator or not accepted.any():
        return
    tenant = table.column("tenant")
    allowed = pa.array(sorted(grant.tenants), pa.string())
    outside = np.asarray(pc.fill_null(pc.and_(pc.not_equal(tenant, ""),
                                              pc.invert(pc.is_in(tenant, value_set=allowed))), False)) & accepted
    if outside.any():
        row = int(np.argmax(outside))
        raise IntakeError(403, f"row {row + 1}: tenant {tenant[row].as_py()!r} is outside this token's namespace")


def intake_events(batch: Batch, grant: Grant) -> Intake:
    """Typed events built in this process: each checked as a received row would be."""
    received_ns = time.time_ns()
    good: list[Event] = []
    bad: list[Rejection] = []
    for row, event in enumerate(batch.events, start=1):
        found = problems(event)
        if found:
            bad.append(Rejection(received_ns=received_ns, origin=_origin(batch, grant), row=row,
                                 field=found[0].field, reason=found[0].reason, raw=repr(event)[:65536]))
        else:
            good.append(event)
    out = Batch(source_id=batch.source_id, batch_seq=batch.batch_seq, sent_ns=batch.sent_ns, events=good,
                stats=batch.stats, rejections=bad)
    _finish(out, grant, received_ns)
    return Intake(out, len(out.events) + len(out.rejections))


def _finish(batch: Batch, grant: Grant, received_ns: int) -> None:
    """Quarantine emitter stats with out-of-range counters, stamp rejections, place events."""
    if batch.stats is not None and (found := range_problems(batch.stats)):
        batch.rejections.append(Rejection(received_ns=received_ns, origin=_origin(batch, grant), row=0,
                                          field=f"stats.{found[0].field}", reason=found[0].reason,
                                          raw=msgspec.json.encode(batch.stats).decode()[:65536]))
        batch.stats = None
    for rejection in batch.rejections:
        rejection.received_ns = received_ns
    _place(batch.events, grant)


# -- OTLP/HTTP logs ----------------------------------------------------------------------------
def _any_value(value: object) -> object:
    which = value.WhichOneof("value")  # type: ignore[attr-defined]
    return getattr(value, which) if which else None


# The repeated fields down to the records, each under its two JSON names (the collector's
# OpenAPI document declares the same shape for /v1/logs).
_OTLP_PATH = (("resourceLogs", "resource_logs"), ("scopeLogs", "scope_logs"), ("logRecords", "log_records"))


def _otlp_shape_problem(doc: dict, path: tuple[tuple[str, str], ...]) -> str:
    """What is wrong with the records' path of an OTLP/JSON document, "" when nothing: each
    repeated field under one of its names, null or a list of objects (protobuf's JSON parser lets
    some of these through as empty, which would answer 200 to a malformed request)."""
    if not path:
        return ""
    (camel, snake), rest = path[0], path[1:]
    if camel in doc and snake in doc:
        return f"{camel} and {snake} are the same field: send one"
    for name in (camel, snake):
        value = doc.get(name)
        if value is None:
            continue
        if not isinstance(value, list):
            return f"{name} must be an array, not {type(value).__name__}"
        for i, item in enumerate(value):
            if not isinstance(item, dict):
                return f"{name}[{i}] must be an object, not {type(item).__name__}"
            if why := _otlp_shape_problem(item, rest):
                return f"{name}[{i}].{why}"
    return ""


def intake_otlp(payload: bytes, content_type: str, grant: Grant) -> tuple[Intake, int]:
    """kvtrace events inside OTLP log records (our OTLP sink's shape: the event's JSON as the
    body, named `kvtrace.event`). Other records are not ours and are counted, not rejected.

    Returns the intake and how many foreign records were skipped.
    """
    from google.protobuf import json_format
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

    kind = media_type(content_type)
    request = ExportLogsServiceRequest()
    try:
        if kind == PROTOBUF_TYPE:
            request.ParseFromString(payload)
        elif kind == JSON_TYPE:
            doc = json.loads(payload)  # the standard parser: JSON may escape lone surrogates in unknown keys
            if not isinstance(doc, dict):
                raise IntakeError(400, "not an OTLP ExportLogsServiceRequest: the JSON body must be an object")
            # Only the field that carries records is read; unknown fields are ignored, whatever they hold.
            known = {k: v for k, v in doc.items() if k in ("resourceLogs", "resource_logs")}
            if why := _otlp_shape_problem(known, _OTLP_PATH):
                raise IntakeError(400, f"not an OTLP ExportLogsServiceRequest: {why}")
            json_format.ParseDict(known, request, ignore_unknown_fields=True)
        else:
            raise IntakeError(415, f"Content-Type {content_type or '(none)'!r} not supported on /v1/logs: send "
                                   f"{PROTOBUF_TYPE} or {JSON_TYPE}")
    except (DecodeError, json_format.ParseError, msgspec.DecodeError, UnicodeDecodeError, ValueError, RecursionError,
            SystemError) as exc:
        if isinstance(exc, IntakeError):
            raise
        raise IntakeError(400, f"not an OTLP ExportLogsServiceRequest: {exc}") from None
    rows: list[object] = []
    stats: EmitterStats | None = None
    foreign = 0
    for resource_logs in request.resource_logs:
        for scope_logs in resource_logs.scope_logs:
            for record in scope_logs.log_records:
                name = record.event_name or next(
                    (str(_any_value(a.value)) for a in record.attributes if a.key == "event.name"), "")
                body = _any_value(record.body) if record.HasField("body") else None
                if name == OTLP_EVENT:
                    rows.append(body if isinstance(body, str | bytes) else msgspec.json.encode(body))
                elif name == OTLP_STATS and isinstance(body, str | bytes):
                    try:
                        stats = msgspec.json.decode(body, type=EmitterStats)
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        foreign += 1
                else:
                    foreign += 1
    good, bad = validate_rows(rows, f"{grant.name}:otlp", decode=_otlp_row)
    now = time.time_ns()
    batch = Batch(source_id=stats.source_id if stats and 0 <= stats.source_id < 2**64 else 0, batch_seq=0,
                  sent_ns=now, events=good, stats=stats, rejections=bad)
    _finish(batch, grant, now)
    return Intake(batch, len(batch.events) + len(batch.rejections)), foreign


def _otlp_row(row: object) -> Event:
    if isinstance(row, str | bytes):
        return event_from_json(row)
    return event_from_builtins(row)
