"""The collector without HTTP: spool, drain, live reconstruction, auth and metrics, wired.

`Collector.ingest` is what the batch endpoint calls; `start` / `stop` are its lifecycle. The
HTTP app in `app` only maps requests and answers onto these calls.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec
import pyarrow.compute as pc

from kvtrace.analysis.evaluate import Policy
from kvtrace.collector.auth import Grant, TokenTable
from kvtrace.collector.drain import Drain
from kvtrace.collector.intake import (
    Intake,
    IntakeError,
    Unavailable,
    decompress,
    intake_batch,
    intake_events,
    intake_otlp,
)
from kvtrace.collector.live import LiveReconstruction
from kvtrace.collector.metrics import CollectorMetrics
from kvtrace.collector.spool import DurableSpool, SpoolFull, SpoolRecord, encode_record
from kvtrace.collector.subscribe import KvEventSource, Subscription
from kvtrace.schema.arrow_wire import write_stream
from kvtrace.schema.paths import data_dir
from kvtrace.schema.recipes import Recipe, RecipeBook
from kvtrace.schema.wire import Batch
from kvtrace.store.client import Store

log = logging.getLogger("kvtrace.collector")
json_lines = msgspec.json.Encoder().encode_lines


@dataclass(frozen=True, slots=True)
class CollectorConfig:
    dsn: str | None = None  # None: the embedded default store
    spool_dir: str = ""  # "": <data dir>/collector-spool
    max_spool_bytes: int = 1 << 30
    high_water: float = 0.9  # answer 429 once the spool is this full
    max_request_bytes: int = 64 << 20  # after decompression
    fsync: bool = True
    tokens: TokenTable = field(default_factory=TokenTable)
    recipes: RecipeBook | Recipe | None = None  # None: no live reconstruction
    policy: Policy = Policy()
    lateness_ns: int = 2_000_000_000
    rebuild_window_ns: int = 3600 * 10**9
    drain_timeout_s: float = 30.0
    kv_event_sources: tuple[KvEventSource, ...] = ()  # ZMQ KV-event streams to subscribe to


@dataclass(frozen=True, slots=True)
class Readiness:
    ready: bool
    store_ok: bool
    spool_pending_bytes: int
    spool_bound_bytes: int
    shutting_down: bool
    detail: str


class Collector:
    def __init__(self, config: CollectorConfig = CollectorConfig()) -> None:
        self.config = config
        self.metrics = CollectorMetrics()
        self.store = Store(config.dsn)
        spool_dir = config.spool_dir or str(data_dir() / "collector-spool")
        self.spool = DurableSpool(spool_dir, max_bytes=config.max_spool_bytes, fsync=config.fsync)
        self.live = (LiveReconstruction(self.store, config.recipes, self.metrics, config.policy,
                                        config.lateness_ns, config.rebuild_window_ns)
                     if config.recipes is not None else None)
        self.drain = Drain(self.spool, self.store, self.metrics,
                           on_stored=self.live.feed if self.live is not None else None,
                           on_ended=self.live.ended if self.live is not None else None)
        self._stopping = False
        self._started = False
        self._ticker: threading.Thread | None = None
        self._tick_stop = threading.Event()
        self._subscriptions: list = []

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Create the schema if needed and start draining (what a restart left in the spool first)."""
        try:
            self.store.init()
        except Exception as exc:  # noqa: BLE001 - start anyway: the spool takes batches until the store is back
            log.warning("store %s not reachable at start-up (%s); spooling until it is", self.store.dsn, exc)
        if self.spool.torn_bytes:
            log.warning("spool: cut %d bytes of a batch torn by a crash (never acknowledged)", self.spool.torn_bytes)
        if self.spool.pending_bytes:
            log.info("spool: resuming with %d bytes not yet stored", self.spool.pending_bytes)
        if not self.config.tokens.enabled:
            log.warning("no collector tokens configured: authentication is OFF (every request may write "
                        "and read every tenant); set KVTRACE_COLLECTOR_TOKENS or a token file in production")
        self.drain.start()
        if self.config.kv_event_sources:
            self._subscriptions = [Subscription(self, source) for source in self.config.kv_event_sources]
            for sub in self._subscriptions:
                sub.start()
        if self.live is not None:
            self._ticker = threading.Thread(target=self._tick, name="kvtrace-live-tick", daemon=True)
            self._ticker.start()
        self._started = True

    def _tick(self) -> None:
        while not self._tick_stop.wait(0.5):
            try:
                assert self.live is not None
                self.live.tick()
            except Exception:  # noqa: BLE001
                log.exception("live reconstruction tick failed")

    def stop(self) -> bool:
        """Graceful: refuse new batches, drain the spool into the store, flush live verdicts.
        Safe to call twice. Returns True when the spool was emptied."""
        if not self._started:
            return True
        for sub in self._subscriptions:  # their last batches are spooled before the drain empties it
            sub.stop()
        self._stopping = True
        emptied = self.drain.stop(drain=True, timeout_s=self.config.drain_timeout_s)
        self._tick_stop.set()
        if self._ticker is not None:
            self._ticker.join(5)
        if self.live is not None and emptied:
            try:
                self.live.tick(force=True)
            except Exception:  # noqa: BLE001
                log.exception("final live reconstruction flush failed")
        self.spool.close()
        self.store.close()
        self._started = False
        if emptied:
            log.info("stopped: spool drained into the store")
        else:
            log.warning("stopped with %d spooled bytes not yet stored; they are stored at the next start",
                        self.spool.pending_bytes)
        return emptied

    # -- requests ----------------------------------------------------------------------------
    def authenticate(self, authorization: str | None) -> Grant | None:
        return self.config.tokens.from_header(authorization)

    def _admit(self, size: int) -> None:
        if self._stopping:
            raise Unavailable(503, "collector is shutting down", 5)
        bound = self.config.max_spool_bytes * self.config.high_water
        if self.spool.pending_bytes + size > bound:
            wait = 2 if self.drain.store_ok else 10
            raise Unavailable(429, f"spool is full ({self.spool.pending_bytes} of {int(bound)} bytes waiting "
                                   "for the store); retry later", wait)

    def ingest(self, body: bytes, content_type: str | None, encoding: str | None, grant: Grant,
               otlp: bool = False) -> tuple[Intake, int]:
        """Validate, spool durably, and return the intake (and foreign OTLP records skipped)."""
        started = time.perf_counter()
        self._admit(len(body))
        payload = decompress(body, encoding, self.config.max_request_bytes)
        if otlp:
            intake, foreign = intake_otlp(payload, content_type or "", grant)
        else:
            intake, foreign = intake_batch(payload, content_type or "", grant), 0
        self._spool(intake, grant, started)
        intake.release()
        return intake, foreign

    def accept(self, batch: Batch, grant: Grant) -> Intake:
        """Typed events from inside this process (the KV-event subscriber), validated and
        placed like the rows of a request, then spooled."""
        started = time.perf_counter()
        self._admit(0)
        intake = intake_events(batch, grant)
        self._spool(intake, grant, started)
        return intake

    def _spool(self, intake: Intake, grant: Grant, started: float) -> None:
        tenant = grant.name
        self.metrics.received.labels(tenant).inc(intake.received)
        if intake.accepted or intake.quarantined or intake.batch.stats is not None:
            batch, table = intake.batch, intake.table
            tenants = Counter(e.tenant for e in batch.events)
            if table is not None and table.num_rows:
                counts = pc.value_counts(table.column("tenant")).to_pylist()
                tenants.update({c["values"]: c["counts"] for c in counts})
            data = encode_record(SpoolRecord(
                received_ns=time.time_ns(), origin=f"{grant.name}:{batch.source_id:016x}:{batch.batch_seq}",
                events=intake.accepted, tenants=dict(tenants), lines=json_lines(batch.events),
                columns=write_stream(table) if table is not None and table.num_rows else b"",
                rejections=batch.rejections, stats=batch.stats))
            try:
                self.spool.append(data)
            except SpoolFull as exc:
                raise Unavailable(429, str(exc), 2) from None
            except OSError as exc:
                raise Unavailable(503, f"cannot write the spool: {exc.strerror}", 5) from None
            self.metrics.spooled_bytes.inc(len(data))
            self.metrics.spool_bytes.set(self.spool.pending_bytes)
            self.drain.poke()
        self.metrics.accepted.labels(tenant).inc(intake.accepted)
        self.metrics.quarantined.labels(tenant).inc(intake.quarantined)
        self.metrics.ingest_seconds.observe(time.perf_counter() - started)

    def refused(self, grant_name: str, status: int) -> None:
        self.metrics.rejected.labels(grant_name, str(status)).inc()

    def readiness(self) -> Readiness:
        pending = self.spool.pending_bytes
        bound = self.config.max_spool_bytes
        full = pending >= bound * self.config.high_water
        store_ok = self.drain.store_ok
        ready = store_ok and not full and not self._stopping and self._started
        detail = ("shutting down" if self._stopping else "not started" if not self._started
                  else f"store unreachable: {self.drain.last_error}" if not store_ok
                  else "spool nearly full" if full else "ok")
        return Readiness(ready, store_ok, pending, bound, self._stopping, detail)


def config_from_env(env: Mapping[str, str] | None = None, **overrides: object) -> CollectorConfig:
    """Settings from KVTRACE_COLLECTOR_* variables (tokens too), then explicit overrides."""
    env = os.environ if env is None else env
    values: dict[str, object] = {"tokens": TokenTable.from_env(env)}
    if env.get("KVTRACE_DSN"):
        values["dsn"] = env["KVTRACE_DSN"]
    if env.get("KVTRACE_COLLECTOR_SPOOL_DIR"):
        values["spool_dir"] = env["KVTRACE_COLLECTOR_SPOOL_DIR"]
    values.update({k: v for k, v in overrides.items() if v is not None})
    return CollectorConfig(**values)  # type: ignore[arg-type]


__all__ = ["Collector", "CollectorConfig", "IntakeError", "Readiness", "Unavailable", "config_from_env"]
