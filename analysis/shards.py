"""Reconstruction shard by shard: a lookup's verdict needs only its own instance's history.

Every fact the analysis joins is scoped to one instance: an object is (instance, group, block),
a bulk invalidation names its instance, an adopt pairs with its lookup by (instance, request).
A store sharded by instance, as the cluster DDL's Distributed table shards it
(`cityHash64(instance)`, see `schema.clickhouse.EVENTS`), therefore holds each instance's whole
history on one shard, and the per-lookup SQL runs on each shard's own rows (`events_local` on a
cluster node) with no row crossing between shards. Rows through the Distributed table would be
shuffled to one node first; per shard, each node does 1/N of the work at the same time as the
others. The results are small (one row per lookup) and are concatenated in stream order; the
engine + KV store join (`analysis.join`) works on them, so a store instance on another shard
than its engine costs nothing extra.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import polars as pl

from kvtrace.analysis.evaluate import Policy
from kvtrace.analysis.sql import clickhouse_results
from kvtrace.schema.clickhouse import EVENTS
from kvtrace.schema.recipes import Recipe, RecipeBook

if TYPE_CHECKING:
    from kvtrace.store.client import Store

STREAM_ORDER = ["ts_ns", "source_id", "seq"]


def shard_events_table(store: Store) -> str:
    """The table holding this shard's own rows: `events_local` where the store is a cluster
    node (its `events` is then the Distributed table over every shard), else `events`."""
    local = f"{EVENTS.name}_local"
    return local if store.has_table(local) else EVENTS.name


@dataclass(frozen=True, slots=True)
class ShardRun:
    """One shard's part of a sharded analysis: what a cluster's slowest node decides."""

    shard: str  # the shard's store, as its DSN prints (no password)
    table: str
    lookups: int
    seconds: float


def sharded_results(
    shards: Sequence[Store],
    recipes: RecipeBook | Recipe | None = None,
    policy: Policy = Policy(),
    runs: list[ShardRun] | None = None,
) -> pl.DataFrame:
    """Per-lookup results of every shard, each computed inside its own store, in stream order.

    Servers run their shards at the same time (one thread each, waiting on its node); embedded
    shards share this process's one engine, so they run one after another. `runs`, when given,
    receives each shard's time and lookups."""
    if not shards:
        raise ValueError("a sharded analysis needs at least one shard store")
    book = RecipeBook.of(recipes)

    def one(store: Store) -> tuple[pl.DataFrame, ShardRun]:
        table = shard_events_table(store)
        started = time.perf_counter()
        frame = clickhouse_results(store, book, policy, table=table)
        return frame, ShardRun(str(store.dsn), table, frame.height, time.perf_counter() - started)

    if all(not s.dsn.embedded for s in shards) and len(shards) > 1:
        with ThreadPoolExecutor(max_workers=len(shards), thread_name_prefix="kvtrace-shard") as pool:
            done = list(pool.map(one, shards))
    else:
        done = [one(s) for s in shards]
    if runs is not None:
        runs.extend(run for _, run in done)
    return pl.concat([frame for frame, _ in done], how="vertical").sort(STREAM_ORDER, maintain_order=True)
