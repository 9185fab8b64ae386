"""An in-memory sink, shipped for tests of shims and of the emitter itself."""

from __future__ import annotations

import threading
import time

from kvtrace.instrumentation.sinks.base import OK, ExportResult, ExportStatus
from kvtrace.schema.events import Event
from kvtrace.schema.records import EmitterStats
from kvtrace.schema.wire import Batch


class MemorySink:
    """Keeps every exported event; can be told to fail or stall to exercise failure paths."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.batches: list[Batch] = []
        self.fail_with: ExportStatus | None = None  # make every export answer this
        self.raise_error: Exception | None = None  # make every export raise this
        self.delay_s = 0.0  # stall every export this long
        self.calls = 0
        self.shutdowns = 0

    def export(self, batch: Batch) -> ExportResult:
        with self._lock:
            self.calls += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.raise_error is not None:
            raise self.raise_error
        if self.fail_with is not None:
            return ExportResult(self.fail_with, detail="told to fail")
        with self._lock:
            self.batches.append(batch)
        return OK

    def shutdown(self) -> None:
        self.shutdowns += 1

    @property
    def events(self) -> list[Event]:
        with self._lock:
            return [e for b in self.batches for e in b.events]

    @property
    def last_stats(self) -> EmitterStats | None:
        with self._lock:
            stats = [b.stats for b in self.batches if b.stats is not None]
        return stats[-1] if stats else None
