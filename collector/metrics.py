"""The collector's Prometheus metrics, in a registry of its own (several collectors can share a
process in tests, and an embedding application keeps its own metrics apart)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_P = "kvtrace_collector_"


class CollectorMetrics:
    """Event counters are per tenant; a request refused whole is counted with its status code."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.received = Counter(_P + "events_received", "Event rows received in well-formed requests.",
                                ["tenant"], registry=r)
        self.accepted = Counter(_P + "events_accepted", "Event rows accepted and spooled.", ["tenant"], registry=r)
        self.quarantined = Counter(_P + "events_quarantined", "Event rows quarantined as invalid.",
                                   ["tenant"], registry=r)
        self.rejected = Counter(_P + "requests_rejected", "Requests refused whole (nothing stored).",
                                ["tenant", "code"], registry=r)
        self.spooled_bytes = Counter(_P + "spooled_bytes", "Bytes appended to the spool.", registry=r)
        self.stored = Counter(_P + "events_stored", "Events written to the store.", ["tenant"], registry=r)
        self.store_errors = Counter(_P + "store_errors", "Failed store inserts (retried).", registry=r)
        self.spool_bytes = Gauge(_P + "spool_pending_bytes", "Spooled bytes not yet in the store.", registry=r)
        self.lag = Gauge(_P + "drain_lag_seconds", "Age of the oldest spooled batch not yet stored.", registry=r)
        self.store_up = Gauge(_P + "store_up", "1 when the last store call succeeded.", registry=r)
        self.ingest_seconds = Histogram(
            _P + "ingest_seconds", "Time to validate and durably spool one request.", registry=r,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        self.verdicts = Counter(_P + "verdicts_written", "Live per-lookup verdict rows written.", registry=r)
        self.live_instances = Gauge(_P + "live_instances", "Engine instances reconstructed live here.", registry=r)
        self.live_queued = Gauge(_P + "live_queued_events",
                                 "Stored events waiting for live reconstruction's thread.", registry=r)
        self.live_released_early = Counter(
            _P + "live_events_released_early",
            "Events released from a full reorder buffer before their lateness window passed.", registry=r)
        self.live_skipped = Counter(
            _P + "live_events_skipped",
            "Events live reconstruction did not judge from its buffer, by reason: unknown_model, recipe_mismatch; "
            "rebuilt (judged already, read back from the store when its state was rebuilt); redelivered (a "
            "copy of an event its emitter had delivered before: delivery is at least once); late (older than "
            "what it had judged: still judged, out of order).", ["reason"], registry=r)
