"""vLLM's own KV-cache manager, driven with a real trace, against what kvtrace reconstructs.

Runs in the vLLM venv (scripts/test.sh does it): `.venvs/vllm/bin/python -m pytest -o addopts=-ra tests/engines/vllm`.
"""

from __future__ import annotations

import time
from importlib import resources

import pytest
from vllm.v1.request import RequestStatus

from kvtrace.analysis.reconstruct import reconstruct
from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.replay import tokens_of
from kvtrace.instrumentation.sinks.memory import MemorySink
from kvtrace.instrumentation.traces import read_trace
from kvtrace.instrumentation.vllm.driver import Driver, DriverConfig, Layout, build_manager
from kvtrace.instrumentation.vllm.recipe import recipe_from_kv_cache_config
from kvtrace.instrumentation.vllm.shim import CacheManagerShim, Identity, bytes_per_block, key_of_pool_key
from kvtrace.schema import ComponentKind, EventKind

TRACE = resources.files("kvtrace.cli") / "data" / "mooncake_conversation_head.jsonl.gz"


def replay(layout: Layout, requests: int, num_blocks: int):  # noqa: ANN201
    config = DriverConfig(layout=layout, num_blocks=num_blocks)
    manager = build_manager(config)
    sink = MemorySink()
    emitter = BatchEmitter(sink, BatchConfig(max_queue_size=1 << 20), register_atexit=False)
    shim = CacheManagerShim(manager, emitter, Identity(instance="vllm-0", model="tiny")).install()
    driver = Driver(manager, config)
    served = [driver.serve(r.request_id, tokens_of(r)) for r in read_trace(str(TRACE), limit=requests)]
    stats = driver.stats()
    assert emitter.shutdown() and shim.errors == 0
    assert emitter.stats().dropped == 0
    return manager, served, stats, sink.events


@pytest.mark.parametrize("layout", list(Layout))
def test_reconstruction_matches_vllm_hits_request_by_request(layout: Layout) -> None:
    # 8,192 blocks of 16 tokens: room for the longest prompt (87k tokens), and the trace still evicts.
    manager, served, stats, events = replay(layout, requests=80, num_blocks=8192)
    recipe = recipe_from_kv_cache_config(manager.kv_cache_config)
    results = sorted((r for r in reconstruct(events, recipe) if r.adopt_seen), key=lambda r: r.seq)
    assert [r.request_id for r in results] == [s.request_id for s in served]

    # vLLM's own counters: tokens queried and hit, exactly.
    assert stats.requests == len(served)
    assert stats.queries == sum(r.prompt_tokens for r in results)
    assert stats.hits == sum(r.adopted_tokens for r in results)
    # Request by request, the state rebuilt from events gives vLLM's reconciled hit as the
    # recoverable hit, and each group's own hit (full attention, sliding window, Mamba) as that
    # group's logical hit.
    lookups = {e.request_id: e for e in events if e.kind is EventKind.LOOKUP}
    for r, s in zip(results, served, strict=True):
        assert r.recoverable_hit_tokens == s.hit_tokens == r.adopted_tokens, r.request_id
        assert tuple(r.group_logical_tokens) == s.group_hits, r.request_id
        # What vLLM's own probes found per group before reconciling: the first group is probed
        # on its own, the others up to the hit so far.
        probed = lookups[r.request_id].group_hit_tokens
        assert len(probed) == len(s.group_hits) and probed[0] == s.group_hits[0], r.request_id
        assert all(p <= g for p, g in zip(probed, s.group_hits, strict=True)), r.request_id
        assert not r.unsafe_reuse
    assert stats.hits > 0
    kinds = {e.kind for e in events}
    assert {EventKind.LOOKUP, EventKind.ADOPT, EventKind.COMMIT, EventKind.EVICT} <= kinds
    if layout is not Layout.DENSE:  # the hybrid groups make hash hits that are not recoverable
        assert any(r.logical_hit_tokens > r.recoverable_hit_tokens for r in results)


def test_recipe_is_derived_from_vllm_config() -> None:
    for layout, second in ((Layout.SLIDING, ComponentKind.SLIDING_WINDOW), (Layout.MAMBA, ComponentKind.MAMBA)):
        recipe = recipe_from_kv_cache_config(build_manager(DriverConfig(layout=layout, num_blocks=64)).kv_cache_config)
        assert [g.component for g in recipe.groups] == [ComponentKind.FULL_ATTENTION, second]
        assert all(g.block_size == 16 for g in recipe.groups)
        if second is ComponentKind.SLIDING_WINDOW:
            assert recipe.groups[1].window == 64


def test_a_failing_emitter_never_reaches_the_engine() -> None:
    class Broken:
        def emit(self, event):  # noqa: ANN001, ANN202
            raise RuntimeError("sink on fire")

    config = DriverConfig(layout=Layout.SLIDING, num_blocks=512)
    manager = build_manager(config)
    shim = CacheManagerShim(manager, Broken(), Identity()).install()  # type: ignore[arg-type]
    driver = Driver(manager, config)
    tokens = list(range(1000, 1300))
    first, second = driver.serve("a", tokens), driver.serve("b", tokens)
    assert first.hit_tokens == 0 and second.hit_tokens > 0 and shim.errors > 0
    shim.uninstall()
    assert "wrapper" not in repr(manager.get_computed_blocks)


def test_a_full_buffer_drops_and_counts_but_never_blocks_the_engine() -> None:
    config = DriverConfig(layout=Layout.SLIDING, num_blocks=512)
    manager = build_manager(config)
    sink = MemorySink()
    sink.delay_s = 2.0  # the exporter is stuck
    emitter = BatchEmitter(sink, BatchConfig(max_queue_size=4, max_export_batch_size=4, schedule_delay_millis=1),
                           register_atexit=False)
    CacheManagerShim(manager, emitter, Identity()).install()
    driver = Driver(manager, config)
    tokens = list(range(1000, 1400))
    started = time.monotonic()
    served = [driver.serve(f"r{i}", tokens) for i in range(5)]
    assert time.monotonic() - started < 1.5  # never waited for the stuck exporter
    assert [s.hit_tokens for s in served][1:] == [384] * 4
    assert emitter.stats().dropped_queue_full > 0


def test_missing_hook_points_leave_the_engine_alone(caplog: pytest.LogCaptureFixture) -> None:
    """An older or newer vLLM without one of the methods: that hook is off, the rest work."""

    class OtherPool:  # a pool without cache_full_blocks / get_new_blocks
        hash_block_size = 16

    class OtherManager:
        def __init__(self, real: object) -> None:
            self.kv_cache_config = real.kv_cache_config  # type: ignore[attr-defined]
            self.block_pool = OtherPool()

    real = build_manager(DriverConfig(layout=Layout.DENSE, num_blocks=64))
    with caplog.at_level("WARNING", logger="kvtrace.vllm"):
        emitter = BatchEmitter(MemorySink(), register_atexit=False)  # the shim attaches at install: an emitter
        shim = CacheManagerShim(OtherManager(real), emitter, Identity()).install()
    assert shim.errors == 0 and "commits are off" in caplog.text and "evictions are off" in caplog.text


def test_sampling_keeps_whole_requests_and_all_state() -> None:
    config = DriverConfig(layout=Layout.DENSE, num_blocks=2048)
    manager = build_manager(config)
    sink = MemorySink()
    emitter = BatchEmitter(sink, BatchConfig(schedule_delay_millis=10), register_atexit=False)
    CacheManagerShim(manager, emitter, Identity(), sample_rate=0.5).install()
    driver = Driver(manager, config)
    prefix = list(range(100, 612))
    for i in range(40):
        driver.serve(f"r{i}", prefix + [10_000 + i] * 20)
    assert emitter.shutdown()
    events = sink.events
    looked = {e.request_id for e in events if e.kind is EventKind.LOOKUP}
    adopted = {e.request_id for e in events if e.kind is EventKind.ADOPT}
    assert looked == adopted and 5 < len(looked) < 35  # whole requests, about half
    assert emitter.stats().dropped_sampled_out == 2 * (40 - len(looked))
    results = reconstruct(events, recipe_from_kv_cache_config(manager.kv_cache_config))
    assert all(r.recoverable_hit_tokens == r.adopted_tokens for r in results)  # state is complete


def test_usage_samples_split_the_device_pool() -> None:
    """Held by running requests, evictable cached blocks and free blocks add up to the pool, as
    vLLM's own block pool counts them."""
    config = DriverConfig(layout=Layout.DENSE, num_blocks=2048)
    manager = build_manager(config)
    sink = MemorySink()
    emitter = BatchEmitter(sink, BatchConfig(max_queue_size=1 << 20), register_atexit=False)
    shim = CacheManagerShim(manager, emitter, Identity(instance="vllm-0", model="tiny"), usage_interval_s=0.0).install()
    driver = Driver(manager, config)
    for r in read_trace(str(TRACE), limit=10):
        driver.serve(r.request_id, tokens_of(r))
    shim.sample_usage(force=True)
    assert emitter.shutdown() and shim.errors == 0
    samples = [e for e in sink.events if e.kind is EventKind.USAGE]
    pool = manager.block_pool
    total = (pool.num_gpu_blocks - 1) * shim.pool_block_bytes
    assert samples and all(e.locked_bytes + e.evictable_bytes + e.free_bytes == total for e in samples)
    last = samples[-1]
    cached = sum(1 for b in pool.blocks if b.ref_cnt == 0 and b.block_hash is not None)
    assert last.locked_bytes == 0  # the driver finishes each request before the next
    assert last.evictable_bytes == cached * shim.pool_block_bytes > 0
    # the no-model driver allocates no KV tensors: a pool block is then its groups' pages
    assert not manager.kv_cache_config.kv_cache_tensors
    assert shim.pool_block_bytes == sum(bytes_per_block(g) for g in manager.kv_cache_config.kv_cache_groups) > 0


def test_evictions_follow_vllms_hash_map_with_duplicate_blocks() -> None:
    """vLLM does not de-duplicate: two requests computing the same prefix at once cache it twice.
    A key is evicted when its last block is reused, never while another block still holds it,
    and reported once; every other reuse of a hashed block is not an eviction."""
    config = DriverConfig(layout=Layout.DENSE, num_blocks=40)
    manager = build_manager(config)
    sink = MemorySink()
    emitter = BatchEmitter(sink, BatchConfig(max_queue_size=1 << 20), register_atexit=False)
    shim = CacheManagerShim(manager, emitter, Identity(instance="vllm-0", model="tiny")).install()
    driver = Driver(manager, config)
    block = config.block_size
    tokens = list(range(1000, 1000 + 8 * block + 3))
    twins = [driver.request(name, tokens) for name in ("a", "b")]
    found = [manager.get_computed_blocks(req) for req in twins]  # both look up before either computes
    assert [hit for _, hit, _ in found] == [0, 0]
    for req, (blocks, _, _) in zip(twins, found, strict=True):
        assert manager.allocate_slots(req, req.num_tokens, num_new_computed_tokens=0, new_computed_blocks=blocks)
    index = manager.block_pool.cached_block_hash_to_block._cache
    doubled = [k for k, v in index.items() if isinstance(v, dict) and len(v) == 2]
    assert len(doubled) == 8  # every full block is cached twice
    for req in twins:
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        manager.free(req)
    before = set(index)
    keys = {key_of_pool_key(k) for k in before}
    halved = 0  # steps that left a key with one of its two blocks
    for n in range(10):  # other prompts reuse the free blocks, oldest first, one copy at a time
        driver.serve(f"other-{n}", [50_000 * (n + 1) + i for i in range(5 * block)])
        emitter.force_flush()
        evicted = [k for e in sink.events if e.kind is EventKind.EVICT for k in (e.block_key, *e.more_keys)]
        gone = {key_of_pool_key(k) for k in before if k not in index}
        assert set(evicted) & keys == gone  # reported exactly when the last copy went
        held = [index.get(k) for k in before]
        halved += any(v is not None and (not isinstance(v, dict) or len(v) == 1) for v in held)
    assert gone == keys and halved  # every key went, some of them one copy at a time
    assert len(evicted) == len(set(evicted))  # once each
    assert emitter.shutdown() and shim.errors == 0
