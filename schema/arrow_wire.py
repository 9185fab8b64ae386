"""The columnar batch wire format: a batch's events as one Arrow IPC stream.

Why a second format: a collector that receives rows spends Python time on every row (decode,
validate, re-encode) and then has ClickHouse parse them again as JSON. Columns go from the
request to ClickHouse's Arrow reader with a few vectorized checks in between, so the
collector's cost per event falls to a fraction. The cost moves to the sender: building the
columns takes a few microseconds per event on the emitter's export thread, several times what
msgpack rows take, so senders choose it (`HttpSink(wire="columns")`); rows stay the default.

Layout: an Arrow IPC stream (media type `application/vnd.apache.arrow.stream`) whose columns
are the event schema's (`arrow.arrow_schema`), with the batch envelope (`wire_version`,
`source_id`, `batch_seq`, `sent_ns`, `stats`) as JSON under the schema metadata key
`kvtrace.batch`. Any Arrow writer can produce it. Readers take a column of another width of
the same kind of value (see `_plain_fit`), fill columns an older writer lacked (and nulls,
outside the fields every row must carry) with their defaults and ignore unknown ones. Buffers
inside the stream must not be compressed: the stream is compressed as a whole by HTTP
Content-Encoding, which the collector inflates within its size limit, whereas an IPC body codec
declares its own inflated sizes, so a small request could allocate without bound before anything
could check it.
"""

from __future__ import annotations

import enum
import struct
from collections import Counter
from collections.abc import Sequence

import msgspec
import pyarrow as pa
import pyarrow.compute as pc

from kvtrace.schema.arrow import arrow_schema, conform, to_arrow
from kvtrace.schema.events import WIRE_REQUIRED, Event
from kvtrace.schema.fields import field_specs
from kvtrace.schema.records import EmitterStats
from kvtrace.schema.wire import WIRE_VERSION, WireError

ARROW_TYPE = "application/vnd.apache.arrow.stream"
ENVELOPE_KEY = b"kvtrace.batch"
MAX_ROWS = 1 << 18
"""Rows in one columnar batch (32 times the emitter's default batch): a few bytes a row on the
wire become a full row of the wide event schema once read, so the count is bounded as well as
the bytes."""


class TooLarge(WireError):
    """A batch with more rows than one request may carry."""


class Envelope(msgspec.Struct, kw_only=True):
    """What a columnar batch says about itself; the events are the stream's rows."""

    wire_version: int = WIRE_VERSION
    source_id: int
    batch_seq: int
    sent_ns: int
    stats: EmitterStats | None = None


_envelope_json = msgspec.json.Encoder()


def encode_columns(envelope: Envelope, events: Sequence[Event]) -> bytes:
    """The batch as an Arrow IPC stream, envelope in the schema metadata."""
    table = to_arrow(events)
    return write_stream(table.replace_schema_metadata({**(table.schema.metadata or {}),
                                                       ENVELOPE_KEY: _envelope_json.encode(envelope)}))


def write_stream(table: pa.Table, compression: str | None = None) -> bytes:
    """A table as an Arrow IPC stream: plain, as the wire takes it, or with its buffers
    compressed (`lz4`, `zstd`), which Arrow's reader inflates by itself."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression=compression)) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def read_stream(payload: bytes) -> tuple[bytes, pa.Table]:
    """The envelope JSON and the events table (canonical schema) of a columnar batch.

    Raises WireError naming what is wrong with a stream that cannot be read as a whole:
    not Arrow, compressed buffers, invalid data, no envelope, a required column missing, or a
    column whose values do not fit its type. Rows are not checked here (see `arrow_checks`).
    """
    _refuse_compressed(payload)
    try:
        table = pa.ipc.open_stream(pa.py_buffer(payload)).read_all()
        table.validate(full=True)  # offsets, lengths and UTF-8, before any kernel reads them
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise WireError(f"not a readable Arrow IPC stream: {exc}") from None
    envelope = (table.schema.metadata or {}).get(ENVELOPE_KEY)
    if envelope is None:
        raise WireError(f"the stream's schema metadata has no {ENVELOPE_KEY.decode()!r} envelope")
    missing = [name for name in WIRE_REQUIRED if name not in table.column_names]
    if missing:
        raise WireError(f"column {missing[0]!r} is missing (required: {', '.join(WIRE_REQUIRED)})")
    twice = [name for name, count in Counter(table.column_names).items() if count > 1]
    if twice:
        raise WireError(f"column {twice[0]!r} appears more than once")
    if table.num_rows > MAX_ROWS:
        raise TooLarge(f"{table.num_rows} rows in one batch; the limit is {MAX_ROWS} (send smaller batches)")
    target = arrow_schema()
    for f in target:
        if f.name in table.column_names and not _plain_fit(sent := table.schema.field(f.name).type, f.type):
            raise WireError(f"column {f.name!r} is {sent}; the event schema has {f.type}, and only the same kind "
                            f"of plain values is read (integers of any width, strings, lists of those)")
    table = table.select([name for name in table.column_names if name in target.names])
    try:
        table = conform(table)
    except (pa.ArrowException, ValueError, TypeError) as exc:
        name = _failing_column(table)
        raise WireError(f"column {name!r} does not fit the event schema: {exc}") from None
    return envelope, _absent_as_default(table)


def _absent_as_default(table: pa.Table) -> pa.Table:
    """A null where a column's value would be reads as the field's default, as an omitted
    field does in the row formats (Arrow writers mark "not given" with nulls). The fields every
    row must carry stay null, so their rows are refused by name; nulls inside lists stay too."""
    for spec in field_specs(Event):
        column = table.column(spec.name)
        if column.null_count and spec.name not in WIRE_REQUIRED:
            default = spec.default.value if isinstance(spec.default, enum.Enum) else spec.default
            at = table.schema.get_field_index(spec.name)
            filled = pc.fill_null(column, pa.scalar(default, column.type))
            table = table.set_column(at, table.schema.field(at), filled)
    return table


def _plain_fit(sent: pa.DataType, wanted: pa.DataType) -> bool:
    """Whether a column sent with one type may be read as the schema's type.

    Only the same kind of value, in a plain encoding: an integer of any width for an integer
    (a value out of range refuses the request), a float or integer for a float, a large string
    for a string, a (large) list of fitting values for a list. Arrow's casts would take far more
    (a bool or a timestamp as an integer, text parsed as a number), where the row formats
    refuse the row; and encodings that share data between rows (dictionaries, views, run ends,
    the null type) would let a small request decode into an unbounded table.
    """
    if sent == wanted:
        return True
    if pa.types.is_integer(wanted):
        return pa.types.is_integer(sent)
    if pa.types.is_floating(wanted):
        return pa.types.is_floating(sent) or pa.types.is_integer(sent)
    if pa.types.is_string(wanted):
        return pa.types.is_large_string(sent)
    if pa.types.is_list(wanted):
        return (pa.types.is_list(sent) or pa.types.is_large_list(sent)) and _plain_fit(sent.value_type,
                                                                                      wanted.value_type)
    return False


def _failing_column(table: pa.Table) -> str:
    target = arrow_schema()
    for f in target:
        if f.name in table.column_names:
            try:
                table.column(f.name).cast(f.type)
            except (pa.ArrowException, ValueError, TypeError):
                return f.name
    return ""


# -- refusing buffer compression, from the messages' flatbuffer metadata ----------------------
_U8, _U16, _I32, _U32 = struct.Struct("<B"), struct.Struct("<H"), struct.Struct("<i"), struct.Struct("<I")
_DICTIONARY_BATCH, _RECORD_BATCH = 2, 3  # MessageHeader union tags (Message.fbs)


def _field(buf: bytes, table: int, index: int) -> int:
    """Absolute position of a flatbuffer table's field, 0 when the field is absent."""
    vtable = table - _I32.unpack_from(buf, table)[0]
    if 4 + 2 * index >= _U16.unpack_from(buf, vtable)[0]:
        return 0
    offset = _U16.unpack_from(buf, vtable + 4 + 2 * index)[0]
    return table + offset if offset else 0


def _target(buf: bytes, pos: int) -> int:
    return pos + _U32.unpack_from(buf, pos)[0]


def _batch_compressed(buf: bytes, batch: int) -> bool:
    return _field(buf, batch, 3) != 0  # RecordBatch.compression


def _refuse_compressed(payload: bytes) -> None:
    try:
        reader = pa.ipc.MessageReader.open_stream(pa.py_buffer(payload))
        while True:
            try:
                message = reader.read_next_message()
            except StopIteration:
                return
            buf = message.metadata.to_pybytes()
            root = _U32.unpack_from(buf, 0)[0]
            kind_at, header_at = _field(buf, root, 1), _field(buf, root, 2)
            if not kind_at or not header_at:
                continue
            kind = _U8.unpack_from(buf, kind_at)[0]
            header = _target(buf, header_at)
            if kind == _DICTIONARY_BATCH and (data := _field(buf, header, 1)):
                header, kind = _target(buf, data), _RECORD_BATCH
            if kind == _RECORD_BATCH and _batch_compressed(buf, header):
                raise WireError("the stream's buffers are compressed inside Arrow IPC; send them uncompressed "
                                "and compress the request with Content-Encoding: gzip instead")
    except (pa.ArrowException, OSError, ValueError, struct.error) as exc:
        if isinstance(exc, WireError):
            raise
        raise WireError(f"not a readable Arrow IPC stream: {exc}") from None
