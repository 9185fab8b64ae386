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
import re
import time
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrace.collector.auth import Grant
from kvtrace.collector.bounds import ROW_CAP, json_rows_over, msgpack_array_length, protobuf_records_over
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


@dataclass(frozen=True, slots=True)
class TimeWindow:
    """When an event may plausibly have happened, relative to when the collector received it.

    Rows outside it are quarantined with the rule named, before they reach the store: a clock
    far off (or a hostile sender) would otherwise write rows into partitions no query looks
    at, or a batch spanning years of days would make the store refuse the whole insert (one
    part per day touched) and stall every tenant's drain behind it.
    """

    max_age_s: float = 30 * 86400  # an emitter's journal shipped after a long outage is still welcome
    max_ahead_s: float = 600  # clock skew between an engine host and the collector's

    def bounds(self, received_ns: int) -> tuple[int, int]:
        """[low, high] in ns; an infinite bound is the whole Int64 range."""
        age, ahead = self.max_age_s * 1e9, self.max_ahead_s * 1e9
        return (received_ns - int(age) if age < 2**62 else -(2**63),
                received_ns + int(ahead) if ahead < 2**62 else 2**63 - 1)

    def problem(self, ts_ns: int, received_ns: int) -> str:
        low, high = self.bounds(received_ns)
        if ts_ns < low:
            return (f"{_when(ts_ns)} is more than {_span(self.max_age_s)} before the collector received it "
                    f"({_when(received_ns)}); older rows are quarantined (collector --max-event-age-days)")
        if ts_ns > high:
            return (f"{_when(ts_ns)} is more than {_span(self.max_ahead_s)} after the collector received it "
                    f"({_when(received_ns)}); is the sender's clock right? (collector --max-clock-ahead-s)")
        return ""


def _when(ns: int) -> str:
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ns / 1e9))
    except (OverflowError, OSError, ValueError):
        return f"ts_ns {ns}"


def _span(seconds: float) -> str:
    return f"{seconds / 86400:g} days" if seconds >= 86400 else f"{seconds:g} s"


def media_type(content_type: str | None) -> str:
    return (content_type or "").split(";", 1)[0].strip().lower()


_ZSTD = pa.Codec("zstd")
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _zstd_content_size(body: bytes) -> int | None:
    """The decompressed size a zstd frame's header states (RFC 8878, 3.1.1.1), if it states one.
    A one-shot compressor (pyarrow's, the HTTP sink's) writes it. zstd itself checks it: a frame
    whose content is not that size fails to decompress."""
    if len(body) < 6 or body[:4] != _ZSTD_MAGIC:
        return None
    descriptor = body[4]
    flag, single, dictionary = descriptor >> 6, (descriptor >> 5) & 1, descriptor & 3
    width = (1 if single else 0, 2, 4, 8)[flag]
    if not width:
        return None
    at = 5 + (0 if single else 1) + (0, 1, 2, 4)[dictionary]
    if len(body) < at + width:
        return None
    value = int.from_bytes(body[at:at + width], "little")
    return value + 256 if width == 2 else value


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
        size = _zstd_content_size(body)
        if size is not None and size <= limit:
            try:  # one call into a buffer of the frame's size: a third of the stream's CPU (0.15 us an event)
                return _ZSTD.decompress(body, decompressed_size=size, asbytes=True)
            except OSError:
                pass  # frames after the first, bytes after it, a size that lies: the stream reads them or says why
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
    events: msgspec.Raw = msgspec.Raw(b"[]")  # counted before its rows are split (`bounds`)
    stats: EmitterStats | None = None


_LONE_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
                             rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")
_json_rows = msgspec.json.Decoder(list[msgspec.Raw])


class _MsgpackRows(msgspec.Struct):
    """A msgpack batch's events, skimmed as one raw value: its array header says how many rows
    it holds before any is decoded."""

    events: msgspec.Raw = msgspec.Raw(b"\x90")


_msgpack_rows = msgspec.msgpack.Decoder(_MsgpackRows)


_MIN_EVENT_BYTES = 24  # a msgpack event's required fields alone, names and values, take more


def _too_many(rows: int) -> IntakeError:
    return IntakeError(413, f"{rows} rows in one request; the limit is {ROW_CAP} (send smaller batches)")


def _check_msgpack_rows(payload: bytes) -> None:
    """Refuse a msgpack batch over the row cap from its array header (a skim, ~5 % of a decode);
    a payload that is not a map is left for the decoders to name."""
    try:
        raw = _msgpack_rows.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return
    rows = msgpack_array_length(bytes(raw.events))
    if rows > ROW_CAP:
        raise _too_many(rows)


def _json_event_rows(env: _JsonBatch) -> list[msgspec.Raw]:
    """The envelope's rows, once they are known to be within the cap."""
    raw = bytes(env.events)
    try:
        over = json_rows_over(raw)
    except ValueError as exc:
        raise IntakeError(400, f"not a kvtrace batch: events: {exc}") from None
    if over:
        raise _too_many(over)
    return _json_rows.decode(raw)


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
        if lone := _LONE_SURROGATE.search(data):
            raise IntakeError(400, f"not a kvtrace batch: {what}a string holds a lone UTF-16 surrogate escape "
                                   f"({lone.group().decode()}), which is not Unicode text: "
                                   "escape characters outside the BMP as a surrogate pair") from None
        raise IntakeError(400, f"not a kvtrace batch: {what}{exc}") from None
    _check_envelope(env)
    if env.wire_version != WIRE_VERSION:
        raise IntakeError(400, f"wire version {env.wire_version} not supported (this collector knows {WIRE_VERSION})")
    return env


def _origin(batch: _JsonBatch | Batch | object, grant: Grant) -> str:
    return f"{grant.name}:{getattr(batch, 'source_id', 0):016x}:{getattr(batch, 'batch_seq', 0)}"


_TS = attrgetter("ts_ns")
_TENANT = attrgetter("tenant")


def _good_rows(events: int, rejections: list[Rejection]) -> Iterator[int]:
    """The 1-based request row of each accepted event: the rows no rejection names, in order."""
    refused = {r.row for r in rejections if r.row > 0}
    row = 0
    for _ in range(events):
        row += 1
        while row in refused:
            row += 1
        yield row


def _place(batch: Batch, grant: Grant, received_ns: int, window: TimeWindow | None) -> None:
    """Quarantine events outside the time window, put every event without a tenant in the
    grant's home (`Grant.home`), or refuse the request naming the first row (its number in the
    request) that reaches into another tenant's namespace."""
    if grant.operator and window is None:
        return
    home = grant.home
    low, high = window.bounds(received_ns) if window is not None else (-(2**63), 2**63)
    if batch.events:
        tenants = set(map(_TENANT, batch.events))
        placed = grant.operator or ((not home or "" not in tenants) and tenants - {""} <= grant.tenants)
        times = list(map(_TS, batch.events))
        if placed and low <= min(times) and max(times) <= high:
            return  # the common case, checked in C: all on time, nothing to place or refuse
    kept: list[Event] = []
    late: list[Rejection] = []
    for row, event in zip(_good_rows(len(batch.events), batch.rejections), batch.events, strict=True):
        if not low <= event.ts_ns <= high:
            assert window is not None
            late += _late_rows(window, _origin(batch, grant), received_ns, [(row, msgspec.to_builtins(event))])
            continue
        kept.append(event)
        if grant.operator:
            continue
        if not event.tenant:
            if home:
                event.tenant = home
        elif not grant.allows(event.tenant):
            raise IntakeError(403, f"row {row}: tenant {event.tenant!r} is outside this token's namespace")
    if late:
        batch.events = kept
        batch.rejections = sorted([*batch.rejections, *late], key=lambda r: r.row)


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


def intake_batch(payload: bytes, content_type: str, grant: Grant, window: TimeWindow | None = None) -> Intake:
    """A kvtrace batch in the msgpack wire format, its JSON form or as Arrow columns."""
    try:
        return _intake_batch(payload, content_type, grant, window)
    except RecursionError:
        raise IntakeError(400, "not a kvtrace batch: values nest too deep (an event row is an object of "
                               "scalars and lists)") from None


def _intake_batch(payload: bytes, content_type: str, grant: Grant, window: TimeWindow | None) -> Intake:
    kind = media_type(content_type)
    received_ns = time.time_ns()
    if kind == ARROW_TYPE:
        return intake_columns(payload, grant, window)
    if kind == CONTENT_TYPE:
        # Whole valid events take far more than _MIN_EVENT_BYTES each, so a payload this small
        # cannot carry more than the cap of them, and the typed pass (which stops at the first
        # row that is not one) is safe without the skim; the row path never is.
        big = len(payload) > ROW_CAP * _MIN_EVENT_BYTES
        if big:
            _check_msgpack_rows(payload)
        batch = _fast(payload)
        if batch is None:
            if not big:
                _check_msgpack_rows(payload)
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
        good, bad = validate_rows(_json_event_rows(env), _origin(env, grant),
                                  decode=lambda r: event_from_json(bytes(r)))
        batch = Batch(source_id=env.source_id, batch_seq=env.batch_seq, sent_ns=env.sent_ns, events=good,
                      stats=env.stats, rejections=bad)
    else:
        raise IntakeError(415, f"Content-Type {content_type or '(none)'!r} not supported: send {CONTENT_TYPE}, "
                               f"{ARROW_TYPE} or {JSON_TYPE}")
    _finish(batch, grant, received_ns, window)
    return Intake(batch, len(batch.events) + len(batch.rejections))


def intake_columns(payload: bytes, grant: Grant, window: TimeWindow | None = None) -> Intake:
    """A columnar batch (`arrow_wire`): rows checked column-wise, and only the rows that fail
    go through the row path, which names their fault; the accepted rows stay columns."""
    received_ns = time.time_ns()
    try:
        meta, table = read_stream(payload)
    except WireError as exc:
        raise IntakeError(413 if isinstance(exc, TooLarge) else 400, str(exc)) from None
    env = _envelope(meta, "envelope: ")
    clean_mask = clean_rows(table)  # rows stored as they came
    ok = clean_mask.copy()  # of those, the ones kept
    rejections: list[Rejection] = []
    low, high = window.bounds(received_ns) if window is not None else (-(2**63), 2**63)
    if window is not None:
        ts = table.column("ts_ns")
        late = np.asarray(pc.fill_null(pc.or_(pc.less(ts, low), pc.greater(ts, high)), False)) & clean_mask
        if late.any():
            rejections += _late_rows(window, _origin(env, grant), received_ns,
                                     _numbered_rows(table, np.flatnonzero(late)))
            ok &= ~late
    if clean_mask.all():
        _check_tenants(table, ok, grant)
        if not ok.all():
            table = table.filter(pa.array(ok))
    else:
        dirty = np.flatnonzero(~clean_mask)
        good, refused = validate_numbered(_numbered_rows(table, dirty), _origin(env, grant))
        refused_rows = {r.row for r in refused}
        numbers = [i + 1 for i in dirty.tolist() if i + 1 not in refused_rows]
        # rows the row path accepted after all (an older schema version, upgraded), in the window or not
        on_time = [(n, e) for n, e in zip(numbers, good, strict=True) if low <= e.ts_ns <= high]
        if len(on_time) < len(good):
            rejections += _late_rows(window, _origin(env, grant), received_ns,  # type: ignore[arg-type]
                                     ((n, msgspec.to_builtins(e)) for n, e in zip(numbers, good, strict=True)
                                      if not low <= e.ts_ns <= high))
        rejections = sorted([*rejections, *refused], key=lambda r: r.row)
        accepted = ok.copy()
        accepted[[n - 1 for n, _ in on_time]] = True
        _check_tenants(table, accepted, grant)
        table = table.filter(pa.array(ok))
        if on_time:
            table = pa.concat_tables([table, to_arrow([e for _, e in on_time])])
    if grant.home:
        tenant = table.column("tenant")
        if pc.any(pc.equal(tenant, "")).as_py():
            table = table.set_column(table.schema.get_field_index("tenant"), table.schema.field("tenant"),
                                     pc.if_else(pc.equal(tenant, ""), grant.home, tenant))
    batch = Batch(source_id=env.source_id, batch_seq=env.batch_seq, sent_ns=env.sent_ns, stats=env.stats,
                  rejections=rejections)
    _finish(batch, grant, received_ns)  # may quarantine the stats: counted as received, as in the row formats
    return Intake(batch, table.num_rows + len(batch.rejections), table=table)


def _late_rows(window: TimeWindow, origin: str, received_ns: int,
               rows: Iterable[tuple[int, dict]]) -> list[Rejection]:
    return [Rejection(received_ns=received_ns, origin=origin, row=number, field="ts_ns",
                      reason=window.problem(row["ts_ns"], received_ns), raw=msgspec.json.encode(row).decode()[:65536])
            for number, row in rows]


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


def _finish(batch: Batch, grant: Grant, received_ns: int, window: TimeWindow | None = None) -> None:
    """Quarantine emitter stats with out-of-range counters, stamp rejections, place events."""
    if batch.stats is not None and (found := range_problems(batch.stats)):
        batch.rejections.append(Rejection(received_ns=received_ns, origin=_origin(batch, grant), row=0,
                                          field=f"stats.{found[0].field}", reason=found[0].reason,
                                          raw=msgspec.json.encode(batch.stats).decode()[:65536]))
        batch.stats = None
    for rejection in batch.rejections:
        rejection.received_ns = received_ns
    _place(batch, grant, received_ns, window)


# -- OTLP/HTTP logs ----------------------------------------------------------------------------
def _any_value(value: Any, depth: int = 0) -> object:
    """An OTLP AnyValue as plain builtins, whatever it holds: a kvlist is an object, an array a
    list (so an event may come as a structured body as well as JSON text)."""
    which = value.WhichOneof("value")
    if which == "kvlist_value":
        if depth >= _MAX_ANY_DEPTH:
            raise IntakeError(400, f"not an OTLP ExportLogsServiceRequest: a body nests deeper than {_MAX_ANY_DEPTH}")
        return {kv.key: _any_value(kv.value, depth + 1) for kv in value.kvlist_value.values}
    if which == "array_value":
        if depth >= _MAX_ANY_DEPTH:
            raise IntakeError(400, f"not an OTLP ExportLogsServiceRequest: a body nests deeper than {_MAX_ANY_DEPTH}")
        return [_any_value(v, depth + 1) for v in value.array_value.values]
    return getattr(value, which) if which else None


_MAX_ANY_DEPTH = 8


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


def intake_otlp(payload: bytes, content_type: str, grant: Grant,
                window: TimeWindow | None = None) -> tuple[Intake, int]:
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
            if (records := protobuf_records_over(payload)) > 0:
                raise _too_many(records)
            request.ParseFromString(payload)
        elif kind == JSON_TYPE:
            if (objects := payload.count(b"{")) > 2 * ROW_CAP:  # every record is one, its body another
                raise IntakeError(413, f"{objects} JSON objects in one request; the limit is {2 * ROW_CAP} "
                                       "(send smaller batches)")
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
                    (str(_any_value(a.value)) for a in record.attributes if a.key == "event.name"
                     and a.value.WhichOneof("value") == "string_value"), "")
                body = _any_value(record.body) if record.HasField("body") else None
                if name == OTLP_EVENT:
                    rows.append(body)  # JSON text, or an object (a kvlist body)
                elif name == OTLP_STATS and isinstance(body, str | bytes):
                    try:
                        stats = msgspec.json.decode(body, type=EmitterStats)
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        foreign += 1
                else:
                    foreign += 1
    if len(rows) > ROW_CAP:
        raise _too_many(len(rows))
    good, bad = validate_rows(rows, f"{grant.name}:otlp", decode=_otlp_row)
    now = time.time_ns()
    batch = Batch(source_id=stats.source_id if stats and 0 <= stats.source_id < 2**64 else 0, batch_seq=0,
                  sent_ns=now, events=good, stats=stats, rejections=bad)
    _finish(batch, grant, now, window)
    return Intake(batch, len(batch.events) + len(batch.rejections)), foreign


def _otlp_row(row: object) -> Event:
    if isinstance(row, str | bytes):
        return event_from_json(row)
    return event_from_builtins(row)
