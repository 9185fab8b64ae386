"""A store sharded by instance gives, shard by shard, the same per-lookup rows as one store.

The shards are databases of the session's embedded engine, filled by the cluster's own routing
rule (`cityHash64(instance) % N`, ClickHouse's hash), and each runs the same SQL a cluster
node runs on its own rows.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from lifecycle import lifecycle_streams
from polars.testing import assert_frame_equal
from test_paths_agree import BOOK, SORT, streaming

from kvtrace.analysis.shards import ShardRun, shard_events_table, sharded_results
from kvtrace.analysis.sql import clickhouse_results
from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.simulator import CacheSimulator, SimConfig, SimRequest
from kvtrace.instrumentation.sinks.memory import MemorySink
from kvtrace.schema import Event
from kvtrace.schema.recipes import BUILTIN
from kvtrace.store.client import Store
from kvtrace.store.shards import route_to_shards


@pytest.fixture
def shard_pool(chdb_path: object) -> Iterator[list[Store]]:
    """Four empty, initialized shard databases on the session's engine."""
    tag = uuid.uuid4().hex[:8]
    shards = [Store(f"chdb://{chdb_path}?database=s{k}_{tag}") for k in range(4)]
    for s in shards:
        s.init()
    yield shards
    for s in shards:
        s.command(f"DROP DATABASE IF EXISTS {s.db}")
        s.close()


def _clear(shards: list[Store]) -> None:
    for s in shards:  # the tests' sources hold events alone
        s.command(f"TRUNCATE TABLE {s.db}.events")


def fleet_events(instances: int = 5, requests: int = 60, seed: int = 7) -> list[Event]:
    """Several simulated instances (one emitter each) serving prompts that share prefixes, with a
    device small enough to evict and offload."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 50_000) for _ in range(rng.choice((256, 512, 1024)))] for _ in range(6)]
    out: list[Event] = []
    for i in range(instances):
        sink = MemorySink()
        emitter = BatchEmitter(sink, BatchConfig(schedule_delay_millis=10), register_atexit=False)
        config = SimConfig(recipe=BUILTIN["mamba-hybrid"], instance=f"sim-{i}", bytes_per_token=2048,
                           capacity_bytes=(24 << 20, 48 << 20, 0))
        sim = CacheSimulator(config, emitter)
        for n in range(requests // instances):
            prompt = [*rng.choice(prefixes), *(rng.randrange(1, 50_000) for _ in range(rng.randrange(8, 300)))]
            sim.serve(SimRequest(f"r{i}-{n}", prompt, tenant=rng.choice(("t0", "t1"))))
        assert emitter.shutdown()
        out.extend(sink.events)
    return out


def test_shards_of_a_fleet_give_the_rows_of_one_store(store: Store, shard_pool: list[Store]) -> None:
    events = fleet_events()
    store.insert_events(events)
    whole = clickhouse_results(store, BOOK).sort(SORT)
    assert whole.height == 60 and whole["instance"].n_unique() == 5
    assert_frame_equal(whole, streaming(events), check_exact=True)
    for n in (1, 2, 4):
        _clear(shard_pool)
        shards = shard_pool[:n]
        counts = route_to_shards(store, shards)
        assert sum(counts) == len(events)
        runs: list[ShardRun] = []
        assert_frame_equal(sharded_results(shards, BOOK, runs=runs), whole, check_exact=True)
        assert [r.lookups for r in runs] == [
            int(s.scalar(f"SELECT count() FROM {s.db}.events WHERE kind = 'lookup'")) for s in shards
        ]
        # Each instance's whole history sits on one shard.
        homes = [set(s.query_polars(f"SELECT DISTINCT instance FROM {s.db}.events")["instance"]) for s in shards]
        assert sum(len(h) for h in homes) == 5 and set().union(*homes) == set(whole["instance"])


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(events=lifecycle_streams())
def test_sharded_sql_agrees_on_random_lifecycles(store: Store, shard_pool: list[Store], events: list[Event]) -> None:
    """Two instances: with four shards they sit on two of them, two shards stay empty."""
    store.command(f"TRUNCATE TABLE {store.db}.events")
    store.insert_events(events)
    _clear(shard_pool)
    route_to_shards(store, shard_pool)
    assert_frame_equal(sharded_results(shard_pool, BOOK), streaming(events), check_exact=True)


def test_a_cluster_nodes_own_rows_are_read(store: Store) -> None:
    assert shard_events_table(store) == "events"
    store.command(f"CREATE TABLE {store.db}.events_local AS {store.db}.events")
    assert shard_events_table(store) == "events_local"


def test_no_shards_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one shard"):
        sharded_results([])


def test_a_store_named_like_a_table_alias_of_the_sql_gives_the_same_rows(store: Store, chdb_path: object) -> None:
    """ClickHouse reads `x.table` as `alias.column` when a statement has a table alias `x`: a
    store of that name still gets its rows (its scratch tables go elsewhere), and nothing of the
    scratch work is left behind."""
    events = fleet_events(instances=2, requests=12)
    store.insert_events(events)
    expected = clickhouse_results(store, BOOK)
    for name in ("x", "g"):
        odd = Store(f"chdb://{chdb_path}?database={name}")
        odd.init()
        try:
            odd.insert_events(events)
            assert_frame_equal(clickhouse_results(odd, BOOK).sort(SORT), expected.sort(SORT), check_exact=True)
            left = odd.query_polars("SELECT name FROM system.databases WHERE name LIKE 'kvtrace_scratch%'")
            assert left.is_empty()
        finally:
            odd.command(f"DROP DATABASE IF EXISTS {name}")
