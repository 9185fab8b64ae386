"""Rotating local spool files: the offline sink, read back with `kvtrace ingest`.

Each file starts with the spool header; each batch is one CRC-checked frame. Files rotate by
size and the total is bounded: past the bound new batches are refused (and counted by the
emitter as failed exports) rather than old evidence silently deleted.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import BinaryIO

from kvtrace.instrumentation.sinks.base import OK, AnyBatch, ExportResult, ExportStatus
from kvtrace.schema.wire import SPOOL_HEADER, SPOOL_SUFFIX, encode_batch, frame


class SpoolWriter:
    """Appends framed payloads to size-rotated files in one directory."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        prefix: str,
        max_file_bytes: int = 64 * 1024 * 1024,
        max_total_bytes: int = 4 * 1024 * 1024 * 1024,
        fsync: bool = False,
    ) -> None:
        if max_file_bytes <= len(SPOOL_HEADER) or max_total_bytes < max_file_bytes:
            raise ValueError("need max_total_bytes >= max_file_bytes > header size")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        self.max_file_bytes = max_file_bytes
        self.max_total_bytes = max_total_bytes
        self.fsync = fsync
        self._lock = threading.Lock()
        self._file: BinaryIO | None = None
        self._file_bytes = 0
        self._index = max((self._index_of(p) for p in self.files()), default=0)
        self._total = self.total_bytes()

    def _index_of(self, path: Path) -> int:
        try:
            return int(path.stem.rsplit("-", 1)[1])
        except (IndexError, ValueError):
            return 0

    def files(self) -> list[Path]:
        return sorted(self.directory.glob(f"{self.prefix}-*{SPOOL_SUFFIX}"))

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.files())

    def _open_next(self) -> BinaryIO:
        if self._file is not None:
            self._file.close()
        self._index += 1
        path = self.directory / f"{self.prefix}-{self._index:06d}{SPOOL_SUFFIX}"
        f = open(path, "ab")  # noqa: SIM115 - kept open across appends
        f.write(SPOOL_HEADER)
        self._file, self._file_bytes = f, len(SPOOL_HEADER)
        self._total += len(SPOOL_HEADER)
        return f

    def append(self, payload: bytes) -> bool:
        """Write one frame; False when the spool is at its bound."""
        data = frame(payload)
        with self._lock:
            if self._total + len(data) + len(SPOOL_HEADER) > self.max_total_bytes:
                return False
            f = self._file
            if f is None or self._file_bytes + len(data) > self.max_file_bytes:
                f = self._open_next()
            f.write(data)
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
            self._file_bytes += len(data)
            self._total += len(data)
        return True

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


class SpoolSink:
    takes_encoded = True  # frames are batches as they are encoded: journal records go in unread

    def __init__(self, directory: str | os.PathLike[str], **kwargs: object) -> None:
        self._directory = directory
        self._kwargs = kwargs
        self._writer: SpoolWriter | None = None
        self._source_id = 0

    def export(self, batch: AnyBatch) -> ExportResult:
        # Files are named by the emitter's source id; a forked child has a new one and must
        # never append to its parent's file.
        if self._writer is None or self._source_id != batch.source_id:
            if self._writer is not None:
                self._writer.close()
            self._source_id = batch.source_id
            self._writer = SpoolWriter(self._directory, f"kvtrace-{batch.source_id:016x}", **self._kwargs)  # type: ignore[arg-type]
        try:
            if self._writer.append(encode_batch(batch)):
                return OK
        except OSError as exc:
            return ExportResult(ExportStatus.RETRY, detail=f"spool write failed: {exc}")
        return ExportResult(ExportStatus.FAILURE, detail=f"spool {self._directory} is full")

    def shutdown(self) -> None:
        if self._writer is not None:
            self._writer.close()
