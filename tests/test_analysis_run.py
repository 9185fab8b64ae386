"""The analysis a notebook calls (what `kvtrace analyze`, `costs` and `report` print): one call
per source, typed results, against the embedded store and its exports."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from kvtrace.analysis.join import STORE_SUFFIX, join_totals
from kvtrace.analysis.run import AnalysisPath, analyze, read_observations, save_verdicts
from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.simulator import AdoptPolicy, CacheSimulator, Fault, SimConfig, SimRequest
from kvtrace.instrumentation.sinks.store import StoreSink
from kvtrace.schema.events import PROBE_PREFIX, Event
from kvtrace.schema.kinds import EventKind
from kvtrace.schema.recipes import BUILTIN, RecipeBook
from kvtrace.schema.verdicts import Agreement
from kvtrace.store.client import Store
from kvtrace.store.export import ExportFormat, export_events

PREFIX = list(range(1, 1025))


def simulate(store: Store, instance: str, requests: list[SimRequest], skip_checkpoint_of: str = "",
             adopt: AdoptPolicy = AdoptPolicy.COMPLETE) -> CacheSimulator:
    emitter = BatchEmitter(StoreSink(store), BatchConfig(schedule_delay_millis=10), register_atexit=False)
    sim = CacheSimulator(SimConfig(recipe=BUILTIN["mamba-hybrid"], model="jamba", instance=instance, adopt=adopt),
                         emitter)
    for r in requests:
        if r.request_id == skip_checkpoint_of:
            sim.inject(Fault.SKIP_CHECKPOINT, SimRequest(r.request_id, PREFIX), len(PREFIX))
        sim.serve(r)
    assert emitter.shutdown()
    return sim


def test_every_path_gives_the_same_results_and_files_need_no_store(store: Store, tmp_path: Path) -> None:
    simulate(store, "i", [SimRequest("a", [*PREFIX, 7, 7], tenant="t"), SimRequest("b", [*PREFIX, 8, 8], tenant="t")],
             skip_checkpoint_of="b")
    book = RecipeBook.parse(["jamba=mamba-hybrid"])
    export = tmp_path / "events.parquet"
    export_events(store, export)
    frames = [analyze(book, AnalysisPath(p), store=store).results for p in ("clickhouse", "stream")]
    files = analyze(book, AnalysisPath.DUCKDB, files=[export])
    for frame in frames:
        assert_frame_equal(frame, files.results, check_exact=True)
    assert files.results["reason"].to_list() == ["", "no_checkpoint_at_boundary"]
    assert files.results["recoverable_hit_tokens"].to_list()[1] == 960
    assert (files.probes, files.verifications, files.joined.height) == (0, [], 0)
    with pytest.raises(ValueError, match="Parquet"):
        analyze(book, AnalysisPath.DUCKDB)
    with pytest.raises(ValueError, match="reads the store"):
        analyze(book, AnalysisPath.CLICKHOUSE)


def test_a_canary_probe_is_judged_and_stored_with_the_verdicts(store: Store) -> None:
    rerun = f"{PROBE_PREFIX}1"
    sim = simulate(store, "i", [SimRequest("user-1", [*PREFIX, 5]), SimRequest(rerun, [*PREFIX, 5])])
    store.insert_events([Event(kind=EventKind.PROBE, ts_ns=sim.now_ns + 1, source_id=99, seq=0, instance="i",
                               request_id=rerun, probe_of="user-1", prompt_tokens=1025, reported_hit_tokens=1024,
                               probe_positions=8, probe_max_abs_diff=2.0, noise_floor=0.0)])
    analysis = analyze(RecipeBook.parse(["mamba-hybrid"]), store=store)
    assert analysis.results.height == 2 and analysis.probes == 1
    (row,) = analysis.verifications
    assert row.request_id == rerun and row.agreement is Agreement.DIVERGED and row.max_abs_diff == 2.0
    assert row.adopted_tokens > 0

    assert save_verdicts(store, analysis) == 2
    stored = store.query_polars(f"SELECT request_id FROM {store.db}.verdicts ORDER BY ts_ns")
    assert stored["request_id"].to_list() == ["user-1", rerun]
    agreements = store.query_polars(f"SELECT request_id, agreement FROM {store.db}.verifications").rows()
    assert agreements == [(rerun, Agreement.DIVERGED.value)]


def test_an_engine_and_its_kv_store_are_joined_and_totalled(store: Store) -> None:
    requests = [SimRequest(f"r{i}", [*PREFIX, i]) for i in range(4)]
    # The engine lost the checkpoint r2 needs and reuses its prefix anyway (alone: unsafe); the store
    # behind it holds the whole prefix, so the joined picture justifies the reuse.
    simulate(store, "n1", requests, skip_checkpoint_of="r2", adopt=AdoptPolicy.LOGICAL)
    simulate(store, f"n1{STORE_SUFFIX}", requests)
    analysis = analyze(RecipeBook.parse(["mamba-hybrid"]), store=store)
    joined = analysis.joined
    assert joined.height == 4 and set(joined["store_instance"]) == {f"n1{STORE_SUFFIX}"}
    engine = analysis.results.filter(pl.col("instance") == "n1")
    assert engine["unsafe_reuse"].to_list() == [False, False, True, True]  # r3 finds the same state
    assert joined["unsafe_reuse"].to_list() == [False] * 4

    (totals,) = join_totals(analysis.results, joined).rows(named=True)
    assert totals["engine_instance"] == "n1" and totals["lookups"] == 4
    assert totals["logical"] == joined["logical_hit_tokens"].sum() > 0
    assert totals["recoverable"] == joined["recoverable_hit_tokens"].sum()
    assert totals["adopted"] == joined["adopted_tokens"].sum() == engine["adopted_tokens"].sum()
    assert totals["unsafe"] == joined["unsafe_reuse"].sum()
    assert totals["missed"] == joined["missed_reuse"].sum()
    assert (totals["unsafe"], totals["unsafe_engine_alone"]) == (0, 2)
    assert join_totals(analysis.results, analysis.joined.clear()).height == 0


def test_observations_from_the_store_and_from_its_export_agree(store: Store, tmp_path: Path) -> None:
    simulate(store, "i", [SimRequest("a", [*PREFIX, 7]), SimRequest("b", [*PREFIX, 8])])
    book = RecipeBook.parse(["jamba=mamba-hybrid"])
    export_events(store, tmp_path / "e.parquet")
    export_events(store, tmp_path / "e.jsonl", ExportFormat.JSONL)
    stored = read_observations(book, store=store)
    assert stored.events.height == store.count_events() > 0
    assert stored.results["request_id"].to_list() == ["a", "b"]
    for name in ("e.parquet", "e.jsonl"):
        files = read_observations(book, files=[tmp_path / name])
        assert_frame_equal(files.events, stored.events, check_exact=True)
        assert_frame_equal(files.results, stored.results, check_exact=True)
