"""The batch wire format: what the emitter sends to the collector and writes to spool files.

A batch is one msgpack document (msgspec-encoded `Batch`), versioned by `WIRE_VERSION` and
named by `CONTENT_TYPE`. Spool files are the same documents framed for append-only files: a
file header, then per frame its length and CRC32, so a torn final frame after a crash is
detected and skipped without losing the frames before it.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

import msgspec

from kvtrace.schema.events import Event
from kvtrace.schema.records import EmitterStats, Rejection

WIRE_VERSION = 1
CONTENT_TYPE = "application/vnd.kvtrace.batch.v1+msgpack"
SPOOL_MAGIC = b"KVTSPOOL"
SPOOL_HEADER = SPOOL_MAGIC + struct.pack(">H", WIRE_VERSION)
SPOOL_SUFFIX = ".kvspool"
_FRAME = struct.Struct(">II")  # payload length, crc32 of the payload
MAX_FRAME_BYTES = 256 * 1024 * 1024


class Batch(msgspec.Struct, kw_only=True):
    """Events from one emitter, numbered per source so the receiver can see missing batches.

    Every field is encoded, defaults included: the receiver requires `wire_version`.
    """

    wire_version: int = WIRE_VERSION
    source_id: int
    batch_seq: int
    sent_ns: int
    events: list[Event] = []
    stats: EmitterStats | None = None
    # Rows a receiver already found invalid, carried to the quarantine table (the collector's
    # spool); emitters never set it.
    rejections: list[Rejection] = []


class RawBatch(msgspec.Struct, kw_only=True):
    """A batch whose events are left undecoded, so each row can be validated on its own."""

    wire_version: int
    source_id: int
    batch_seq: int
    sent_ns: int
    events: list[msgspec.Raw] = []
    stats: EmitterStats | None = None
    rejections: list[Rejection] = []


class WireError(ValueError):
    """A batch or spool file that cannot be read at all (not a single bad row)."""


_encoder = msgspec.msgpack.Encoder()
_raw_decoder = msgspec.msgpack.Decoder(RawBatch)


def encode_batch(batch: Batch | RawBatch) -> bytes:
    """A batch's wire bytes. A RawBatch (events already encoded, as an emitter's journal holds
    them) encodes to the same bytes as the Batch of those events: its fields are the same, in
    the same order, and every one is always encoded."""
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> RawBatch:
    """Decode the envelope; events stay raw for per-row validation."""
    try:
        batch = _raw_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"not a kvtrace batch: {exc}") from None
    if batch.wire_version != WIRE_VERSION:
        raise WireError(f"wire version {batch.wire_version} not supported (this reader knows {WIRE_VERSION})")
    return batch


def decode_raw_event(raw: msgspec.Raw) -> object:
    """A batch row as plain builtins, for validation."""
    return msgspec.msgpack.decode(raw)


def frame(payload: bytes) -> bytes:
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


@dataclass(frozen=True, slots=True)
class SpoolScan:
    """Frames read from one spool file and whether its tail was torn."""

    payloads: list[bytes]
    torn_tail_bytes: int


def is_spool(head: bytes) -> bool:
    return head.startswith(SPOOL_MAGIC)


def read_header(stream: BinaryIO, name: str = "spool", magic: bytes = SPOOL_MAGIC) -> None:
    """Check a spool file's header (`magic`, then the version), leaving the stream at its
    first frame."""
    size = len(magic) + 2
    header = stream.read(size)
    if not header.startswith(magic):
        raise WireError(f"{name}: not a {magic.decode()} spool file (bad magic)")
    if len(header) < size:
        raise WireError(f"{name}: truncated spool header ({len(header)} of {size} bytes)")
    (version,) = struct.unpack(">H", header[len(magic) :])
    if version != WIRE_VERSION:
        raise WireError(f"{name}: spool version {version} not supported (this reader knows {WIRE_VERSION})")


def iter_frames(stream: BinaryIO, end: int | None = None) -> Iterator[bytes]:
    """Intact frames from the stream's position, stopping at a torn or corrupt one (or `end`).

    Each frame takes FRAME_OVERHEAD + len(payload) bytes, so a caller can track offsets.
    """
    while end is None or stream.tell() < end:
        start = stream.tell()
        head = stream.read(_FRAME.size)
        if len(head) < _FRAME.size:
            stream.seek(start)
            return
        length, crc = _FRAME.unpack(head)
        payload = stream.read(length) if length <= MAX_FRAME_BYTES else b""
        if length > MAX_FRAME_BYTES or len(payload) != length or zlib.crc32(payload) != crc:
            stream.seek(start)
            return
        yield payload


FRAME_OVERHEAD = _FRAME.size


def read_spool(stream: BinaryIO, name: str = "spool") -> SpoolScan:
    """Every intact frame; a torn or corrupt tail (a crash mid-write) ends the scan.

    A corrupt frame in the middle also ends it, since frame boundaries past it cannot be
    trusted; the count of unread bytes says how much was lost.
    """
    read_header(stream, name)
    payloads = list(iter_frames(stream))
    return SpoolScan(payloads, len(stream.read()))


def iter_spool_batches(stream: BinaryIO, name: str = "spool") -> Iterator[RawBatch]:
    for payload in read_spool(stream, name).payloads:
        yield decode_batch(payload)
