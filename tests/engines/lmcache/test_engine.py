"""The real LMCache engine (local CPU and local disk backends) under the shim, against what
kvtrace reconstructs.

Runs in the LMCache venv (scripts/test.sh does it):
`.venvs/lmcache/bin/python -m pytest -o addopts=-ra tests/engines/lmcache`.
LMCache's own code does all the work; only its accelerator copy is a CPU stand-in (`cpu`).
"""

from __future__ import annotations

import os
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from importlib import resources
from pathlib import Path

import pytest
import torch

from kvtrace.analysis.reconstruct import reconstruct
from kvtrace.instrumentation.attach import distribution_version
from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.lmcache.cpu import EngineSpec, build_engine, destroy_engine
from kvtrace.instrumentation.lmcache.driver import Driver, kv_for, wait_for_disk
from kvtrace.instrumentation.lmcache.keys import block_key
from kvtrace.instrumentation.lmcache.shim import LMCacheShim
from kvtrace.instrumentation.replay import tokens_of
from kvtrace.instrumentation.sinks.memory import MemorySink
from kvtrace.instrumentation.traces import read_trace
from kvtrace.schema import EventKind
from kvtrace.schema.kinds import Reason, Tier
from kvtrace.schema.recipes import dense, recipe_from_json
from kvtrace.schema.verdicts import GapReason, Verdict

TRACE = resources.files("kvtrace.cli") / "data" / "mooncake_conversation_head.jsonl.gz"
SMALL = EngineSpec(layers=1, heads=1, head_size=8, chunk_size=256)  # 16 KiB a chunk


class Traced:
    """A real engine with the shim and a memory sink; `events()` flushes and returns them."""

    def __init__(self, spec: EngineSpec, sink: MemorySink | None = None, config: BatchConfig | None = None) -> None:
        self.id = f"t-{uuid.uuid4().hex[:8]}"
        self.spec = spec
        self.engine = build_engine(spec, self.id)
        self.sink = sink or MemorySink()
        self.emitter = BatchEmitter(self.sink, config or BatchConfig(max_queue_size=1 << 20), register_atexit=False)
        self.shim = LMCacheShim(self.engine, self.emitter, instance="lmc").install()
        self.driver = Driver(self.engine, spec)
        self.recipe = dense(spec.chunk_size)

    def events(self) -> list:
        wait_for_disk(self.engine)
        assert self.emitter.force_flush(30_000)
        return sorted(self.sink.events, key=lambda e: (e.ts_ns, e.source_id, e.seq))

    def results(self) -> dict:
        return {r.request_id: r for r in reconstruct(self.events(), self.recipe)}

    def close(self) -> None:
        self.emitter.shutdown()
        self.shim.uninstall()
        destroy_engine(self.id)


@pytest.fixture
def traced(tmp_path: Path) -> Iterator:
    made: list[Traced] = []

    def make(cpu_gb: float, disk: bool = True, **kwargs) -> Traced:  # noqa: ANN003
        spec = replace(SMALL, cpu_gb=cpu_gb, disk_gb=1.0,
                       disk_path=str(tmp_path / f"disk{len(made)}") if disk else "", **kwargs)
        made.append(Traced(spec))
        return made[-1]

    yield make
    for t in made:
        t.close()


def prompt(seed: int, chunks: int, spec: EngineSpec = SMALL) -> list[int]:
    return [(seed * 7919 + i) % 30_000 + 1 for i in range(chunks * spec.chunk_size)]


def attached_first(events: list, spec: EngineSpec, instance: str = "lmc/lmcache") -> None:
    """What the shim said when installed, before anything else and once: the release, the model,
    its chunk size and recipe (one full-attention group of chunks, as the tests' `dense`), no
    longest request (LMCache does not know it), then host and disk invalidated."""
    attach = events[0]
    assert attach.kind is EventKind.ATTACH and [e.kind for e in events].count(EventKind.ATTACH) == 1
    assert (attach.engine, attach.instance, attach.model, attach.block_size, attach.max_model_len) == (
        "lmcache", instance, spec.model, spec.chunk_size, 0)
    assert attach.engine_version == distribution_version("lmcache") != ""
    assert recipe_from_json(attach.recipe).groups == dense(spec.chunk_size).groups
    assert [(e.kind, e.tier, e.reason, e.block_key) for e in events[1:3]] == [
        (EventKind.INVALIDATE, Tier.HOST, Reason.RESTART, 0), (EventKind.INVALIDATE, Tier.DISK, Reason.RESTART, 0)]


def test_trace_replay_matches_lmcache_request_by_request(traced) -> None:  # noqa: ANN001
    t = traced(cpu_gb=0.004)  # ~250 chunks of host cache: the trace evicts, the disk keeps everything
    served = [t.driver.serve(r.request_id, tokens_of(r)) for r in read_trace(str(TRACE), limit=40)]
    events = t.events()
    attached_first(events, t.spec)
    assert reconstruct(events) == reconstruct(events, t.recipe)  # judged by the recipe LMCache's shim published
    results = {r.request_id: r for r in reconstruct(events, t.recipe)}
    assert t.shim.errors == 0 and t.emitter.stats().dropped == 0
    kinds = Counter((e.kind, e.tier, e.src_tier, e.dst_tier, e.reason) for e in events)
    assert kinds[(EventKind.EVICT, Tier.HOST, Tier.NONE, Tier.NONE, Reason.CAPACITY)] > 0  # CPU pressure
    from_disk = 0
    for s in served:
        r = results[s.request_id]
        assert s.exact  # LMCache gave back exactly the bytes it stored
        # kvtrace's lookup hit is LMCache's own answer, and what the retrieve delivered is recoverable
        assert r.reported_hit_tokens == r.logical_hit_tokens == s.lookup_hit, s
        assert r.adopted_tokens == s.retrieved == r.recoverable_hit_tokens, s
        assert not r.unsafe_reuse and not r.missed_reuse
        assert r.verdict is (Verdict.MISS if not s.lookup_hit else Verdict.PARTIAL)  # a hit is always a fetch
        from_disk += r.restore_disk_bytes > 0
        loads = [e for e in events if e.kind is EventKind.LOAD and e.dst_tier is Tier.DEVICE
                 and e.request_id == s.request_id]
        assert sum(e.nbytes * (1 + len(e.more_keys)) for e in loads) == s.retrieved_bytes
    assert from_disk > 0  # some requests came back from disk after the CPU evicted their chunks
    # every stored chunk: committed on the host with its bytes, then written to disk with the same bytes
    commits = [e for e in events if e.kind is EventKind.COMMIT]
    offloads = [e for e in events if e.kind is EventKind.OFFLOAD]
    assert {e.tier for e in commits} == {Tier.HOST} and {e.nbytes for e in commits} == {t.spec.chunk_bytes}
    assert {(e.src_tier, e.dst_tier) for e in offloads} == {(Tier.HOST, Tier.DISK)}
    assert {e.nbytes for e in offloads} == {t.spec.chunk_bytes}
    committed = {k for e in commits for k in (e.block_key, *e.more_keys)}
    assert committed == {k for e in offloads for k in (e.block_key, *e.more_keys)}
    disk = t.engine.storage_manager.storage_backends["LocalDiskBackend"]
    assert committed == {block_key(k) for k in disk.dict}  # kvtrace's names are LMCache's disk keys


def test_evicted_from_cpu_on_disk_is_partial_and_a_cleared_prefix_is_invalidated(traced) -> None:  # noqa: ANN001
    t = traced(cpu_gb=0.0008)  # ~50 chunks of host cache
    a = prompt(1, 4)
    t.driver.serve("a0", a)
    for i in range(8):  # push a's chunks out of the host cache; they stay on disk
        t.driver.serve(f"fill{i}", prompt(100 + i, 8))
    cpu = t.engine.storage_manager.storage_backends["LocalCPUBackend"]
    assert not any(block_key(k) in {block_key(x) for x in cpu.hot_cache} for k in _keys(t, a))
    again = t.driver.serve("a1", a)
    assert again.lookup_hit == again.retrieved == len(a) and again.exact
    t.engine.clear(a)  # a prefix clear: every backend drops a's chunks
    gone = t.driver.serve("a2", a)
    assert gone.lookup_hit == 0
    results = t.results()
    r1, r2 = results["a1"], results["a2"]
    assert r1.verdict is Verdict.PARTIAL and r1.recoverable_hit_tokens == len(a)  # a fetch, from disk:
    assert r1.restore_disk_bytes == 4 * t.spec.chunk_bytes and r1.adopted_tokens == len(a)
    assert r2.verdict is Verdict.PARTIAL and r2.reason is GapReason.INVALIDATED and r2.recoverable_hit_tokens == 0
    assert r2.logical_hit_tokens == len(a)  # the hash still names them: hidden recompute, with its reason


def test_whole_clear_empties_the_host_cache_only(traced) -> None:  # noqa: ANN001
    """LMCache's clear() clears backends that can: the CPU cache. Disk copies stay valid; a chunk
    that was only on the host is gone, and kvtrace says why."""
    with_disk, host_only = traced(cpu_gb=0.01), traced(cpu_gb=0.01, disk=False)
    b = prompt(2, 3)
    for t in (with_disk, host_only):
        t.driver.serve("b0", b)
        wait_for_disk(t.engine)
        t.engine.clear()
        t.driver.serve("b1", b)
    kept, lost = with_disk.results()["b1"], host_only.results()["b1"]
    assert kept.reported_hit_tokens == len(b) and kept.verdict is Verdict.PARTIAL
    assert kept.restore_disk_bytes == 3 * SMALL.chunk_bytes and kept.restore_host_bytes == 0
    assert lost.reported_hit_tokens == 0 and lost.verdict is Verdict.PARTIAL and lost.reason is GapReason.INVALIDATED
    # the clear's (the attach's restart invalidations come first, and are not the clear's)
    resets = [e for e in with_disk.events() if e.kind is EventKind.INVALIDATE and e.reason is not Reason.RESTART]
    assert [(e.tier, e.reason, e.block_key) for e in resets] == [(Tier.HOST, Reason.RESET, 0)]


def test_a_hit_the_retrieve_does_not_deliver_is_reported(traced) -> None:  # noqa: ANN001
    """A chunk file lost behind LMCache's back: its lookup still counts it, the retrieve cannot
    read it (LMCache then drops the key). LMCache's hit rate says hit; kvtrace names the change."""
    t = traced(cpu_gb=0.0008)
    c = prompt(3, 4)
    t.driver.serve("c0", c)
    for i in range(8):
        t.driver.serve(f"fill{i}", prompt(200 + i, 8))
    wait_for_disk(t.engine)
    disk = t.engine.storage_manager.storage_backends["LocalDiskBackend"]
    third = _keys(t, c)[2]
    os.remove(disk.dict[third].path)
    served = t.driver.serve("c1", c)
    assert served.lookup_hit == len(c) and served.retrieved == 2 * t.spec.chunk_size and served.exact
    after = t.driver.serve("c2", c)
    assert after.lookup_hit == len(c)  # c1 computed and stored the lost chunk again
    results = t.results()
    r = results["c1"]
    assert r.reported_hit_tokens == len(c) and r.adopted_tokens == r.recoverable_hit_tokens == 2 * t.spec.chunk_size
    assert r.reason is GapReason.CHANGED_BEFORE_USE and not r.unsafe_reuse
    assert results["c2"].logical_hit_tokens == results["c2"].recoverable_hit_tokens == len(c)
    lost = [e for e in t.events() if e.kind is EventKind.INVALIDATE and e.reason is not Reason.RESTART]
    assert [(e.block_key, e.reason) for e in lost] == [(block_key(third), Reason.CORRUPTION)]


def test_chunks_in_use_survive_a_clear_and_stay_valid(traced) -> None:  # noqa: ANN001
    """LMCache's CPU clear keeps chunks a lookup pinned: kvtrace publishes them again."""
    t = traced(cpu_gb=0.01, disk=False)
    e = prompt(7, 2)
    t.driver.serve("p0", e)
    assert t.engine.lookup(e, lookup_id="p1", pin=True) == len(e)
    t.engine.clear()
    served = t.driver.serve("p1", e)
    assert served.retrieved == len(e) and served.exact
    r = t.results()["p1"]
    assert r.adopted_tokens == r.recoverable_hit_tokens == len(e) and not r.unsafe_reuse


def test_with_the_hot_cache_off_the_disk_write_commits(traced) -> None:  # noqa: ANN001
    t = traced(cpu_gb=0.01)
    t.engine.set_hot_cache(False)
    f = prompt(8, 3)
    t.driver.serve("h0", f)
    again = t.driver.serve("h1", f)
    assert again.retrieved == len(f) and again.exact
    events = t.events()
    assert {(e.kind, e.tier) for e in events if e.kind is EventKind.COMMIT} == {(EventKind.COMMIT, Tier.DISK)}
    assert not [e for e in events if e.kind is EventKind.OFFLOAD]
    r = t.results()["h1"]
    assert r.adopted_tokens == r.recoverable_hit_tokens == len(f) and r.restore_disk_bytes == 3 * t.spec.chunk_bytes


def test_tenants_tags_keep_their_chunks_apart(traced) -> None:  # noqa: ANN001
    t = traced(cpu_gb=0.01)
    d = prompt(4, 2)
    t.driver.serve("x0", d, tenant="alice")
    t.driver.serve("x1", d, tenant="alice")
    t.driver.serve("x2", d, tenant="bob")
    results = t.results()
    assert results["x1"].adopted_tokens == len(d) and not results["x1"].cross_tenant
    assert results["x2"].reported_hit_tokens == results["x2"].logical_hit_tokens == 0  # bob shares nothing
    commits = [e for e in t.events() if e.kind is EventKind.COMMIT]
    assert {e.tenant for e in commits} == {"tenant=alice", "tenant=bob"}


def test_a_broken_or_full_sink_never_fails_a_store_or_retrieve(tmp_path: Path) -> None:
    spec = replace(SMALL, cpu_gb=0.004, disk_path=str(tmp_path / "d"))
    for sink_fault in ("raise", "stall"):
        sink = MemorySink()
        if sink_fault == "raise":
            sink.raise_error = RuntimeError("sink down")
        else:
            sink.delay_s = 5.0
        t = Traced(spec, sink, BatchConfig(max_queue_size=8, max_export_batch_size=4))
        try:
            served = [t.driver.serve(f"r{i}", prompt(i % 3, 3)) for i in range(12)]
            assert all(s.exact for s in served) and served[-1].retrieved == 3 * spec.chunk_size
            assert t.shim.errors == 0
            assert t.emitter.stats().dropped > 0  # counted, never blocking
        finally:
            t.sink.delay_s = 0.0
            t.close()


def test_a_failing_hook_is_counted_and_lmcache_goes_on(traced, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    t = traced(cpu_gb=0.004)

    def broken(_key: object) -> int:
        raise RuntimeError("kvtrace bug")

    monkeypatch.setattr("kvtrace.instrumentation.lmcache.shim.block_key", broken)
    a = prompt(5, 2)
    t.driver.serve("f0", a)
    again = t.driver.serve("f1", a)
    assert again.lookup_hit == again.retrieved == len(a) and again.exact
    assert t.shim.errors > 0


def test_uninstall_restores_lmcache(traced) -> None:  # noqa: ANN001
    t = traced(cpu_gb=0.004)
    t.shim.uninstall()
    t.driver.serve("u0", prompt(6, 2))
    # only what the shim said when installed: the attach and its invalidations
    assert [e.kind for e in t.events()] == [EventKind.ATTACH, EventKind.INVALIDATE, EventKind.INVALIDATE]


def test_a_restart_under_the_same_name_holds_nothing_the_old_engine_did(tmp_path: Path) -> None:
    """An LMCache engine stops and another starts under the same instance name on the same disk
    folder. The old one held a prompt's chunks on host and disk; the new one finds none (its disk
    index starts empty) and computes the prompt: nothing is reported recoverable. Without the
    host's restart invalidation, or the disk's, the old copies would look held there, a fetch
    LMCache passed up. What the new engine stores itself is reused safely."""
    spec = replace(SMALL, cpu_gb=0.01, disk_gb=1.0, disk_path=str(tmp_path / "disk"))
    sink = MemorySink()
    a = prompt(9, 3)
    old = Traced(spec, sink)
    try:
        old.driver.serve("old", a)
        assert old.driver.serve("old-again", a).retrieved == len(a)
        wait_for_disk(old.engine)
        assert old.shim.errors == 0
    finally:
        old.close()
    new = Traced(spec, sink)  # a new process: its own engine and emitter, the same name and folder
    try:
        first, again = new.driver.serve("new", a), new.driver.serve("new-again", a)
        events = new.events()
        assert new.shim.errors == 0
    finally:
        new.close()
    assert first.lookup_hit == 0 and again.retrieved == len(a) and again.exact
    assert [e.kind for e in events].count(EventKind.ATTACH) == 2
    results = {r.request_id: r for r in reconstruct(events)}
    assert results["old-again"].adopted_tokens == results["old-again"].recoverable_hit_tokens == len(a)
    r = results["new"]
    assert r.recoverable_hit_tokens == 0 and not r.missed_reuse and not r.unsafe_reuse
    s = results["new-again"]
    assert s.adopted_tokens == s.recoverable_hit_tokens == len(a) and not s.unsafe_reuse
    assert r.restore_host_bytes == r.restore_disk_bytes == 0
    for tier in (Tier.HOST, Tier.DISK):
        kept = [e for e in events if not (e.reason is Reason.RESTART and e.tier is tier)]
        stale = {x.request_id: x for x in reconstruct(kept)}["new"]
        assert stale.recoverable_hit_tokens == len(a), tier  # a fetch from there, as if it still held them
        assert (stale.restore_host_bytes if tier is Tier.HOST else stale.restore_disk_bytes) > 0, tier


def _keys(t: Traced, tokens: list[int]) -> list:
    return [key for _, _, key in t.engine.token_database.process_tokens(tokens=tokens)]


def test_kv_is_a_function_of_token_and_position() -> None:
    x = kv_for(SMALL, [5, 6, 7])
    assert x.shape == (2, 1, 3, 8) and torch.equal(kv_for(SMALL, [5, 6, 7, 9])[:, :, :3], x)
