"""Loads event files into the store: JSONL, Parquet, and the emitter's spool files.

Every row is validated on its own; valid rows are stored and invalid ones quarantined with the
row number and reason, so one bad line never costs the rest of a file. Files are read in
bounded chunks, so memory does not grow with file size.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

import msgspec
import pyarrow.parquet as pq

from kvtrace.schema.events import Event
from kvtrace.schema.records import EmitterStats, Rejection
from kvtrace.schema.validation import event_from_builtins, event_from_json, validate_numbered, validate_rows
from kvtrace.schema.wire import SPOOL_MAGIC, WireError, decode_batch, decode_raw_event, read_spool
from kvtrace.store.client import Store

CHUNK_ROWS = 65536


class FileFormat(StrEnum):
    JSONL = "jsonl"
    PARQUET = "parquet"
    SPOOL = "spool"


def detect_format(path: Path) -> FileFormat:
    """By content, not name: Parquet and spool files carry magic bytes; the rest is JSONL.

    JSON text never holds a NUL byte, so a file that does (gzip, an unknown binary) is refused
    whole instead of being quarantined line by line as garbage.
    """
    with open(path, "rb") as f:
        head = f.read(4096)
    if head.startswith(b"PAR1"):
        return FileFormat.PARQUET
    if head.startswith(SPOOL_MAGIC):
        return FileFormat.SPOOL
    if b"\x00" in head:
        raise WireError(f"{path}: not JSONL, Parquet or a kvtrace spool file (binary content)")
    return FileFormat.JSONL


@dataclass(slots=True)
class Chunk:
    """Part of one file: what to store, what to quarantine, and emitter stats found in it."""

    events: list[Event]
    rejections: list[Rejection]
    stats: list[EmitterStats] = field(default_factory=list)


@dataclass(slots=True)
class FileReport:
    path: str
    format: FileFormat
    rows: int = 0
    stored: int = 0
    rejected: int = 0
    torn_bytes: int = 0  # spool: bytes of an incomplete last frame (a crash mid-write)
    first_rejections: list[Rejection] = field(default_factory=list)


def _jsonl_chunks(path: Path) -> Iterator[Chunk]:
    origin = str(path)
    lines: list[tuple[int, bytes]] = []
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                lines.append((number, line))
            if len(lines) >= CHUNK_ROWS:
                yield Chunk(*validate_numbered(lines, origin, event_from_json))
                lines = []
    if lines:
        yield Chunk(*validate_numbered(lines, origin, event_from_json))


def _parquet_chunks(path: Path) -> Iterator[Chunk]:
    parquet = pq.ParquetFile(path)
    first = 1
    for batch in parquet.iter_batches(batch_size=CHUNK_ROWS):
        rows = batch.to_pylist()
        good, bad = validate_rows(rows, str(path), first_row=first, decode=event_from_builtins)
        first += len(rows)
        yield Chunk(good, bad)


def _spool_chunks(path: Path, report: FileReport) -> Iterator[Chunk]:
    with open(path, "rb") as f:
        scan = read_spool(f, str(path))
    report.torn_bytes = scan.torn_tail_bytes
    for payload in scan.payloads:
        batch = decode_batch(payload)
        origin = f"{path}#source={batch.source_id:016x},batch={batch.batch_seq}"
        # Rows are decoded to builtins first, so a quarantined row keeps its content as JSON.
        rows = [decode_raw_event(raw) for raw in batch.events]
        good, bad = validate_rows(rows, origin, first_row=1, decode=event_from_builtins)
        yield Chunk(good, bad, [batch.stats] if batch.stats is not None else [])


def read_file(path: Path, report: FileReport) -> Iterator[Chunk]:
    if report.format is FileFormat.PARQUET:
        return _parquet_chunks(path)
    if report.format is FileFormat.SPOOL:
        return _spool_chunks(path, report)
    return _jsonl_chunks(path)


def ingest_file(
    store: Store, path: str | os.PathLike[str], on_chunk: Callable[[FileReport], None] | None = None
) -> FileReport:
    """Store one file's valid rows and quarantine the rest; raises only if the file is unreadable."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such file")
    try:
        report = FileReport(path=str(p), format=detect_format(p))
        for chunk in read_file(p, report):
            report.rows += len(chunk.events) + len(chunk.rejections)
            report.stored += store.insert_events(chunk.events)
            store.insert_rejections(chunk.rejections)
            store.insert_stats(chunk.stats)
            report.rejected += len(chunk.rejections)
            room = 20 - len(report.first_rejections)
            if room > 0:
                report.first_rejections += chunk.rejections[:room]
            if on_chunk:
                on_chunk(report)
    except WireError as exc:
        raise WireError(str(exc) if str(exc).startswith(str(p)) else f"{p}: {exc}") from exc
    except (msgspec.DecodeError, OSError) as exc:
        raise WireError(f"{p}: {exc}") from exc
    except Exception as exc:
        if type(exc).__module__.startswith("pyarrow"):
            raise WireError(f"{p}: not a readable Parquet file: {exc}") from exc
        raise
    return report


def iter_file_events(path: str | os.PathLike[str]) -> Iterator[Event]:
    """Valid events of a file without a store (offline readers); invalid rows are skipped."""
    p = Path(path)
    report = FileReport(path=str(p), format=detect_format(p))
    for chunk in read_file(p, report):
        yield from chunk.events

