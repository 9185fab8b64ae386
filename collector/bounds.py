"""How many rows a request carries, known before any row is decoded.

A request's cost must follow its size: a few kilobytes of gzip can inflate to millions of
empty rows, and decoding each into an object (or a rejection) costs microseconds and a hundred
bytes apiece. So the rows are counted on the raw bytes first, in C where possible, and a
request over the row cap is refused (413) before a single row object exists.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator

from kvtrace.schema.arrow_wire import MAX_ROWS

ROW_CAP = MAX_ROWS
"""Rows in one request, in every format (the columnar format's own cap)."""

_U16 = struct.Struct(">H").unpack_from
_U32 = struct.Struct(">I").unpack_from


def msgpack_array_length(raw: bytes) -> int:
    """The element count in a msgpack array's header (-1 when `raw` is not an array)."""
    if not raw:
        return -1
    head = raw[0]
    if 0x90 <= head <= 0x9F:
        return head & 0x0F
    if head == 0xDC and len(raw) >= 3:
        return _U16(raw, 1)[0]
    if head == 0xDD and len(raw) >= 5:
        return _U32(raw, 1)[0]
    return -1


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_INNERMOST = re.compile(rb"\{[^{}\[\]]*\}|\[[^{}\[\]]*\]")
MAX_JSON_DEPTH = 8
"""Nesting inside one JSON event row (an event is an object of scalars and lists of lists)."""


def json_rows_over(raw: bytes, cap: int = ROW_CAP) -> int:
    """0 when a JSON array has at most `cap` elements, else its element count.

    Every element but the first follows a comma, so an array with fewer commas than the cap
    is known to fit at once (the common case, free). Otherwise strings are blanked and the
    innermost brackets folded away a level at a time (each pass a C-level regex over the
    bytes) until the top level's commas can be counted. Raises ValueError when `raw` is not
    an array, or nests deeper than an event row can.
    """
    body = raw.strip()
    if not body.startswith(b"[") or not body.endswith(b"]"):
        raise ValueError("expected a JSON array")
    inner = body[1:-1]
    if not inner.strip() or inner.count(b",") < cap:
        return 0
    count = _top_level_commas(inner) + 1
    return count if count > cap else 0


def _top_level_commas(inner: bytes) -> int:
    flat = _STRING.sub(b"0", inner)
    for _ in range(MAX_JSON_DEPTH + 1):
        if b"{" not in flat and b"[" not in flat:
            return flat.count(b",")
        flat, folded = _INNERMOST.subn(b"0", flat)
        if not folded:
            break
    raise ValueError(f"rows nest deeper than {MAX_JSON_DEPTH} levels")


def _varint(buf: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(buf) or shift > 63:
            raise ValueError("truncated or overlong varint")
        byte = buf[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def _fields(buf: bytes, start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """(field number, start, end) of each length-delimited field of one protobuf message;
    other wire types are skipped."""
    at = start
    while at < end:
        tag, at = _varint(buf, at)
        kind = tag & 7
        if kind == 0:
            _, at = _varint(buf, at)
        elif kind == 1:
            at += 8
        elif kind == 5:
            at += 4
        elif kind == 2:
            size, at = _varint(buf, at)
            if at + size > end:
                raise ValueError("a field runs past its message")
            yield tag >> 3, at, at + size
            at += size
        else:
            raise ValueError(f"wire type {kind} is not used by OTLP")


def protobuf_records_over(payload: bytes, cap: int = ROW_CAP) -> int:
    """0 when an OTLP ExportLogsServiceRequest holds at most `cap` log records, else a count
    past the cap (the walk stops there). Only the three repeated levels down to the records
    are walked, without decoding them; a malformed body counts 0 and is left for protobuf's
    parser to name."""
    count = 0
    try:
        for number, rs, re_ in _fields(payload, 0, len(payload)):  # ResourceLogs = 1
            if number != 1:
                continue
            for number2, ss, se in _fields(payload, rs, re_):  # ScopeLogs = 2
                if number2 != 2:
                    continue
                for number3, _, _ in _fields(payload, ss, se):  # LogRecord = 2
                    if number3 == 2:
                        count += 1
                        if count > cap:
                            return count
    except ValueError:
        return 0
    return 0
