"""One entry point to the three analysis paths, for the CLI, notebooks and the collector: the
per-lookup results by any path; one analysis of a store or of event files, with the engine + KV
store join and the canaries' probes judged; the events and results the cost, capacity and
report questions start from."""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

import polars as pl

from kvtrace.analysis.evaluate import Policy
from kvtrace.analysis.funnel import frame_results, results_frame
from kvtrace.analysis.incremental import HOUR_NS, RangeRun, range_results
from kvtrace.analysis.join import join_frame
from kvtrace.analysis.oracle import probe_verifications
from kvtrace.analysis.planning import as_parquet, event_frame
from kvtrace.analysis.reconstruct import Reconstructor
from kvtrace.analysis.shards import sharded_results
from kvtrace.analysis.sql import clickhouse_results, conform_results, duckdb_results
from kvtrace.schema.arrow import from_arrow
from kvtrace.schema.events import PROBE_PREFIX, Event
from kvtrace.schema.kinds import EventKind
from kvtrace.schema.recipes import Recipe, RecipeBook
from kvtrace.schema.verdicts import Verification

if TYPE_CHECKING:
    from kvtrace.store.client import Store


class AnalysisPath(StrEnum):
    """Where the per-lookup results are computed; all three give the same rows."""

    STREAM = "stream"  # replay in Python, memory bounded by live objects
    CLICKHOUSE = "clickhouse"  # inside the store, set-at-a-time
    DUCKDB = "duckdb"  # over Parquet exports, offline


def stream_results(store: Store, recipes: RecipeBook | Recipe, policy: Policy = Policy()) -> pl.DataFrame:
    """The streaming reconstructor fed from the store in stream order."""
    rec = Reconstructor(recipes, policy)
    out = []
    for table in store.iter_event_batches():
        out.extend(rec.feed_table(table))
    out.extend(rec.finish())
    return conform_results(results_frame(out))


def lookup_results(
    path: AnalysisPath,
    recipes: RecipeBook | Recipe,
    policy: Policy = Policy(),
    store: Store | None = None,
    parquet: Sequence[str | Path] = (),
) -> pl.DataFrame:
    """Per-lookup results by the chosen path, in lookup order."""
    if path is AnalysisPath.DUCKDB:
        if not parquet:
            raise ValueError("the duckdb path reads Parquet exports: give at least one file")
        frame = duckdb_results(parquet, recipes, policy)
    elif store is None:
        raise ValueError(f"the {path.value} path reads the store: give one")
    elif path is AnalysisPath.CLICKHOUSE:
        frame = clickhouse_results(store, recipes, policy)
    else:
        frame = stream_results(store, recipes, policy)
    return frame.sort(["ts_ns", "source_id", "seq"])


@dataclass(frozen=True, slots=True)
class Analysis:
    """What one analysis of a store or of event files found."""

    path: AnalysisPath
    results: pl.DataFrame  # one row per lookup (`LookupResult` columns), in lookup order
    joined: pl.DataFrame  # one row per lookup of an engine with a KV store beside it (`JoinedResult`)
    probes: int  # engine canaries' probe events read (from a store only)
    verifications: list[Verification]  # those probes judged against their re-runs' verdicts


def analyze(
    recipes: RecipeBook | Recipe,
    path: AnalysisPath = AnalysisPath.CLICKHOUSE,
    policy: Policy | None = None,
    store: Store | None = None,
    files: Sequence[str | Path] = (),
    shards: Sequence[Store] = (),
) -> Analysis:
    """Per-lookup results by the chosen path (the duckdb one reads event files: Parquet, JSONL
    or spool; the others the store, or with `shards` each shard's store, see
    `analysis.shards`), the engine + KV store picture per request, and the canaries' probes
    judged."""
    policy = Policy() if policy is None else policy
    probes: list[Event] = []
    if shards:
        if path is not AnalysisPath.CLICKHOUSE:
            raise ValueError(f"shards are analysed inside ClickHouse: the {path.value} path reads one store")
        results = sharded_results(shards, recipes, policy)
        probes = [p for shard in shards for p in stored_probes(shard)]
    elif path is AnalysisPath.DUCKDB:
        with tempfile.TemporaryDirectory(prefix="kvtrace-") as tmp:
            results = lookup_results(path, recipes, policy, parquet=as_parquet(files, tmp))
    else:
        results = lookup_results(path, recipes, policy, store=store)
        probes = stored_probes(store) if store is not None else []
    return Analysis(path, results, join_frame(results), len(probes), judge_probes(results, probes))


def analyze_range(
    recipes: RecipeBook | Recipe,
    store: Store,
    since_ns: int,
    until_ns: int,
    policy: Policy | None = None,
    every_ns: int = HOUR_NS,
) -> tuple[Analysis, RangeRun]:
    """The lookups made in [since_ns, until_ns), by the streaming path from the nearest
    snapshot before the range (see `analysis.incremental`), with the canaries' probes of the
    range judged."""
    policy = Policy() if policy is None else policy
    results, run = range_results(store, since_ns, until_ns, recipes, policy, every_ns=every_ns)
    probes = [p for p in stored_probes(store) if since_ns <= p.ts_ns < until_ns]
    analysis = Analysis(AnalysisPath.STREAM, results, join_frame(results), len(probes), judge_probes(results, probes))
    return analysis, run


def stored_probes(store: Store) -> list[Event]:
    """The engine canaries' probe events (few: a small sample of requests)."""
    return [e for table in store.iter_event_batches(f"kind = '{EventKind.PROBE.value}'") for e in from_arrow(table)]


def judge_probes(results: pl.DataFrame, probes: Iterable[Event]) -> list[Verification]:
    """Canary probes judged against their re-runs' verdicts among `results`."""
    probes = list(probes)
    if not probes:
        return []
    reruns = results.filter(pl.col("request_id").str.starts_with(PROBE_PREFIX))
    return probe_verifications(probes, frame_results(reruns))


def save_verdicts(store: Store, analysis: Analysis) -> int:
    """Store an analysis's per-lookup rows in the verdicts table (what dashboards and alerts
    read when no collector reconstructs live) and its judged probes in verifications; returns
    the verdicts stored."""
    stored = store.insert_verdicts(analysis.results)
    if analysis.verifications:
        store.insert_verifications(analysis.verifications)
    return stored


@dataclass(frozen=True, slots=True)
class Observations:
    """The events of one source and the per-lookup results reconstructed from them: what the
    cost, capacity and report questions start from."""

    events: pl.DataFrame  # every event, in stream order
    results: pl.DataFrame  # one row per lookup, in lookup order


def read_observations(
    recipes: RecipeBook | Recipe, store: Store | None = None, files: Sequence[str | Path] = (),
    policy: Policy = Policy(),
) -> Observations:
    """From event files (Parquet, JSONL or spool) when any are given, analyzed by DuckDB; else
    from the store, analyzed inside it."""
    if files:
        with tempfile.TemporaryDirectory(prefix="kvtrace-") as tmp:
            parquet = as_parquet(files, tmp)
            return Observations(event_frame(parquet=parquet),
                                lookup_results(AnalysisPath.DUCKDB, recipes, policy, parquet=parquet))
    return Observations(event_frame(store=store),
                        lookup_results(AnalysisPath.CLICKHOUSE, recipes, policy, store=store))
