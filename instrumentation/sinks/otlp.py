"""Sends events as OpenTelemetry log records, so they can ride an existing OTLP pipeline.

Each event becomes one log record named `kvtrace.event` whose body is the event's JSON (exact:
64-bit block keys do not fit OTLP's signed integers) and whose attributes carry the fields
pipelines route and filter on. The kvtrace collector's `/v1/logs` endpoint reads them back.
"""

from __future__ import annotations

import msgspec

from kvtrace.instrumentation.sinks.base import OK, ExportResult, ExportStatus
from kvtrace.schema.events import SCHEMA_VERSION, Event
from kvtrace.schema.wire import Batch

EVENT_NAME = "kvtrace.event"
STATS_NAME = "kvtrace.emitter_stats"
_json = msgspec.json.Encoder()


def event_attributes(event: Event) -> dict[str, str | int]:
    return {
        "kvtrace.kind": event.kind.value,
        "kvtrace.schema_version": SCHEMA_VERSION,
        "kvtrace.engine": event.engine,
        "kvtrace.instance": event.instance,
        "kvtrace.model": event.model,
        "kvtrace.tenant": event.tenant,
    }


class OtlpLogSink:
    """Wraps an OpenTelemetry SDK LoggerProvider; by default it exports OTLP/HTTP protobuf.

    Pass `exporter` to send through any LogRecordExporter (the SDK's in-memory one in tests,
    a gRPC exporter, a console one). Our batcher already batches, so records are handed to
    the SDK's own batch processor, which owns delivery from there.
    """

    def __init__(self, endpoint: str = "", exporter: object | None = None, service_name: str = "kvtrace") -> None:
        from opentelemetry.sdk._logs import LoggerProvider
        from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
        from opentelemetry.sdk.resources import Resource

        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter

            exporter = OTLPLogExporter(endpoint=endpoint) if endpoint else OTLPLogExporter()
        self.provider = LoggerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_log_record_processor(BatchLogRecordProcessor(exporter))  # type: ignore[arg-type]
        self.logger = self.provider.get_logger("kvtrace", "0.1.0")

    def export(self, batch: Batch) -> ExportResult:
        try:
            for event in batch.events:
                self.logger.emit(
                    timestamp=event.ts_ns,
                    body=_json.encode(event).decode(),
                    attributes=event_attributes(event),
                    event_name=EVENT_NAME,
                )
            if batch.stats is not None:
                self.logger.emit(
                    timestamp=batch.stats.ts_ns,
                    body=_json.encode(batch.stats).decode(),
                    attributes={"kvtrace.instance": batch.stats.instance},
                    event_name=STATS_NAME,
                )
        except Exception as exc:  # noqa: BLE001
            return ExportResult(ExportStatus.RETRY, detail=f"OTLP emit failed: {exc}")
        return OK

    def flush(self, timeout_millis: int = 10000) -> bool:
        return bool(self.provider.force_flush(timeout_millis))

    def shutdown(self) -> None:
        self.provider.shutdown()
