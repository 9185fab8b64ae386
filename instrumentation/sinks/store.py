"""Writes batches straight into a kvtrace store (embedded chDB or a ClickHouse server)."""

from __future__ import annotations

import pyarrow as pa

from kvtrace.instrumentation.sinks.base import OK, ExportResult, ExportStatus
from kvtrace.schema.arrow import to_arrow
from kvtrace.schema.records import Rejection
from kvtrace.schema.validation import Problem, problems
from kvtrace.schema.wire import Batch
from kvtrace.store.client import Store


class StoreSink:
    """Direct-to-store export for single-process use (replays, the demo, notebooks).

    Events built in-process are trusted and go in as one Arrow insert. If a shim handed over
    a malformed event and the columnar conversion fails, the batch is re-checked row by row:
    valid events are stored and the others quarantined with the reason.
    """

    def __init__(self, store: Store, origin: str = "emitter", stats_interval_ns: int = 5 * 10**9) -> None:
        self.store = store
        self.origin = origin
        self.stats_interval_ns = stats_interval_ns
        self._stats_ns = 0

    @classmethod
    def open(cls, dsn: str, origin: str = "emitter") -> StoreSink:
        """A sink into the store at `dsn` (what KVTRACE_SINK=store builds)."""
        return cls(Store(dsn), origin)

    def export(self, batch: Batch) -> ExportResult:
        rejected = 0
        try:
            if batch.events:
                try:
                    table = to_arrow(batch.events)
                except Exception:  # noqa: BLE001 - a malformed event: sort the batch out row by row
                    table, rejected = self._split(batch)
                self.store.insert_arrow("events", table)
            # Counters are cumulative, so a row every few seconds loses nothing; one per batch
            # cost 13% of export throughput (docs/design/benchmark-history.md). A stats-only batch (the
            # final one at shutdown) is always written.
            stats = batch.stats
            if stats is not None and (not batch.events or stats.ts_ns - self._stats_ns >= self.stats_interval_ns):
                self.store.insert_stats([stats])
                self._stats_ns = stats.ts_ns
        except Exception as exc:  # noqa: BLE001 - store trouble is transient from here
            return ExportResult(ExportStatus.RETRY, detail=f"store insert failed: {exc}")
        return ExportResult(ExportStatus.SUCCESS, rejected=rejected) if rejected else OK

    def _split(self, batch: Batch) -> tuple[pa.Table, int]:
        good = []
        bad: list[Rejection] = []
        for i, event in enumerate(batch.events):
            try:
                found = problems(event)
                to_arrow([event])
            except Exception as exc:  # noqa: BLE001
                found = [Problem("", f"{type(exc).__name__}: {exc}")]
            if found:
                bad.append(
                    Rejection(
                        received_ns=batch.sent_ns,
                        origin=f"{self.origin}:{batch.source_id:016x}:{batch.batch_seq}",
                        row=i + 1,
                        field=found[0].field,
                        reason=found[0].reason,
                        raw=repr(event)[:65536],
                    )
                )
            else:
                good.append(event)
        self.store.insert_rejections(bad)
        return to_arrow(good), len(bad)

    def shutdown(self) -> None:
        return None
