"""A sink that counts and drops: the shim benchmarks measure the hooks and the emitter, not an
export path (bench_export.py measures those)."""

from __future__ import annotations

from kvtrace.instrumentation.sinks.base import OK, ExportResult
from kvtrace.schema.wire import Batch


class CountingSink:
    def __init__(self) -> None:
        self.events = 0

    def export(self, batch: Batch) -> ExportResult:
        self.events += len(batch.events)
        return OK

    def shutdown(self) -> None:
        pass
