"""Live reconstruction on its own thread: chunks judged in the order they were stored, the
drain held back (not the chunks dropped) when the queue is full, a failing chunk logged and
passed over, a stop that judges what was queued first, and what the drain hands on read back
into the rows it stored."""

from __future__ import annotations

import threading
import time

import msgspec
import pyarrow as pa
from polars.testing import assert_frame_equal
from test_paths_agree import BOOK, SORT, streaming
from test_shards import fleet_events

from kvtrace.analysis.sql import conform_results
from kvtrace.collector.drain import StoredEvents
from kvtrace.collector.live import LiveReconstruction, LiveWorker
from kvtrace.collector.metrics import CollectorMetrics
from kvtrace.collector.spool import joined_columns, spool_columns
from kvtrace.schema.arrow import arrow_schema, from_arrow, to_arrow
from kvtrace.store.client import Store


def _verdicts(store: Store):
    return conform_results(store.query_polars(f"SELECT * FROM {store.db}.verdicts FINAL")).sort(SORT)


def test_chunks_are_judged_in_order_and_a_full_queue_holds_the_drain_back(store: Store) -> None:
    store.command(f"TRUNCATE TABLE {store.db}.verdicts")
    events = sorted(fleet_events(instances=2, requests=40), key=lambda e: (e.ts_ns, e.source_id, e.seq))
    live = LiveReconstruction(store, BOOK, CollectorMetrics(), lateness_ns=0, rebuild=False)
    worker = LiveWorker(live, max_queued=64)
    chunks = [to_arrow(events[a:a + 50]) for a in range(0, len(events), 50)]
    peak = 0
    with live._lock:  # the thread cannot judge yet: the queue fills to its bound, then the drain waits
        worker.start()
        feeder = threading.Thread(target=lambda: [worker.stored(c) for c in chunks])
        feeder.start()
        time.sleep(0.5)
        peak = worker.queued
        assert feeder.is_alive() and peak <= 64 + 50  # one chunk past the bound at most, then it waits
    feeder.join(30)
    assert not feeder.is_alive()
    assert worker.stop(30) and worker.queued == 0
    live.tick(force=True)
    assert_frame_equal(_verdicts(store), streaming(events), check_exact=True)


def test_a_chunk_that_fails_is_logged_and_the_next_ones_are_judged(store: Store, caplog) -> None:
    store.command(f"TRUNCATE TABLE {store.db}.verdicts")
    events = sorted(fleet_events(instances=1, requests=20), key=lambda e: (e.ts_ns, e.source_id, e.seq))
    live = LiveReconstruction(store, BOOK, CollectorMetrics(), lateness_ns=0, rebuild=False)
    worker = LiveWorker(live)
    worker.start()
    worker.stored(pa.table({"ts_ns": [1]}))  # not the stored schema: the reconstruction raises
    worker.stored(to_arrow(events))
    assert worker.stop(30)
    assert "live reconstruction failed on a chunk" in caplog.text
    live.tick(force=True)
    assert_frame_equal(_verdicts(store), streaming(events), check_exact=True)


def test_what_the_drain_stored_is_read_on_the_live_thread_into_the_rows_it_stored() -> None:
    """The drain hands on a chunk as it stored it: the Arrow records' streams passed through as
    one (still LZ4-compressed), the rows' JSON lines, or tables where a stream could not pass.
    Read back, each gives the events that were sent, the columns first, then the rows."""
    events = sorted(fleet_events(instances=2, requests=30), key=lambda e: (e.ts_ns, e.source_id, e.seq))
    a, b, c = events[:100], events[100:150], events[150:]
    stream = joined_columns([spool_columns(to_arrow(a)), spool_columns(to_arrow(b))], arrow_schema())
    assert stream is not None
    lines = b"".join(msgspec.json.encode(e) + b"\n" for e in c)
    assert from_arrow(StoredEvents(len(events), lines, stream).table()) == events
    assert from_arrow(StoredEvents(len(events), lines, None, (to_arrow(a), to_arrow(b))).table()) == events
    assert from_arrow(StoredEvents(len(a) + len(b), b"", stream).table()) == a + b
    assert StoredEvents(0).table().num_rows == 0
