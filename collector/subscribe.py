"""Subscriber mode: the collector reads an engine's ZMQ KV-event stream itself (the KV-event
bridge), for engines whose processes cannot be instrumented.

The bridge's events go through the ordinary batcher (bounded queue, drop counters, its own
source id) into a sink that hands each batch to the collector in-process, where it is validated,
spooled and stored like a request's. When the spool is full the sink answers RETRY with a wait,
so the batcher backs off and, past its bound, drops and counts: a stalled store never stalls
the subscription.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Protocol

from kvtrace.collector.auth import OPEN, Grant
from kvtrace.collector.intake import Intake, IntakeError, Unavailable
from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.identity import Identity
from kvtrace.instrumentation.kv_events import KvEventBridge
from kvtrace.instrumentation.sinks.base import OK, ExportResult, ExportStatus
from kvtrace.schema.wire import Batch

log = logging.getLogger("kvtrace.collector.subscribe")


class Acceptor(Protocol):
    """What a subscription hands its batches to: the collector's `accept`, which spools a batch
    for a grant, or raises `IntakeError` (refused for good) or `Unavailable` (not now). A
    protocol, so this module needs nothing of the service that runs it."""

    def accept(self, batch: Batch, grant: Grant) -> Intake: ...


@dataclass(frozen=True, slots=True)
class KvEventSource:
    """One publisher to subscribe to, and what its events are about (the stream does not say)."""

    endpoint: str  # e.g. tcp://engine-host:5557
    replay_endpoint: str | None = None  # the publisher's replay socket, to fill sequence gaps
    instance: str = ""
    model: str = ""
    tenant: str = ""  # events land in this tenant's namespace ("" keeps the stream's own)
    topic: str = ""
    engine: str = ""  # the publishing engine (vllm, sglang): the wire format does not say


class CollectorSink:
    """A sink that spools batches into the collector running in this process."""

    def __init__(self, collector: Acceptor, grant: Grant) -> None:
        self.collector = collector
        self.grant = grant

    def export(self, batch: Batch) -> ExportResult:
        try:
            intake = self.collector.accept(batch, self.grant)
        except Unavailable as exc:
            return ExportResult(ExportStatus.RETRY, retry_after_s=exc.retry_after_s, detail=exc.message)
        except IntakeError as exc:
            return ExportResult(ExportStatus.FAILURE, detail=exc.message)
        return ExportResult(ExportStatus.SUCCESS, rejected=intake.quarantined) if intake.quarantined else OK

    def shutdown(self) -> None:
        return None


class Subscription:
    """A KV-event bridge polled on its own thread; `stop()` flushes what it has batched."""

    def __init__(self, collector: Acceptor, source: KvEventSource) -> None:
        self.source = source
        grant = Grant(name=source.tenant, tenants=frozenset({source.tenant})) if source.tenant else OPEN
        identity = Identity(instance=source.instance or source.endpoint, model=source.model,
                            default_tenant=source.tenant)
        self.emitter = BatchEmitter(CollectorSink(collector, grant), BatchConfig(schedule_delay_millis=100),
                                    instance=identity.instance, engine="kv-events", register_atexit=False)
        self.bridge = KvEventBridge(source.endpoint, self.emitter, identity, topic=source.topic,
                                    replay_endpoint=source.replay_endpoint, engine=source.engine)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvtrace-sub-{source.endpoint}", daemon=True)

    def start(self) -> None:
        self._thread.start()
        log.info("subscribed to KV events at %s", self.source.endpoint)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.bridge.poll(timeout_ms=100)
            except Exception:  # noqa: BLE001 - keep subscribing; the bridge counts what it skipped
                log.exception("KV-event subscription %s: poll failed", self.source.endpoint)
                self._stop.wait(1.0)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        self.emitter.shutdown()
        self.bridge.close()
