"""One entry point to the three analysis paths, for the CLI, notebooks and the collector."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

import polars as pl

from kvtrace.analysis.evaluate import Policy
from kvtrace.analysis.funnel import results_frame
from kvtrace.analysis.reconstruct import Reconstructor
from kvtrace.analysis.sql import clickhouse_results, conform_results, duckdb_results
from kvtrace.schema.arrow import from_arrow
from kvtrace.schema.recipes import Recipe, RecipeBook

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
        for event in from_arrow(table):
            out.extend(rec.feed(event))
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
