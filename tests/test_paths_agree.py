"""The streaming reconstructor, ClickHouse SQL and DuckDB SQL give identical per-lookup results.

Events go through the real store (embedded ClickHouse) and a real Parquet export, so the
test also covers de-duplication, ordering and type round trips on the way to each path.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from lifecycle import DENSE, RECIPES, first_stream, lifecycle_streams
from msgspec.structs import replace
from polars.testing import assert_frame_equal

from kvtrace.analysis import sql
from kvtrace.analysis.evaluate import Policy
from kvtrace.analysis.funnel import results_frame
from kvtrace.analysis.reconstruct import Reconstructor
from kvtrace.analysis.sql import (
    Layout,
    clickhouse_results,
    conform_results,
    duckdb_results,
    placed_events,
    placed_parts,
)
from kvtrace.schema import ComponentKind, Event, EventKind, Tier
from kvtrace.schema.recipes import RecipeBook, UnknownModel
from kvtrace.schema.verdicts import GapReason
from kvtrace.store.client import Store
from kvtrace.store.export import export_events

SORT = ["ts_ns", "source_id", "seq"]
BOOK = RecipeBook(RECIPES)  # each lifecycle model's own recipe


def streaming(events: list[Event], policy: Policy = Policy(), recipes: RecipeBook | None = BOOK) -> pl.DataFrame:
    ordered = sorted(events, key=lambda e: (e.ts_ns, e.source_id, e.seq))
    return conform_results(results_frame(Reconstructor(recipes, policy).run(ordered))).sort(SORT)


def three_paths(store: Store, folder: Path, events: list[Event], policy: Policy = Policy(),
                recipes: RecipeBook | None = BOOK) -> list[pl.DataFrame]:
    store.command(f"TRUNCATE TABLE {store.db}.events")
    store.insert_events(events)
    parquet = folder / "events.parquet"
    export_events(store, parquet)
    frames = [
        streaming(events, policy, recipes),
        clickhouse_results(store, recipes, policy).sort(SORT),
        duckdb_results(parquet, recipes, policy).sort(SORT),
    ]
    # Merged, every partition is one part: ClickHouse numbers the events where they lie, unsorted.
    store.command(f"OPTIMIZE TABLE {store.db}.events FINAL")
    layout = placed_events(store).layout
    assert layout.merged
    return [*frames, clickhouse_results(store, recipes, policy).sort(SORT)]


def assert_same(frames: list[pl.DataFrame]) -> None:
    py, *others = frames
    for other in others:
        assert_frame_equal(other, py, check_exact=True)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(events=lifecycle_streams())
def test_three_paths_agree_on_random_lifecycles(store: Store, tmp_path: Path, events: list[Event]) -> None:
    assert_same(three_paths(store, tmp_path, events))


FLEET = Policy(fleet=True)


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(events=lifecycle_streams())
def test_three_paths_agree_on_the_fleet_view(store: Store, tmp_path: Path, events: list[Event]) -> None:
    """Lookups on one instance judged on the other too (the streams put blocks on both)."""
    assert_same(three_paths(store, tmp_path, events, FLEET))


def test_the_fleet_view_agrees_where_another_instance_held_more(store: Store, tmp_path: Path) -> None:
    def elsewhere(evs: list[Event]) -> bool:
        rows = streaming(evs, FLEET)
        return bool(rows.height and (rows["routing_regret_tokens"] > 0).any()
                    and (rows["fleet_reason"] != "").any())

    events = first_stream(elsewhere, max_ops=40)
    frames = three_paths(store, tmp_path, events, FLEET)
    assert_same(frames)
    assert (frames[0]["best_instance"] != frames[0]["instance"]).any()


def test_the_fleet_view_judges_only_instances_that_still_hold_a_block(store: Store, tmp_path: Path) -> None:
    """i1 wrote the prompt's blocks and evicted them all before the lookup on i0: it can win
    nothing, and the DuckDB path no longer judges it (the streaming path never did). i2 evicted
    its device copies but kept host copies of both: it still holds them and is the best instance."""
    t0 = 1_750_000_000 * 10**9
    keys = [101, 102]
    seq = iter(range(1, 100))

    def ev(kind: EventKind, instance: str, **kw: object) -> Event:
        n = next(seq)
        return Event(kind=kind, ts_ns=t0 + n, seq=n, source_id=ord(instance[-1]), engine="vllm",
                     instance=instance, model="dense", **kw)  # type: ignore[arg-type]

    blocks = dict(component=ComponentKind.FULL_ATTENTION, block_key=keys[0], more_keys=keys[1:])
    events = [
        ev(EventKind.COMMIT, "i1", tier=Tier.DEVICE, nbytes=64, **blocks),
        ev(EventKind.EVICT, "i1", tier=Tier.DEVICE, **blocks),
        ev(EventKind.COMMIT, "i2", tier=Tier.DEVICE, nbytes=64, **blocks),
        ev(EventKind.OFFLOAD, "i2", src_tier=Tier.DEVICE, dst_tier=Tier.HOST, nbytes=64, **blocks),
        ev(EventKind.EVICT, "i2", tier=Tier.DEVICE, **blocks),
        ev(EventKind.LOOKUP, "i0", request_id="r", prompt_tokens=2 * DENSE.groups[0].block_size + 1,
           group_block_keys=[keys]),
    ]
    frames = three_paths(store, tmp_path, events, FLEET)
    assert_same(frames)
    row = frames[0].row(0, named=True)
    assert row["best_instance"] == "i2"
    assert row["recoverable_anywhere_tokens"] == 2 * DENSE.groups[0].block_size
    judged: dict[str, int] = {}
    for name, run in (("clickhouse", lambda ts: clickhouse_results(store, BOOK, FLEET, timings=ts)),
                      ("duckdb", lambda ts: duckdb_results(tmp_path / "events.parquet", BOOK, FLEET, timings=ts))):
        timings: list[sql.StatementTiming] = []
        run(timings)
        judged[name] = {t.name: t.rows for t in timings}["fc"]
    # DuckDB judges (the lookup, i2) alone: i1 holds nothing. ClickHouse judges every instance
    # that wrote a block (finding the holders cost it more than judging the others).
    assert judged == {"clickhouse": 2, "duckdb": 1}


def test_shared_tenant_policy_agrees(store: Store, tmp_path: Path) -> None:
    events = first_stream(
        lambda evs: sum(e.kind is EventKind.LOOKUP for e in evs) >= 2 and len({e.tenant for e in evs}) >= 2)
    assert_same(three_paths(store, tmp_path, events, Policy(shared_tenants=frozenset({"t2"}), keep_one_token=False)))


def test_unknown_model_is_named_by_every_path(store: Store, tmp_path: Path) -> None:
    lookup = Event(kind=EventKind.LOOKUP, ts_ns=1_750_000_000 * 10**9, source_id=1, seq=1, instance="i0",
                   model="mystery", request_id="r", prompt_tokens=8)
    store.insert_events([lookup])
    with pytest.raises(UnknownModel, match="mystery"):
        list(Reconstructor(BOOK).run([lookup]))
    with pytest.raises(UnknownModel, match="mystery"):
        clickhouse_results(store, BOOK)
    parquet = tmp_path / "e.parquet"
    export_events(store, parquet)
    with pytest.raises(UnknownModel, match="mystery"):
        duckdb_results(parquet, BOOK)


def test_scratch_tables_are_dropped(store: Store, tmp_path: Path) -> None:
    before = set(store.query_polars(f"SELECT name FROM system.tables WHERE database = '{store.db}'")["name"])
    store.insert_events([])
    clickhouse_results(store, BOOK)
    after = set(store.query_polars(f"SELECT name FROM system.tables WHERE database = '{store.db}'")["name"])
    assert after == before


def test_every_event_stored_twice_is_judged_once(store: Store) -> None:
    """A sender's retry can store a batch twice; reads de-duplicate (`FINAL`, or `LIMIT 1 BY` the
    sort key where the SQL reads the table as stored): the rows are those of the events once."""
    events = first_stream(lambda evs: sum(e.kind is EventKind.LOOKUP for e in evs) >= 3
                          and any(e.kind is EventKind.ADOPT for e in evs), max_ops=30)
    store.command(f"TRUNCATE TABLE {store.db}.events")
    store.insert_events(events)
    half = len(events) // 2  # other blocks than the first insert's, so the store keeps both copies
    store.insert_events(events[:half])
    store.insert_events(events[half:])
    assert store.scalar(f"SELECT count() FROM {store.db}.events") == 2 * len(events)
    assert placed_events(store).layout == Layout()  # unmerged parts: numbered by sorting, FINAL merging the copies
    assert_frame_equal(clickhouse_results(store, BOOK).sort(SORT), streaming(events), check_exact=True)
    store.command(f"OPTIMIZE TABLE {store.db}.events FINAL")  # the merge keeps one copy of each
    assert placed_events(store).layout.parts
    assert_frame_equal(clickhouse_results(store, BOOK).sort(SORT), streaming(events), check_exact=True)


def test_which_parts_number_events_where_they_lie() -> None:
    """A partition that is one merged part (level above 0) is numbered in place, each part
    above the numbers of the days before it; another day (several parts, or one never merged)
    is numbered by sorting, in a span of its own; with no merged day, all of it is."""
    merged = [("20250616", "20250616_3_9_2", 2, 40), ("20250615", "20250615_1_2_1", 1, 100)]
    assert placed_parts(merged) == Layout((("20250615_1_2_1", 0), ("20250616_3_9_2", 100)))
    two = [("20250617", "20250617_10_10_0", 0, 5), ("20250617", "20250617_11_11_0", 0, 7)]  # two parts in a day
    span = 2 * 12 + (1 << 20)
    assert placed_parts([*merged, *two]) == Layout((("20250615_1_2_1", 0), ("20250616_3_9_2", 100)),
                                                   (("20250617", 140),), span)
    fresh = ("20250614", "20250614_1_1_0", 0, 7)  # never merged: may hold copies
    assert placed_parts([fresh, *merged]) == Layout((("20250615_1_2_1", 2 * 7 + (1 << 20)),
                                                     ("20250616_3_9_2", 2 * 7 + (1 << 20) + 100)),
                                                    (("20250614", 0),), 2 * 7 + (1 << 20))
    assert placed_parts([fresh, *two]) == Layout()
    assert placed_parts([]) == Layout()
    assert placed_parts([("20250615", "20250615_1_9_3", 3, 1 << 40)]) == Layout()  # past the numbers' room


def _three_days(events: list[Event]) -> list[Event]:
    day, third = 86_400 * 10**9, len(events) // 3
    return [replace(e, ts_ns=e.ts_ns + day * min(i // third, 2)) for i, e in enumerate(events)]


def test_events_of_several_days_and_instances_numbered_in_place_agree(store: Store) -> None:
    """Three days (three partitions) of two instances' events: each instance's events in a
    later day number above its earlier ones, merged or not. Then the last day is stored twice
    more (fresh parts, copies): it is numbered by sorting, the others in place."""
    events = _three_days(first_stream(lambda evs: len({e.instance for e in evs if e.kind is EventKind.LOOKUP}) == 2
                                      and sum(e.kind is EventKind.LOOKUP for e in evs) >= 4, max_ops=30))
    store.command(f"TRUNCATE TABLE {store.db}.events")
    store.insert_events(events)
    store.command(f"OPTIMIZE TABLE {store.db}.events FINAL")
    layout = placed_events(store).layout
    assert len(layout.parts) == 3 and not layout.days
    assert layout.parts[0][1] == 0 < layout.parts[1][1] < layout.parts[2][1]
    assert_frame_equal(clickhouse_results(store, BOOK).sort(SORT), streaming(events), check_exact=True)
    last = [e for e in events if e.ts_ns >= events[-1].ts_ns - 10**9]
    with merges_stopped(store):
        store.insert_events(last[: len(last) // 2])
        store.insert_events(last[len(last) // 2:])
        layout = placed_events(store).layout
        assert len(layout.parts) == 2 and len(layout.days) == 1
        assert_frame_equal(clickhouse_results(store, BOOK).sort(SORT), streaming(events), check_exact=True)


@contextmanager
def merges_stopped(store: Store) -> Iterator[None]:
    """No background merge while a test holds unmerged parts (one would make them a merged one)."""
    store.command(f"SYSTEM STOP MERGES {store.db}.events")
    try:
        yield
    finally:
        store.command(f"SYSTEM START MERGES {store.db}.events")


def test_parts_changed_during_the_run_fall_back_to_sorting(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts listed before a merge or an insert no longer describe what the run reads: the
    numbering refuses a row of a part it was not given, or past its day's span, and the run
    starts again numbering by sorting, with the same rows. Listed with every day merged, the
    events are read where they lie by each statement (no `ev` table): the first of them fails."""
    events = _three_days(first_stream(lambda evs: sum(e.kind is EventKind.LOOKUP for e in evs) >= 3, max_ops=30))
    store.command(f"TRUNCATE TABLE {store.db}.events")
    store.insert_events(events)
    store.command(f"OPTIMIZE TABLE {store.db}.events FINAL")
    before = placed_events(store).layout  # every day one merged part
    assert before.merged
    with merges_stopped(store):
        store.insert_events(events[-3:])  # the last day: two parts
        listed = placed_events(store).layout
        assert listed.parts and listed.days
        stale = [Layout((("20250615_1_1_0", 0), *listed.parts[1:]), listed.days, listed.span),  # a part since merged
                 Layout(listed.parts, listed.days, 1),  # more rows in the day than its span
                 before]  # listed before the insert: the last day one merged part
        for layout in stale:
            monkeypatch.setattr(sql, "placed_parts", lambda rows, layout=layout: layout)
            timings: list[sql.StatementTiming] = []
            assert_frame_equal(clickhouse_results(store, BOOK, timings=timings).sort(SORT), streaming(events),
                               check_exact=True)
            assert [s.name for s in timings][:4] == ["it", "(parts moved)", "it", "ev"]


def test_duckdb_reads_exports_from_before_runs_existed(store: Store, tmp_path: Path) -> None:
    """A schema-v1 Parquet export has no more_keys column; it still analyzes, block by block."""
    import pyarrow.parquet as pq
    events = first_stream(lambda evs: sum(e.kind is EventKind.LOOKUP for e in evs) >= 2
                          and not any(e.more_keys for e in evs), max_ops=20)
    store.insert_events(events)
    new = tmp_path / "v2.parquet"
    export_events(store, new)
    old = tmp_path / "v1.parquet"
    pq.write_table(pq.read_table(new).drop(["more_keys"]), old)
    assert_frame_equal(duckdb_results(old, BOOK).sort(SORT), duckdb_results(new, BOOK).sort(SORT))


def test_a_kv_store_may_serve_the_whole_prompt_in_every_path(store: Store, tmp_path: Path) -> None:
    """The one-token rule is the computing engine's: a KV store (LMCache) asked about 32 tokens it
    holds reports 32, an engine 16 (it must compute the last token, and hits whole blocks)."""
    bs = DENSE.groups[0].block_size
    events = _two_blocks_each("dense", 2 * bs)
    frames = three_paths(store, tmp_path, events)
    assert_same(frames)
    logical = dict(zip(frames[0]["instance"].to_list(), frames[0]["logical_hit_tokens"].to_list(), strict=True))
    assert logical == {"lmcache": 2 * bs, "vllm": bs}


def test_an_engine_qualified_recipe_wins_in_every_path(store: Store, tmp_path: Path) -> None:
    """vLLM and LMCache report the same model but cache it in different units: `lmcache:dense`
    gives LMCache's lookups their own recipe (4-token chunks here), in all three paths."""
    from kvtrace.schema.recipes import GroupSpec, Recipe

    chunks = Recipe(name="chunks",
                    groups=(GroupSpec(group_id=0, component=ComponentKind.FULL_ATTENTION, block_size=4),))
    recipes = RecipeBook({**RECIPES, "lmcache:dense": chunks})
    frames = three_paths(store, tmp_path, _two_blocks_each("dense", 8), recipes=recipes)
    assert_same(frames)
    logical = dict(zip(frames[0]["instance"].to_list(), frames[0]["logical_hit_tokens"].to_list(), strict=True))
    assert logical == {"lmcache": 8, "vllm": 4}  # two 4-token chunks; two 2-token blocks


def _two_blocks_each(model: str, prompt_tokens: int) -> list[Event]:
    """An LMCache and a vLLM instance, each holding two blocks of one prompt and looking it up."""
    t0 = 1_750_000_000 * 10**9
    events = []
    for engine, src in (("lmcache", 7), ("vllm", 8)):
        keys = [src * 100 + 1, src * 100 + 2]
        events.append(Event(kind=EventKind.COMMIT, ts_ns=t0, source_id=src, seq=0, engine=engine, instance=engine,
                            model=model, component=ComponentKind.FULL_ATTENTION, block_key=keys[0],
                            more_keys=keys[1:], tier=Tier.HOST, nbytes=64))
        events.append(Event(kind=EventKind.LOOKUP, ts_ns=t0 + 1, source_id=src, seq=1, engine=engine, instance=engine,
                            model=model, request_id="r", prompt_tokens=prompt_tokens, group_block_keys=[keys]))
    return events


def test_a_commit_from_an_object_s_earlier_life_counts_in_no_path(store: Store, tmp_path: Path) -> None:
    """An object that lost its last copy is forgotten with its history: a copy loaded back
    later (no commit since) is uncommitted, whatever was committed before. The SQL paths know
    where each object's current life began; the leased commit of the earlier life counts neither."""
    t0 = 1_750_000_000 * 10**9
    keys = [101, 102]
    common = dict(source_id=1, engine="vllm", instance="i0", model="dense", component=ComponentKind.FULL_ATTENTION)
    events = [
        Event(kind=EventKind.COMMIT, ts_ns=t0, seq=1, block_key=keys[0], more_keys=keys[1:], tier=Tier.DEVICE,
              nbytes=64, tenant="t1", lease_expiry_ns=t0 + 10**12, **common),
        Event(kind=EventKind.EVICT, ts_ns=t0 + 1, seq=2, block_key=keys[1], tier=Tier.DEVICE, **common),
        Event(kind=EventKind.LOAD, ts_ns=t0 + 2, seq=3, block_key=keys[1], src_tier=Tier.DISK, dst_tier=Tier.DEVICE,
              nbytes=64, **common),
        Event(kind=EventKind.LOOKUP, ts_ns=t0 + 3, seq=4, request_id="r", prompt_tokens=5, tenant="t1",
              group_block_keys=[keys], **{k: v for k, v in common.items() if k != "component"}),
    ]
    frames = three_paths(store, tmp_path, events)
    assert_same(frames)
    row = frames[0].row(0, named=True)
    bs = DENSE.groups[0].block_size
    assert (row["logical_hit_tokens"], row["recoverable_hit_tokens"]) == (2 * bs, bs)
    assert (row["reason"], row["reason_detail"]) == (GapReason.UNCOMMITTED.value, "no commit seen")


@pytest.mark.parametrize("hole", [0, 1])
def test_a_block_never_written_inside_the_chain_breaks_the_prefix_in_every_path(
        store: Store, tmp_path: Path, hole: int) -> None:
    """The SQL paths give a block a row only when its object has a state; one without is missing.
    Here full attention lacks one block (the first, or the second) below a boundary that the Mamba
    group's checkpoint reaches: the hash hit is the checkpoint's, the recoverable prefix stops
    before the hole, and the reason is the missing block, in all three paths."""
    from kvtrace.schema.recipes import GroupSpec, Recipe

    bs = 2
    hybrid = Recipe(name="fa-mamba", groups=(
        GroupSpec(group_id=0, component=ComponentKind.FULL_ATTENTION, block_size=bs),
        GroupSpec(group_id=1, component=ComponentKind.MAMBA, block_size=bs)))
    t0 = 1_750_000_000 * 10**9
    fa, mamba = [101, 102, 103], [201, 202, 203]
    common = dict(source_id=1, engine="vllm", instance="i0", model="fm")
    written = [(0, k) for i, k in enumerate(fa) if i != hole] + [(1, mamba[0]), (1, mamba[1])]
    events = [Event(kind=EventKind.COMMIT, ts_ns=t0 + n, seq=n, block_key=key, group_id=group, tier=Tier.DEVICE,
                    component=ComponentKind.FULL_ATTENTION if group == 0 else ComponentKind.MAMBA, nbytes=64,
                    **common)
              for n, (group, key) in enumerate(written)]
    events.append(Event(kind=EventKind.LOOKUP, ts_ns=t0 + 10, seq=10, request_id="r", prompt_tokens=3 * bs + 1,
                        group_block_keys=[fa, mamba], **common))
    frames = three_paths(store, tmp_path, events, recipes=RecipeBook({"fm": hybrid}))
    assert_same(frames)
    row = frames[0].row(0, named=True)
    # Mamba's checkpoints reach 2 blocks (its third was never written); full attention's hole
    # leaves `hole` blocks before it.
    assert (row["logical_hit_tokens"], row["recoverable_hit_tokens"]) == (2 * bs, hole * bs)
    assert (row["reason"], row["reason_group"]) == (GapReason.MISSING_BLOCK.value, 0)


def test_commit_identities_sharing_a_hash_are_refused_not_confused(
        store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SQL paths carry a commit's tenant and identity as one hash; two commits whose
    identities differ but hash alike would be judged with each other's strings. A run that meets
    such a pair refuses, naming the streaming path. A 64-bit hash does not collide in a test, so
    a weak one (the tenant's alone) stands in for it: two model revisions of one tenant."""
    from kvtrace.analysis import sql

    t0 = 1_750_000_000 * 10**9
    common = dict(source_id=1, engine="vllm", instance="i0", model="dense", component=ComponentKind.FULL_ATTENTION,
                  tier=Tier.DEVICE, nbytes=64, tenant="t1")
    events = [Event(kind=EventKind.COMMIT, ts_ns=t0, seq=1, block_key=101, model_revision="a", **common),
              Event(kind=EventKind.COMMIT, ts_ns=t0 + 1, seq=2, block_key=102, model_revision="b", **common),
              Event(kind=EventKind.LOOKUP, ts_ns=t0 + 2, seq=3, source_id=1, engine="vllm", instance="i0",
                    model="dense", model_revision="a", tenant="t1", request_id="r", prompt_tokens=5,
                    group_block_keys=[[101, 102]])]
    frames = three_paths(store, tmp_path, events)  # the real hash tells the two apart
    assert_same(frames)
    assert frames[0]["reason"].to_list() == [GapReason.IDENTITY_MISMATCH.value]
    parquet = tmp_path / "events.parquet"
    monkeypatch.setattr(sql, "_idh", lambda d: "cityHash64(CAST(tenant AS String))" if d.clickhouse else "hash(tenant)")
    with pytest.raises(RuntimeError, match=r"1 hash\(es\) stand for more than one commit identity.*--path stream"):
        clickhouse_results(store, BOOK)
    with pytest.raises(RuntimeError, match=r"1 hash\(es\) stand for more than one commit identity.*--path stream"):
        duckdb_results(parquet, BOOK)
