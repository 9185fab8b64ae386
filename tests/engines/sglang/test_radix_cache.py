"""SGLang's own radix cache, driven with a real trace, against what kvtrace reconstructs.

Runs in the SGLang venv (scripts/test.sh does it):
`.venvs/sglang/bin/python -m pytest -o addopts=-ra tests/engines/sglang`.
Both tree cores are exercised: SGLang's default Rust core and its Python reference core.
"""

from __future__ import annotations

import time
from array import array
from importlib import resources

import pytest

from kvtrace.analysis.reconstruct import reconstruct
from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.identity import Identity
from kvtrace.instrumentation.replay import tokens_of
from kvtrace.instrumentation.sglang.driver import Driver, DriverConfig, Mix, Route, build_cache
from kvtrace.instrumentation.sglang.recipe import recipe_from_cache
from kvtrace.instrumentation.sglang.shim import RadixCacheShim, resident_keys
from kvtrace.instrumentation.sinks.memory import MemorySink
from kvtrace.instrumentation.traces import read_trace
from kvtrace.schema import ComponentKind, EventKind
from kvtrace.schema.kinds import Tier
from kvtrace.schema.recipes import Recipe, recipe_from_json
from kvtrace.schema.verdicts import GapReason

# After kvtrace's SGLang driver, which puts a torchvision stand-in in place before the first
# `import sglang` (SGLang's config package imports torchvision).
# isort: split
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

TRACE = resources.files("kvtrace.cli") / "data" / "mooncake_conversation_head.jsonl.gz"
CORES = ("rust", "python")


def replay(config: DriverConfig, requests: int, events: bool = False):  # noqa: ANN201
    cache, allocator, pool = build_cache(config, enable_kv_cache_events=events)
    sink = MemorySink()
    emitter = BatchEmitter(sink, BatchConfig(max_queue_size=1 << 20), register_atexit=False)
    shim = RadixCacheShim(cache, emitter, Identity(instance="sglang-0", model="tiny")).install()
    driver = Driver(cache, allocator, pool, config, shim)
    own: list = []  # SGLang's own KV events, drained after each request as its scheduler does
    served = []
    for r in read_trace(str(TRACE), limit=requests):
        served.append(driver.serve(r.request_id, tokens_of(r)))
        if events:
            own.extend(cache.take_events())
    assert emitter.shutdown() and shim.errors == 0
    assert emitter.stats().dropped == 0
    return cache, served, sink.events, own


def shimmed(config: DriverConfig):  # noqa: ANN201
    """A fresh cache with the shim, its memory sink and a driver that reports admissions."""
    cache, allocator, pool = build_cache(config)
    sink = MemorySink()
    emitter = BatchEmitter(sink, BatchConfig(), register_atexit=False)
    shim = RadixCacheShim(cache, emitter, Identity(instance="sglang-0")).install()
    return cache, sink, emitter, shim, Driver(cache, allocator, pool, config, shim)


def judged_by_its_own_recipe(events: list, recipe: Recipe, compare: bool = True) -> list:
    """The results by the recipe the tests derive from the cache, which the shim attached with,
    first and once: the analysis given no recipe, judging each lookup by the recipe its engine
    published, gives the same results (`compare`: checked here; a replay's reconstruction takes
    seconds, and the recipe does not depend on the tree core)."""
    assert events[0].kind is EventKind.ATTACH and [e.kind for e in events].count(EventKind.ATTACH) == 1
    assert recipe_from_json(events[0].recipe) == recipe
    judged = reconstruct(events, recipe)
    if compare:
        assert reconstruct(events) == judged
    return judged


def _config(mix: Mix, core: str, kv_tokens: int = 100_000) -> DriverConfig:
    page = 1 if mix in (Mix.MAMBA, Mix.SWA_MAMBA) else 16  # SGLang's Mamba state needs page 1 (no extra buffer)
    return DriverConfig(mix=mix, tree_core=core, page_size=page, kv_tokens=kv_tokens)


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("mix", list(Mix))
def test_reconstruction_matches_sglang_hits_request_by_request(mix: Mix, core: str) -> None:
    # 100k slots: room for the longest prompt (87k tokens), and the trace still evicts.
    requests = 80 if mix in (Mix.FULL, Mix.SWA) else 40
    cache, served, events, _ = replay(_config(mix, core), requests)
    recipe = recipe_from_cache(cache)
    judged = judged_by_its_own_recipe(events, recipe, compare=core == "rust")  # SGLang's default core
    results = sorted((r for r in judged if r.adopt_seen), key=lambda r: r.seq)
    assert [r.request_id for r in results] == [s.request_id for s in served]
    lookups = {e.request_id: e for e in events if e.kind is EventKind.LOOKUP}
    for r, s in zip(results, served, strict=True):
        # logical: SGLang's own full-attention match (device or host); recoverable: what SGLang
        # let the request reuse, with every component agreeing; adopted: what it did reuse.
        assert r.group_logical_tokens[0] == s.full_kv_hit, r.request_id
        assert r.recoverable_hit_tokens == s.reused == r.adopted_tokens, r.request_id
        assert lookups[r.request_id].reported_hit_tokens == s.device_hit + s.host_hit, r.request_id
        assert not r.unsafe_reuse
    assert sum(s.reused for s in served) > 0
    evicted = {e.component for e in events if e.kind is EventKind.EVICT}
    assert ComponentKind.FULL_ATTENTION in evicted  # the trace outgrows the pool


@pytest.mark.parametrize("core", CORES)
def test_the_scheduler_route_serves_and_reports_as_the_cache_route_does(core: str) -> None:
    """Through SGLang's own request-level steps (match_kv_cache, lock, a request-pool row,
    release_kv_cache with its checkpoint) the cache ends where the direct calls leave it, and
    the shim, which names a checkpoint's pages by its request, reports the same events."""
    direct = _config(Mix.FULL, core)
    scheduled = DriverConfig(tree_core=core, page_size=16, kv_tokens=direct.kv_tokens, route=Route.SCHEDULER)
    cache_a, served_a, events_a, _ = replay(direct, 80)
    cache_b, served_b, events_b, _ = replay(scheduled, 80)
    assert served_a == served_b and sum(s.reused for s in served_b) > 0
    assert cache_a.token_to_kv_pool_allocator.available_size() == cache_b.token_to_kv_pool_allocator.available_size()

    def fields(events: list) -> list:
        return [(e.kind, e.request_id, e.block_key, e.more_keys, e.group_hit_tokens, e.reason, e.tier,
                 e.prompt_tokens, e.reused_tokens) for e in events if e.kind is not EventKind.USAGE]

    assert fields(events_a) == fields(events_b)
    assert {EventKind.LOOKUP, EventKind.COMMIT, EventKind.EVICT, EventKind.ADOPT} <= {e.kind for e in events_b}


def test_the_scheduler_route_refuses_what_it_does_not_drive() -> None:
    config = DriverConfig(mix=Mix.SWA, route=Route.SCHEDULER, kv_tokens=1 << 15)
    with pytest.raises(ValueError, match="scheduler route drives full attention"):
        Driver(*build_cache(config), config)


@pytest.mark.parametrize("tree", ["radix", "pure_swa"])
def test_older_trees_match_request_by_request(tree: str) -> None:
    """SGLang's single-component trees: `RadixCache` (full attention) and `PureSWARadixCache`
    (all-SWA models), which free through their event recorder rather than cache actions."""
    cache, served, events, _ = replay(DriverConfig(tree=tree, kv_tokens=100_000), 80)
    recipe = recipe_from_cache(cache)
    assert [g.component for g in recipe.groups] == [
        ComponentKind.FULL_ATTENTION if tree == "radix" else ComponentKind.SLIDING_WINDOW]
    results = sorted((r for r in judged_by_its_own_recipe(events, recipe) if r.adopt_seen), key=lambda r: r.seq)
    assert [r.request_id for r in results] == [s.request_id for s in served]
    for r, s in zip(results, served, strict=True):
        assert r.logical_hit_tokens == s.full_kv_hit or s.full_kv_hit == 0, r.request_id
        assert r.recoverable_hit_tokens == s.reused == r.adopted_tokens, r.request_id
    assert sum(s.reused for s in served) > 0
    assert any(e.kind is EventKind.EVICT for e in events)
    usage = next(e for e in events if e.kind is EventKind.USAGE)
    assert usage.component is recipe.groups[0].component and usage.free_bytes > 0


@pytest.mark.parametrize("core", CORES)
def test_missing_mamba_checkpoints_are_hidden_recompute(core: str) -> None:
    """Requests sharing a prefix resume from the Mamba state kept at its branching point; once
    Mamba states are evicted the full KV of the prefix is still there but SGLang recomputes.
    kvtrace shows the hash hit it could not use, with the reason."""
    cache, sink, emitter, shim, driver = shimmed(DriverConfig(mix=Mix.MAMBA, tree_core=core, page_size=1,
                                                               kv_tokens=8192))
    shared = list(range(1000, 1200))
    served = [driver.serve(f"r{i}", shared + list(range(5000 + 100 * i, 5050 + 100 * i))) for i in range(3)]
    cache.evict(EvictParams(mamba_num=64))  # every Mamba state goes; shared full KV stays
    served.append(driver.serve("after", shared + list(range(9000, 9050))))
    assert emitter.shutdown() and shim.errors == 0
    assert served[2].reused == 192 and served[3].reused == 0 and served[3].full_kv_hit >= 192
    results = {r.request_id: r for r in reconstruct(sink.events, recipe_from_cache(cache)) if r.adopt_seen}
    assert results["r2"].recoverable_hit_tokens == 192 == results["r2"].adopted_tokens
    gap = results["after"]
    assert gap.logical_hit_tokens == served[3].full_kv_hit and gap.recoverable_hit_tokens == 0
    assert gap.reason is GapReason.NO_CHECKPOINT
    commits = [e for e in sink.events if e.kind is EventKind.COMMIT and e.component is ComponentKind.MAMBA]
    assert any(e.block_key == shim_key(shared[:192]) for e in commits)  # the branching-point checkpoint


def shim_key(tokens: list[int]) -> int:
    from kvtrace.instrumentation.sglang.keys import new_chain

    return int(new_chain(None, None).extend(array("q", tokens), 1)[-1])


@pytest.mark.parametrize("core", CORES)
def test_state_matches_sglangs_own_kv_events(core: str) -> None:
    """The shim's commits and evictions leave the same device pages resident as SGLang's own KV
    events say, page for page. SGLang names pages by its SHA-256 chain and kvtrace by its own
    page keys, so each stored block is renamed by keying its tokens after its parent block: that
    also checks that kvtrace's chain follows SGLang's tree."""
    import numpy as np
    from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    from kvtrace.instrumentation.page_keys import finalize, page_states

    _, served, events, own = replay(_config(Mix.FULL, core, kv_tokens=100_000), 80, events=True)
    assert own, "SGLang published no events"
    state: dict[int, int] = {}  # SGLang's block hash -> kvtrace chain state after that block
    theirs: set[int] = set()
    for e in own:
        if isinstance(e, BlockStored):
            prior = state[e.parent_block_hash] if e.parent_block_hash is not None else 0
            states = page_states(e.token_ids, e.block_size, prior)
            assert len(states) == len(e.block_hashes)
            state.update(zip(e.block_hashes, states.tolist(), strict=True))
            theirs |= set(finalize(states).tolist())
        elif isinstance(e, BlockRemoved):
            theirs -= set(finalize(np.array([state[h] for h in e.block_hashes], dtype=np.uint64)).tolist())
        elif isinstance(e, AllBlocksCleared):
            theirs.clear()
    ours: set[int] = set()
    for e in events:
        keys = {e.block_key, *e.more_keys}
        if e.kind is EventKind.COMMIT and e.tier is Tier.DEVICE:
            ours |= keys
        elif e.kind is EventKind.EVICT and e.tier is Tier.DEVICE:
            ours -= keys
    assert ours == theirs and len(ours) > 100


@pytest.mark.parametrize("core", CORES)
def test_a_window_lost_under_full_kv_is_a_gap_with_its_reason(core: str) -> None:
    cache, sink, emitter, shim, driver = shimmed(DriverConfig(mix=Mix.SWA, tree_core=core, page_size=4, window=8,
                                                               kv_tokens=512))
    tokens = list(range(100, 133))
    driver.serve("a", tokens)
    cache.evict(EvictParams(swa_num_tokens=512))  # the window's state goes, full attention stays
    again = driver.serve("b", tokens)
    assert emitter.shutdown() and shim.errors == 0
    assert again.full_kv_hit > again.reused  # full attention would resume further than the window allows
    result = next(r for r in reconstruct(sink.events, recipe_from_cache(cache)) if r.request_id == "b")
    assert result.logical_hit_tokens == again.full_kv_hit
    assert result.recoverable_hit_tokens == again.reused == result.adopted_tokens
    assert result.reason is GapReason.WINDOW_OUT_OF_RANGE
    swa_evicts = [e for e in sink.events if e.kind is EventKind.EVICT and e.component is ComponentKind.SLIDING_WINDOW]
    assert swa_evicts


@pytest.mark.parametrize("core", CORES)
def test_salted_requests_reuse_their_own_namespace(core: str) -> None:
    """A tenant's pages are committed under its salt: its own hits are clean, and another
    tenant's identical prompt shares nothing (SGLang namespaces the keys)."""
    cache, sink, emitter, shim, driver = shimmed(DriverConfig(mix=Mix.SWA, tree_core=core, page_size=4, window=8,
                                                               kv_tokens=1024))
    tokens = list(range(100, 133))
    served = [driver.serve("a1", tokens, "A"), driver.serve("a2", tokens, "A"), driver.serve("b1", tokens, "B")]
    assert emitter.shutdown() and shim.errors == 0
    assert [s.reused for s in served] == [0, 32, 0]
    commits = {e.tenant for e in sink.events if e.kind is EventKind.COMMIT}
    assert commits == {"A", "B"}
    results = {r.request_id: r for r in reconstruct(sink.events, recipe_from_cache(cache)) if r.adopt_seen}
    assert results["a2"].recoverable_hit_tokens == 32 == results["a2"].adopted_tokens
    assert not any(r.unsafe_reuse or r.cross_tenant for r in results.values())
    assert results["b1"].logical_hit_tokens == 0


def test_recipe_is_derived_from_the_cache() -> None:
    for mix, kinds in ((Mix.FULL, ["full_attention"]), (Mix.SWA, ["full_attention", "sliding_window"]),
                       (Mix.SWA_MAMBA, ["full_attention", "sliding_window", "mamba"])):
        cache, _, _ = build_cache(_config(mix, "rust", kv_tokens=4096))
        recipe = recipe_from_cache(cache)
        assert [g.component.value for g in recipe.groups] == kinds
        assert all(g.block_size == cache.page_size for g in recipe.groups)
        assert all(g.window == 64 for g in recipe.groups if g.component is ComponentKind.SLIDING_WINDOW)


def _run(cache: object, allocator: object, pool: object, config: DriverConfig, shim: object) -> list:
    driver = Driver(cache, allocator, pool, config, shim)
    tokens = list(range(1000, 1400))
    out = [driver.serve(f"r{i}", tokens[: 200 + 40 * i]) for i in range(5)]
    cache.evict(EvictParams(num_tokens=1 << 20))  # type: ignore[attr-defined]
    out.append(driver.serve("again", tokens))
    return [(s.device_hit, s.full_kv_hit, s.reused) for s in out]


def test_a_failing_emitter_never_reaches_the_engine() -> None:
    class Broken:
        enabled = True

        def emit(self, event):  # noqa: ANN001, ANN202
            raise RuntimeError("sink on fire")

        def sampled(self, key, rate):  # noqa: ANN001, ANN202
            return True

    config = DriverConfig(mix=Mix.SWA, page_size=4, window=8, kv_tokens=4096)
    plain = _run(*build_cache(config), config, None)
    cache, allocator, pool = build_cache(config)
    shim = RadixCacheShim(cache, Broken(), Identity()).install()  # type: ignore[arg-type]
    assert _run(cache, allocator, pool, config, shim) == plain
    assert shim.errors > 0
    shim.uninstall()
    assert "wrapper" not in repr(cache.match_prefix)


def test_a_full_buffer_drops_and_counts_but_never_blocks_the_engine() -> None:
    config = DriverConfig(mix=Mix.FULL, page_size=4, kv_tokens=4096)
    plain = _run(*build_cache(config), config, None)
    cache, allocator, pool = build_cache(config)
    sink = MemorySink()
    sink.delay_s = 2.0  # the exporter is stuck
    emitter = BatchEmitter(sink, BatchConfig(max_queue_size=4, max_export_batch_size=4, schedule_delay_millis=1),
                           register_atexit=False)
    shim = RadixCacheShim(cache, emitter, Identity()).install()
    started = time.monotonic()
    assert _run(cache, allocator, pool, config, shim) == plain
    assert time.monotonic() - started < 1.5  # never waited for the stuck exporter
    assert emitter.stats().dropped_queue_full > 0 and shim.errors == 0


def test_missing_hook_points_leave_the_cache_alone(caplog: pytest.LogCaptureFixture) -> None:
    """A cache without some entry points (another SGLang release): those hooks are off."""

    class Older:
        page_size = 16
        tree_components = ()

        def match_prefix(self, params):  # noqa: ANN001, ANN202
            return None

    emitter = BatchEmitter(MemorySink(), BatchConfig(), register_atexit=False)  # it attaches, so a real emitter
    with caplog.at_level("WARNING", logger="kvtrace.sglang"):
        shim = RadixCacheShim(Older(), emitter, Identity()).install()  # type: ignore[arg-type]
    assert emitter.shutdown()
    assert shim.errors == 0 and "has no insert" in caplog.text and "evictions are off" in caplog.text


def test_lookups_are_reported_once_per_answer() -> None:
    """The scheduler matches a waiting request every round; one lookup per distinct answer."""
    config = DriverConfig(mix=Mix.FULL, page_size=4, kv_tokens=4096)
    cache, allocator, pool = build_cache(config)
    sink = MemorySink()
    emitter = BatchEmitter(sink, BatchConfig(), register_atexit=False)
    RadixCacheShim(cache, emitter, Identity()).install()
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    tokens = array("q", range(50, 90))
    req = Req(rid="w", origin_input_text="", origin_input_ids=tokens, sampling_params=SamplingParams(max_new_tokens=1))
    for _ in range(5):
        cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens[:-1]), req=req))
    value = allocator.alloc(40)
    cache.insert(InsertParams(key=RadixKey(tokens[:40]), value=value))
    cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens[:-1]), req=req))
    assert emitter.shutdown()
    lookups = [e for e in sink.events if e.kind is EventKind.LOOKUP]
    assert [e.reported_hit_tokens for e in lookups] == [0, 36]


@pytest.mark.parametrize("core", ["rust", "python"])
def test_a_streaming_sessions_turns_resume_from_the_kv_it_kept(core: str) -> None:
    """A streaming session keeps each turn's KV row outside the tree, and its next turn resumes
    there: SGLang reports a device hit the tree never held, and kvtrace, which commits the
    session's pages where it keeps them, finds the same hit recoverable. Closing a session
    evicts its pages (explicitly), but not copies of the same pages that the tree holds (a
    request outside the session made them) or that another session keeps. One-token pages,
    SGLang's default: with larger pages a turn also reuses the partial page it kept, which
    kvtrace, naming whole pages, cannot vouch for."""
    cache, sink, emitter, shim, driver = shimmed(DriverConfig(page_size=1, kv_tokens=1 << 12, tree_core=core,
                                                              route=Route.SCHEDULER))
    tokens = list(range(100, 121))
    for turn in range(3):
        driver.serve_turn("s", f"turn-{turn}", tokens)
        tokens = tokens + list(range(500 + 10 * turn, 509 + 10 * turn))
    assert driver.serve("outside", tokens[:30]).device_hit == 0  # the session's KV is its own
    assert driver.serve_turn("s2", "other-0", tokens[:35]).device_hit == 30  # the tree's, from "outside"
    driver.close_session("s")  # 39 pages: 30 in the tree, 5 more kept by "s2"
    assert driver.serve("after", tokens[:30]).device_hit == 29
    assert driver.serve_turn("s2", "other-1", tokens[:36]).device_hit == 35
    driver.close_session("s2")
    assert emitter.shutdown() and shim.errors == 0
    results = {r.request_id: r for r in reconstruct(sink.events, recipe_from_cache(cache))}
    for rid, hit in (("turn-1", 21), ("turn-2", 30), ("after", 29), ("other-1", 35)):
        assert results[rid].recoverable_hit_tokens == hit == results[rid].adopted_tokens, rid
        assert not results[rid].unsafe_reuse
    closed = [e for e in sink.events if e.kind is EventKind.EVICT]  # ordinary requests' releases: none
    assert [(e.reason.value, len(e.more_keys) + 1) for e in closed] == [("explicit", 39 - 30 - 5), ("explicit", 6)]
    # A limit: kvtrace cannot tell a session's pages from the tree's, so a request outside the
    # session, or another session's first turn, looks like a missed hit on the pages "s" kept,
    # though SGLang never shares a session's KV.
    assert results["outside"].recoverable_hit_tokens == 29 and results["outside"].adopted_tokens == 0
    assert results["other-0"].recoverable_hit_tokens == 34 and results["other-0"].adopted_tokens == 30


@pytest.mark.parametrize("core", ["rust", "python"])
def test_an_aborted_session_turn_hands_its_row_to_the_tree(core: str) -> None:
    """An aborted turn takes its row back from the session and is released like any request:
    its prompt goes into the tree, on the same slots. Nothing is evicted then, the next turn
    starts a new row on the tree's pages, and closing the session evicts only what that turn
    added."""
    cache, sink, emitter, shim, driver = shimmed(DriverConfig(page_size=1, kv_tokens=1 << 12, tree_core=core,
                                                              route=Route.SCHEDULER))
    tokens = list(range(100, 121))
    driver.serve_turn("s", "turn-0", tokens)
    assert driver.serve_turn("s", "aborted", tokens + list(range(500, 509)), aborted=True).device_hit == 21
    assert not cache.session.slots  # the session lets the row go
    assert driver.serve_turn("s", "turn-2", tokens + list(range(500, 509)) + [7, 8]).device_hit == 30
    driver.close_session("s")
    assert emitter.shutdown() and shim.errors == 0
    assert len(resident_keys(shim)) == 30 == cache.full_evictable_size()  # the tree's pages, nothing else
    evicted = [(e.reason.value, len(e.more_keys) + 1) for e in sink.events if e.kind is EventKind.EVICT]
    assert evicted == [("explicit", 2)]
    results = {r.request_id: r for r in reconstruct(sink.events, recipe_from_cache(cache))}
    for rid, hit in (("aborted", 21), ("turn-2", 30)):
        assert (results[rid].recoverable_hit_tokens == hit == results[rid].adopted_tokens
                and not results[rid].unsafe_reuse)


@pytest.mark.parametrize("page", [16, 1])
@pytest.mark.parametrize("core", CORES)
def test_chunked_prefill_decode_and_retraction_are_reported_as_sglang_reuses(core: str, page: int) -> None:
    """The scheduler's other steps. Two requests sharing a document both miss it and are
    prefilled in chunks side by side, as in one batch: each chunk is checkpointed into the tree,
    and the second request's copy of every shared chunk is a duplicate the tree frees. They
    decode, and finish with their outputs in the tree, which the next turn of the conversation
    reuses. A third request is preempted in decode, after its first chunk: its row is freed
    without a checkpoint, what its chunk put into the tree is evicted while it waits, and it is
    admitted again with the outputs it had made. Every page committed is one SGLang's tree
    holds, and each admission's reuse is what kvtrace finds recoverable."""
    cache, sink, emitter, shim, driver = shimmed(DriverConfig(page_size=page, kv_tokens=1 << 12, tree_core=core,
                                                              route=Route.SCHEDULER))
    doc = list(range(1000, 1200))
    a, b, out_a = doc + list(range(1, 40)), doc + list(range(50, 90)), list(range(7000, 7030))
    run_a, run_b = driver.admit("a", a, outputs=out_a), driver.admit("b", b, outputs=[9, 9, 9])
    assert driver.prefill(run_a, 64) and driver.prefill(run_b, 64)
    # a's chunk went into the tree; b's copy of it was a duplicate, freed, b's row now on a's slots
    assert cache.full_evictable_size() + cache.full_protected_size() == 64
    rows = cache.req_to_token_pool.req_to_token
    assert run_b.req.prefix_len == run_b.req.kv.cache_protected_len == 64
    assert rows[run_b.req.kv.req_pool_idx, :64].tolist() == rows[run_a.req.kv.req_pool_idx, :64].tolist()
    end, more = 64, True
    while more:
        end += 64
        more = driver.prefill(run_a, end) | driver.prefill(run_b, end)
    # prefilled and decoding: a's whole prompt is in the tree already, for a request admitted now
    assert driver.serve("peek", a + [77, 78]).device_hit == len(a) // page * page
    assert (driver.decode(run_a), driver.decode(run_b)) == (0, 0)
    assert (driver.finish(run_a).device_hit, driver.finish(run_b).device_hit) == (0, 0)
    kept = (len(a) + len(out_a) - 1) // page * page  # the last output token has no KV
    assert driver.serve("a-turn-2", a + out_a + list(range(300, 320))).device_hit == kept
    c = doc + list(range(400, 500))
    run_c = driver.admit("c", c, outputs=[5] * 20)
    assert run_c.device == len(doc) // page * page
    driver.prefill(run_c, 256)
    driver.prefill(run_c)
    assert driver.decode(run_c, 5) == 14  # 6 of its 20 outputs made
    committed_before = run_c.req.kv.kv_committed_len  # what SGLang had computed for it
    driver.retract(run_c)
    evicted = cache.evict(EvictParams(num_tokens=1 << 12)).num_tokens_evicted
    driver.readmit(run_c)  # matched on its prompt and the 6 outputs: nothing is left
    assert run_c.device == 0 and evicted > 0
    driver.prefill(run_c)
    driver.decode(run_c)
    driver.finish(run_c)
    assert emitter.shutdown() and shim.errors == 0
    assert len(resident_keys(shim)) * page == cache.full_evictable_size() > 0  # ledger and tree agree
    committed = sum(len(e.more_keys) + 1 for e in sink.events if e.kind is EventKind.COMMIT)
    gone = sum(len(e.more_keys) + 1 for e in sink.events if e.kind is EventKind.EVICT)
    assert (committed - gone) * page == cache.full_evictable_size() and gone * page == evicted
    # a's pages once: b's copies of the shared chunks were duplicates, never committed
    def pages(tokens: int) -> int:
        return tokens // page

    shared = pages(len(doc))
    # c: its prefill (a chunk, then the rest, checkpointed before it decodes), evicted; then all again
    assert committed == (pages(kept) + pages(len(b) + 2) - shared + pages(len(a) + 2) - pages(len(a))
                         + pages(len(a) + len(out_a) + 20) - pages(kept) + pages(len(c)) - shared + pages(len(c) + 19))
    results = sorted(reconstruct(sink.events, recipe_from_cache(cache)), key=lambda r: r.seq)
    want = [("a", 0), ("b", 0), ("peek", len(a) // page * page), ("a-turn-2", kept), ("c", len(doc) // page * page),
            ("c", 0)]  # c: two admissions
    assert [(r.request_id, r.adopted_tokens) for r in results] == want
    for r in results:
        assert r.group_logical_tokens[0] == r.recoverable_hit_tokens == r.adopted_tokens, r.request_id
        assert not r.unsafe_reuse, r.request_id
    assert [r.prompt_tokens for r in results if r.request_id == "c"] == [len(c), len(c) + 6]
    # its second admission says it is one, and what it had computed when retracted
    assert [(r.preemptions, r.computed_before_preemption) for r in results if r.request_id == "c"] == [
        (0, 0), (1, committed_before)]
    assert committed_before > 0
