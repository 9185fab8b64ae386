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
from operator import attrgetter

import msgspec
import pyarrow.compute as pc

from kvtrace.analysis.evaluate import Policy
from kvtrace.collector.auth import Grant, TokenTable
from kvtrace.collector.drain import Drain
from kvtrace.collector.intake import (
    Intake,
    IntakeError,
    TimeWindow,
    Unavailable,
    decompress,
    intake_batch,
    intake_events,
    intake_otlp,
)
from kvtrace.collector.live import LiveReconstruction, LiveWorker
from kvtrace.collector.metrics import CollectorMetrics
from kvtrace.collector.owners import SourceWriters, writer_of
from kvtrace.collector.spool import DurableSpool, SpoolFull, SpoolRecord, encode_record, spool_columns
from kvtrace.collector.subscribe import KvEventSource, Subscription
from kvtrace.schema.paths import data_dir
from kvtrace.schema.recipes import Recipe, RecipeBook
from kvtrace.schema.records import Rejection
from kvtrace.schema.wire import FRAME_OVERHEAD, Batch
from kvtrace.store.client import Store

log = logging.getLogger("kvtrace.collector")
_SOURCE_TENANT = attrgetter("source_id", "tenant")
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
    live_max_held: int = 200_000  # events one instance's reorder buffer holds before releasing early
    live_process: bool = True  # judge in a process of its own (collector.judge); False: in this one
    rebuild_window_ns: int = 3600 * 10**9
    drain_timeout_s: float = 30.0
    kv_event_sources: tuple[KvEventSource, ...] = ()  # ZMQ KV-event streams to subscribe to
    time_window: TimeWindow | None = TimeWindow()  # rows outside it are quarantined (None: any time)
    public_metrics: bool = False  # /metrics (which names tenants) without an operator token
    fair_spool: bool = True  # a writer past its share of the spool is told 429 while others still write


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
        self.store = Store(config.dsn)  # the schema, the API's reads, the writers' books
        # The drain and the live verdicts each talk to the store through a handle of their own
        # (an HTTP connection; for the embedded store, a connection to the one engine). Why:
        # calls on one handle are serialized, so on a shared one the drain waited for every
        # verdict insert (~0.4 us per event, with the drain the ingest's bottleneck), for a
        # rebuild's read of an instance's history, and for each query of the API.
        self.ingest_store = Store(config.dsn)
        self.live_store: Store | None = None
        self.writers = SourceWriters(self.store)
        spool_dir = config.spool_dir or str(data_dir() / "collector-spool")
        self.spool = DurableSpool(spool_dir, max_bytes=config.max_spool_bytes, fsync=config.fsync)
        self.live: LiveReconstruction | None = None
        if config.recipes is not None:
            self.live_store = Store(config.dsn)
            self.live = LiveReconstruction(self.live_store, config.recipes, self.metrics, config.policy,
                                           config.lateness_ns, config.rebuild_window_ns,
                                           max_held=config.live_max_held, own_process=config.live_process)
        self.live_worker = LiveWorker(self.live) if self.live is not None else None
        self.drain = Drain(self.spool, self.ingest_store, self.metrics,
                           on_stored=self.live_worker.stored if self.live_worker is not None else None,
                           on_ended=self.live_worker.ended if self.live_worker is not None else None,
                           on_drained=self._drained)
        self._pending_by: Counter[str] = Counter()  # spooled, not yet stored bytes per writer (grant name)
        self._pending_lock = threading.Lock()
        self._stopping = False
        self._started = False
        self._ticker: threading.Thread | None = None
        self._tick_stop = threading.Event()
        self._subscriptions: list = []

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the live judge, create the schema if needed and start draining (what a restart
        left in the spool first). Ready means judging too: the judge process is up before the
        first batch (`LiveReconstruction.warm`)."""
        if self.live is not None:
            self.live.warm(wait=False)  # it starts while the store opens
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
        if self.live is not None:
            self.live.warm()
        if self.live_worker is not None:
            self.live_worker.start()
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
        # What was stored is judged before the last flush (a chunk left unjudged is not flushed
        # past: a restart rebuilds its state from the store).
        judged = self.live_worker is None or self.live_worker.stop(self.config.drain_timeout_s)
        self._tick_stop.set()
        if self._ticker is not None:
            self._ticker.join(5)
        if self.live is not None and emptied and judged:
            try:
                self.live.tick(force=True)
            except Exception:  # noqa: BLE001
                log.exception("final live reconstruction flush failed")
        if self.live is not None:
            self.live.close()
        self.spool.close()
        for store in (self.live_store, self.ingest_store, self.store):
            if store is not None:
                store.close()
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

    def _drained(self, sizes: Counter[str]) -> None:
        with self._pending_lock:
            self._pending_by.subtract(sizes)
            for name in [n for n, v in self._pending_by.items() if v <= 0]:
                del self._pending_by[name]

    def _admit(self, size: int, writer: str = "") -> None:
        """Refuse what cannot be spooled now (429 or 503, with Retry-After) or ever (413).

        Fair use: the spool's high-water bound is shared equally by the writers that have bytes
        waiting in it (the requester counted), and a writer past its share is told 429 even while
        the spool has room. Until the high-water mark is reached a lone writer uses all of it;
        the bytes between it and the hard bound stay for the others, so a tenant that floods the
        collector while the store is slow never locks the rest out.
        """
        if self._stopping:
            raise Unavailable(503, "collector is shutting down", 5)
        bound = self.config.max_spool_bytes * self.config.high_water
        if size > bound:  # waiting would never help: say so, not 429 forever
            raise IntakeError(413, f"a {size}-byte request can never fit the collector's spool ({int(bound)} bytes "
                                   "accepted at once); send smaller batches")
        wait = 2 if self.drain.store_ok else 10
        if self.config.fair_spool and writer:
            with self._pending_lock:
                mine = self._pending_by.get(writer, 0)
                writers = len(self._pending_by) + (writer not in self._pending_by)
            share = bound / writers
            if writers > 1 and mine + size > share:
                raise Unavailable(429, f"this token has {mine} bytes waiting in the spool, its share of {int(share)} "
                                       f"while {writers} writers wait for the store; retry later", wait)
            if writers > 1 and self.spool.pending_bytes + size <= self.config.max_spool_bytes:
                return  # within its share: the headroom above high water is there for it
        if self.spool.pending_bytes + size > bound:
            raise Unavailable(429, f"spool is full ({self.spool.pending_bytes} of {int(bound)} bytes waiting "
                                   "for the store); retry later", wait)

    def ingest(self, body: bytes, content_type: str | None, encoding: str | None, grant: Grant,
               otlp: bool = False) -> tuple[Intake, int]:
        """Validate, spool durably, and return the intake (and foreign OTLP records skipped)."""
        started = time.perf_counter()
        self._admit(len(body), grant.name)
        payload = decompress(body, encoding, self.config.max_request_bytes)
        window = self.config.time_window
        if otlp:
            intake, foreign = intake_otlp(payload, content_type or "", grant, window)
        else:
            intake, foreign = intake_batch(payload, content_type or "", grant, window), 0
        self._own(intake, grant)
        self._spool(intake, grant, started)
        intake.release()
        return intake, foreign

    def _own(self, intake: Intake, grant: Grant) -> None:
        """Quarantine stats that claim a source whose events another token writes (`owners`),
        mark the rest with the writer they came from, and remember whose events these are."""
        batch = intake.batch
        pairs = set(map(_SOURCE_TENANT, batch.events))
        if intake.table is not None and intake.table.num_rows:
            sources = intake.table.column("source_id")
            low, high = pc.min_max(sources).values()
            if low == high:  # a batch is one emitter's, as a rule: its tenants by `unique` (0.07 ms; a group-by 0.37)
                pairs.update((low.as_py(), t) for t in pc.unique(intake.table.column("tenant")).to_pylist())
            else:
                both = intake.table.select(["source_id", "tenant"]).group_by(["source_id", "tenant"]).aggregate([])
                pairs.update(zip(both.column("source_id").to_pylist(), both.column("tenant").to_pylist(), strict=True))
        stats = batch.stats
        if stats is not None:
            if stats.source_id in {s for s, _ in pairs} or self.writers.may_report(stats.source_id, grant):
                stats.writer = writer_of(grant)
            else:
                batch.rejections.append(Rejection(
                    received_ns=time.time_ns(), origin=f"{grant.name}:{stats.source_id:016x}:{batch.batch_seq}",
                    row=0, field="stats.source_id",
                    reason=f"source {stats.source_id:016x} writes events of other tenants: this token may not "
                           "report its counters", raw=msgspec.json.encode(stats).decode()[:65536]))
                batch.stats = None
                intake.quarantined += 1
        self.writers.wrote(pairs)

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
                columns=spool_columns(table) if table is not None and table.num_rows else b"",
                rejections=batch.rejections, stats=batch.stats))
            try:
                self.spool.append(data)
            except SpoolFull as exc:
                if len(data) + 8 > self.spool.max_bytes:
                    raise IntakeError(413, f"this request spools as {len(data)} bytes, more than the whole spool "
                                           f"holds ({self.spool.max_bytes}); send smaller batches") from None
                raise Unavailable(429, str(exc), 2) from None
            except OSError as exc:
                raise Unavailable(503, f"cannot write the spool: {exc.strerror}", 5) from None
            with self._pending_lock:
                self._pending_by[grant.name] += len(data) + FRAME_OVERHEAD
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
                  else f"store unreachable: {self.drain.last_error or 'no reason given yet'}" if not store_ok
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
