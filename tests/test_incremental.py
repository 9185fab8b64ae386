"""Range analysis from snapshots gives the rows of a full run over the same lookups.

Random lifecycles are cut at random points; each range is analysed on its own, starting from
the snapshot the range before it left, and the ranges' rows together must equal one full
streaming run's.
"""

from __future__ import annotations

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lifecycle import lifecycle_streams
from polars.testing import assert_frame_equal
from test_paths_agree import BOOK, SORT, streaming
from test_shards import fleet_events

from kvtrace.analysis.evaluate import Policy
from kvtrace.analysis.incremental import range_results
from kvtrace.analysis.snapshot import fingerprint
from kvtrace.schema import Event
from kvtrace.store.client import Store

FAR = 2**62  # "now" for these tests: every range is settled


def _ranges(events: list[Event], cuts: list[float]) -> list[tuple[int, int]]:
    times = sorted({e.ts_ns for e in events})
    lo, hi = times[0], times[-1] + 1
    points = sorted({times[int(c * (len(times) - 1))] for c in cuts} - {lo})
    bounds = [lo, *points, hi]
    return list(zip(bounds, bounds[1:], strict=False))


def _by_ranges(store: Store, ranges: list[tuple[int, int]], policy: Policy = Policy()) -> tuple[pl.DataFrame, list]:
    frames, runs = [], []
    for since, until in ranges:
        frame, run = range_results(store, since, until, BOOK, policy, now_ns=FAR)
        frames.append(frame)
        runs.append(run)
    return pl.concat(frames).sort(SORT, maintain_order=True), runs


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(events=lifecycle_streams(), cuts=st.lists(st.floats(0, 1), max_size=4))
def test_ranges_from_snapshots_equal_one_full_run(store: Store, events: list[Event], cuts: list[float]) -> None:
    store.command(f"TRUNCATE TABLE {store.db}.events")
    store.command(f"TRUNCATE TABLE IF EXISTS {store.db}.snapshots")
    store.insert_events(events)
    ranges = _ranges(events, cuts)
    got, runs = _by_ranges(store, ranges)
    assert_frame_equal(got, streaming(events), check_exact=True)
    # Every range after the first starts from the snapshot the one before it left.
    assert all(run.started_at_ns > 0 and not run.note for run in runs[1:])


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(events=lifecycle_streams(), cuts=st.lists(st.floats(0, 1), min_size=1, max_size=3))
def test_fleet_view_ranges_from_snapshots_equal_one_full_run(store: Store, events: list[Event],
                                                             cuts: list[float]) -> None:
    store.command(f"TRUNCATE TABLE {store.db}.events")
    store.command(f"TRUNCATE TABLE IF EXISTS {store.db}.snapshots")
    store.insert_events(events)
    fleet = Policy(fleet=True)
    got, _ = _by_ranges(store, _ranges(events, cuts), fleet)
    assert_frame_equal(got, streaming(events, fleet), check_exact=True)


def test_a_late_range_reads_from_its_snapshot(store: Store) -> None:
    events = fleet_events(instances=3, requests=60)
    store.insert_events(events)
    times = sorted(e.ts_ns for e in events)
    lo, hi, cut = times[0], times[-1] + 1, times[int(len(times) * 0.9)]
    full = streaming(events)
    first, run1 = range_results(store, lo, cut, BOOK, now_ns=FAR)
    assert run1.started_at_ns == 0 and run1.snapshots_saved == 1
    last, run2 = range_results(store, cut, hi, BOOK, now_ns=FAR)
    assert_frame_equal(pl.concat([first, last]), full, check_exact=True)
    assert last.height > 0 and run2.started_at_ns > 0
    assert run2.events_read < 0.2 * len(events)  # the last tenth, not the history
    # Another policy's run cannot use those snapshots: it reads from the first event.
    other = Policy(shared_tenants=frozenset({"t1"}))
    assert fingerprint(BOOK, other) != fingerprint(BOOK, Policy())
    _, run3 = range_results(store, cut, hi, BOOK, other, now_ns=FAR)
    assert run3.started_at_ns == 0 and run3.events_read == len(events)


def test_unsettled_time_leaves_no_snapshot_and_a_bad_one_is_passed_over(store: Store) -> None:
    events = fleet_events(instances=2, requests=20)
    store.insert_events(events)
    times = sorted(e.ts_ns for e in events)
    lo, hi, cut = times[0], times[-1] + 1, times[len(times) // 2]
    _, run = range_results(store, lo, cut, BOOK, now_ns=cut)  # `cut` is not yet a minute old
    assert run.snapshots_saved == 0
    _, run = range_results(store, lo, cut, BOOK, now_ns=FAR)
    assert run.snapshots_saved == 1
    store.command(f"ALTER TABLE {store.db}.snapshots UPDATE state = 'not base64!' WHERE 1",
                  settings={"mutations_sync": 1})
    got, run = range_results(store, cut, hi, BOOK, now_ns=FAR, save=False)
    assert run.started_at_ns == 0 and "does not decode" in run.note
    assert_frame_equal(got, streaming(events).filter(pl.col("ts_ns") >= cut), check_exact=True)


def test_an_empty_range_is_refused(store: Store) -> None:
    with pytest.raises(ValueError, match="must be after"):
        range_results(store, 10, 10, BOOK)


def _stored_fleet(store: Store) -> tuple[list[Event], int, int]:
    """A small simulated fleet's events, stored; and the range that holds them all."""
    events = fleet_events(instances=2, requests=20)
    store.insert_events(events)
    times = sorted(e.ts_ns for e in events)
    return events, times[0], times[-1] + 1


def test_a_long_read_leaves_snapshots_along_the_way(store: Store) -> None:
    events, lo, hi = _stored_fleet(store)
    step = (hi - lo) // 8
    _, run = range_results(store, lo, hi, BOOK, every_ns=step, now_ns=FAR)
    assert run.snapshots_saved >= 7
    mid = lo + 5 * step + step // 2
    got, run = range_results(store, mid, hi, BOOK, save=False, now_ns=FAR)
    assert mid - step <= run.started_at_ns < mid  # the nearest one before the range
    assert_frame_equal(got, streaming(events).filter(pl.col("ts_ns") >= mid), check_exact=True)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(events=lifecycle_streams(), cuts=st.lists(st.floats(0, 1), max_size=4))
def test_live_verdicts_equal_the_streaming_rows(store: Store, events: list[Event], cuts: list[float]) -> None:
    """The collector's live reconstruction (one reconstructor per instance, fed the batches as
    they arrive, then stopped) writes the streaming path's rows."""
    assert_frame_equal(_live_rows(store, events, cuts, Policy()), streaming(events), check_exact=True)


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(events=lifecycle_streams(), cuts=st.lists(st.floats(0, 1), max_size=4))
def test_live_fleet_verdicts_equal_the_streaming_rows(store: Store, events: list[Event], cuts: list[float]) -> None:
    """With the fleet view the collector judges every instance in one order, against the others
    at each lookup: the streaming path's fleet rows."""
    fleet = Policy(fleet=True)
    assert_frame_equal(_live_rows(store, events, cuts, fleet), streaming(events, fleet), check_exact=True)


def _live_rows(store: Store, events: list[Event], cuts: list[float], policy: Policy, rebuild: bool = False,
               first: int = 0, own_process: bool = False) -> pl.DataFrame:
    """The verdicts a live reconstruction writes when fed `events[first:]` in stream order, in
    batches cut at `cuts` (fractions), then stopped."""
    from kvtrace.analysis.sql import conform_results
    from kvtrace.collector.live import LiveReconstruction
    from kvtrace.collector.metrics import CollectorMetrics

    store.command(f"TRUNCATE TABLE {store.db}.verdicts")
    ordered = sorted(events, key=lambda e: (e.ts_ns, e.source_id, e.seq))
    live = LiveReconstruction(store, BOOK, CollectorMetrics(), policy, lateness_ns=0, rebuild=rebuild,
                              own_process=own_process)
    bounds = sorted({first + int(c * (len(ordered) - first)) for c in cuts} | {first, len(ordered)})
    try:
        for a, b in zip(bounds, bounds[1:], strict=False):
            live.feed(ordered[a:b])
        live.tick(force=True)
    finally:
        live.close()
    return conform_results(store.query_polars(f"SELECT * FROM {store.db}.verdicts FINAL")).sort(SORT)


def test_a_collector_taking_over_a_fleet_rebuilds_every_instance_from_the_store(store: Store) -> None:
    """A collector that starts mid-stream with the fleet view reads the whole fleet's earlier
    events back before its first batch, so its verdicts are the full run's, regret included."""
    events = fleet_events(instances=3, requests=30)
    store.command(f"TRUNCATE TABLE {store.db}.events")
    store.insert_events(events)
    fleet = Policy(fleet=True)
    want = streaming(events, fleet)
    assert (want["routing_regret_tokens"] > 0).any() and want["instance"].n_unique() == 3
    got = _live_rows(store, events, [0.3, 0.6], fleet, rebuild=True, first=len(events) // 2)
    assert_frame_equal(got, want, check_exact=True)


def test_a_very_long_read_holds_a_bounded_number_of_snapshots(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtrace.analysis import incremental

    monkeypatch.setattr(incremental, "MAX_HELD", 4)
    events, lo, hi = _stored_fleet(store)
    step = (hi - lo) // 40
    _, run = range_results(store, lo, hi, BOOK, every_ns=step, now_ns=FAR)
    assert 2 <= run.snapshots_saved <= 5  # thinned as they came; the newest kept
    newest = int(store.scalar(f"SELECT max(ts_ns) FROM {store.db}.snapshots"))
    assert newest >= hi - 2 * step


def test_a_full_reorder_buffer_releases_its_oldest_early(store: Store) -> None:
    """A sender whose timestamps barely move (or a burst inside the lateness window) cannot fill
    the collector's memory: each instance holds at most `max_held` events, releases the oldest
    early and counts them; in-order events then give the same rows as ever."""
    from kvtrace.analysis.sql import conform_results
    from kvtrace.collector.live import LiveReconstruction
    from kvtrace.collector.metrics import CollectorMetrics

    events = sorted(fleet_events(instances=2, requests=20), key=lambda e: (e.ts_ns, e.source_id, e.seq))
    live = LiveReconstruction(store, BOOK, CollectorMetrics(), lateness_ns=10**18, rebuild=False, max_held=50)
    for a in range(0, len(events), 64):
        live.feed(events[a : a + 64])
        assert all(inst.buffer.count <= 50 for inst in live._instances.values())
    assert live.released_early >= len(events) - 2 * 50 and live.late_events == 0
    live.tick(force=True)
    got = conform_results(store.query_polars(f"SELECT * FROM {store.db}.verdicts FINAL")).sort(SORT)
    assert_frame_equal(got, streaming(events), check_exact=True)
