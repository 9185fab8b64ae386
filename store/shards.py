"""Rows routed to shards the way the cluster's Distributed tables route them, inside one
ClickHouse: to try a shard count on one machine (the shard benchmark, the equivalence tests)
with the same tables and queries a cluster's nodes hold and run.

A Distributed table with N shards of weight 1 sends a row to shard `key % N`, the key being
the table's shard key (`cityHash64(instance)` for events and verdicts, see
`schema.clickhouse`); the hash is ClickHouse's own here too, never a reimplementation.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtrace.schema.clickhouse import SNAPSHOTS, TABLES
from kvtrace.schema.fields import field_specs
from kvtrace.store.client import Store


def route_to_shards(source: Store, shards: Sequence[Store]) -> list[int]:
    """Copy every row of the source's tables into the shard stores (same engine, initialized
    databases), each row to the shard its table's shard key names; returns the events each
    shard received."""
    n = len(shards)
    if n == 0:
        raise ValueError("route_to_shards needs at least one shard store")
    for shard in shards:
        if shard.db == source.db:
            raise ValueError(f"shard database {shard.db} is the source's own")
    counts = []
    for k, shard in enumerate(shards):
        for table in TABLES:
            if table is SNAPSHOTS:  # a whole store's analysis state is no shard's: each makes its own
                continue
            columns = ", ".join(f"`{s.name}`" for s in field_specs(table.struct))
            shard.command(
                f"INSERT INTO {shard.db}.{table.name} ({columns}) SELECT {columns} FROM {source.db}.{table.name}"
                f" WHERE ({table.shard_key}) % {n} = {k}"
            )
        counts.append(int(shard.scalar(f"SELECT count() FROM {shard.db}.events")))
    return counts
