"""Per-statement timings of the SQL paths: every statement is named, its rows counted, and
asking for them changes no result (the benchmark's table rests on this)."""

from __future__ import annotations

from pathlib import Path

from lifecycle import RECIPES, first_stream
from polars.testing import assert_frame_equal

from kvtrace.analysis.sql import StatementTiming, clickhouse_results, duckdb_results, placed_events
from kvtrace.schema import EventKind
from kvtrace.schema.recipes import RecipeBook
from kvtrace.store.client import Store
from kvtrace.store.export import export_events

BOOK = RecipeBook(RECIPES)
SORT = ["ts_ns", "source_id", "seq"]


def test_timings_name_every_statement_and_change_no_result(store: Store, tmp_path: Path) -> None:
    events = first_stream(lambda evs: sum(e.kind is EventKind.LOOKUP for e in evs) >= 3)
    store.insert_events(events)
    parquet = tmp_path / "events.parquet"
    export_events(store, parquet)
    lookups = sum(e.kind is EventKind.LOOKUP for e in events)
    # ClickHouse numbers the events where they lie when each day is one merged part, each
    # statement reading them so (no `ev` table); sorted (`in_place=False`), they are written.
    placed = placed_events(store).layout.merged
    runs = ((lambda **kw: clickhouse_results(store, BOOK, **kw), not placed),
            (lambda **kw: clickhouse_results(store, BOOK, in_place=False, **kw), True),
            (lambda **kw: duckdb_results(parquet, BOOK, **kw), True))
    for run, written in runs:
        steps: list[StatementTiming] = []
        timed = run(timings=steps).sort(SORT)
        assert_frame_equal(timed, run().sort(SORT), check_exact=True)
        names = [s.name for s in steps]
        assert len(names) == len(set(names))
        assert names[:2] == ["it", "ev" if written else "rq"] and names[-1] == "(final)"  # instances numbered first
        by_name = {s.name: s for s in steps}
        assert by_name["lk"].rows == lookups
        assert by_name["(final)"].rows == len(timed) == lookups
        if written:
            assert by_name["ev"].rows == len(events)  # a run of blocks is one row (split where blocks are read)
        assert all(s.seconds >= 0 for s in steps)
