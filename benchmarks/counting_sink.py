"""Sinks that drop what they get: the shim benchmarks measure the hooks and the emitter, not an
export path (bench_export.py measures those). `CountingSink` only counts; `EncodingSink` also
encodes each batch as the spool and HTTP sinks do (msgpack rows), so the exporter thread's share
of the engine process's time is in the measurement."""

from __future__ import annotations

from kvtrace.instrumentation.sinks.base import OK, AnyBatch, ExportResult
from kvtrace.schema.wire import encode_batch


class CountingSink:
    takes_encoded = True  # a journaled emitter hands it the records as they are (a RawBatch)

    def __init__(self) -> None:
        self.events = 0

    def export(self, batch: AnyBatch) -> ExportResult:
        self.events += len(batch.events)
        return OK

    def shutdown(self) -> None:
        pass


class EncodingSink(CountingSink):
    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def export(self, batch: AnyBatch) -> ExportResult:
        self.bytes += len(encode_batch(batch))
        return super().export(batch)
