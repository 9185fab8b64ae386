"""HiCache on CPU: device -> host backup, device eviction, load back, a file storage round trip
and prefetch, each seen with its tiers, on both tree cores, with a sliding window's and Mamba's
state beside the KV.

The accelerator-only copy paths of HiCache's host tier get CPU stand-ins
(`kvtrace.instrumentation.sglang.cpu.patch_hicache_for_cpu`); the tree, the controller, the
host pool and the file storage backend are SGLang's own.
"""

from __future__ import annotations

import time
from array import array
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from kvtrace.analysis.costs import transfer_samples
from kvtrace.analysis.reconstruct import reconstruct
from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.identity import Identity
from kvtrace.instrumentation.sglang.cpu import patch_hicache_for_cpu
from kvtrace.instrumentation.sglang.driver import COMPONENTS, Driver, DriverConfig, Mix, build_cache, enable_hicache
from kvtrace.instrumentation.sglang.keys import new_chain
from kvtrace.instrumentation.sglang.recipe import recipe_from_cache
from kvtrace.instrumentation.sglang.shim import RadixCacheShim
from kvtrace.instrumentation.sinks.memory import MemorySink
from kvtrace.schema import EventKind
from kvtrace.schema.arrow import to_arrow
from kvtrace.schema.kinds import Reason, Tier
from kvtrace.schema.verdicts import GapReason, Verdict

# After kvtrace's SGLang driver, which puts a torchvision stand-in in place before the first
# `import sglang` (SGLang's config package imports torchvision).
# isort: split
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle, EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

PAGE = 4
PROMPT = list(range(100, 117))  # four full pages and one token
KEYS = new_chain(None, None).extend(array("q", PROMPT[:16]), PAGE).tolist()


def shimmed(config: DriverConfig,
            storage: Path | None = None) -> tuple[Any, Driver, MemorySink, BatchEmitter, RadixCacheShim]:
    """A cache with the shim, then HiCache's tiers (host, and storage under `storage`): the
    shim follows tiers added after it, as SGLang adds them."""
    cache, allocator, pool = build_cache(config)
    sink = MemorySink()
    emitter = BatchEmitter(sink, BatchConfig(), register_atexit=False)
    shim = RadixCacheShim(cache, emitter, Identity(instance="sglang-0", model="tiny")).install()
    enable_hicache(cache, None if storage is None else str(storage))
    return cache, Driver(cache, allocator, pool, config, shim), sink, emitter, shim


def settle(cache: Any) -> None:
    """Run the scheduler's per-step HiCache poll until backups and storage writes are acked."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        cache.check_hicache_events()
        if not cache.ongoing_write_through and not cache.ongoing_backup:
            return
        time.sleep(0.01)
    raise AssertionError("HiCache never acknowledged its writes")


class Rig:
    def __init__(self, core: str, storage: Path) -> None:
        self.config = DriverConfig(mix=Mix.FULL, tree_core=core, page_size=PAGE, kv_tokens=256)
        self.cache, self.driver, self.sink, self.emitter, self.shim = shimmed(self.config, storage)
        self.seen = 0

    def settle(self) -> None:
        settle(self.cache)

    def prefetch(self, rid: str, node: Any, tokens: list[int]) -> int:
        """Fetch `tokens` from storage under a host node, as the scheduler does; the tokens it loaded."""
        handle = CacheRequestHandle(rid, 0)
        self.cache.prefetch_from_storage(handle, node, array("q", tokens), self.cache.get_last_hash_value(node))
        deadline = time.monotonic() + 20  # ~20 ms here; in one loaded CI run, 2 s was too short
        while not self.cache.check_prefetch_progress(handle) and time.monotonic() < deadline:
            self.cache.check_hicache_events()
            time.sleep(0.01)
        return self.cache.pop_prefetch_loaded_span(handle)[0]

    def new(self) -> list:
        self.emitter.force_flush()
        out, self.seen = self.sink.events[self.seen :], len(self.sink.events)
        return out


def _keys(e) -> list[int]:  # noqa: ANN001
    return [e.block_key, *e.more_keys]


@pytest.mark.parametrize("core", ["rust", "python"])
def test_tiers_round_trip_with_their_events(core: str, tmp_path: Path) -> None:
    rig = Rig(core, tmp_path)
    cache = rig.cache
    first = rig.driver.serve("r1", PROMPT)
    rig.settle()
    events = rig.new()
    assert first.reused == 0
    commit = next(e for e in events if e.kind is EventKind.COMMIT)
    assert commit.tier is Tier.DEVICE and _keys(commit) == KEYS
    offloads = [e for e in events if e.kind is EventKind.OFFLOAD]
    assert [(e.src_tier, e.dst_tier) for e in offloads] == [(Tier.DEVICE, Tier.HOST), (Tier.HOST, Tier.DISK)]
    assert all(_keys(e) == KEYS and e.duration_ns > 0 for e in offloads)
    stored = sorted({p.name.split("__")[0] for p in tmp_path.iterdir()})  # SGLang's names for the pages
    assert sorted(rig.shim.hicache.names.get(name) for name in stored) == sorted(KEYS)

    cache.evict(EvictParams(num_tokens=256))  # device copy goes, host keeps it
    evict = [e for e in rig.new() if e.kind is EventKind.EVICT]
    assert [(e.tier, _keys(e)) for e in evict] == [(Tier.DEVICE, KEYS)]

    second = rig.driver.serve("r2", PROMPT)  # host hit, loaded back before it runs
    assert second.host_hit == 16 and second.loaded == 16
    events = rig.new()
    load = next(e for e in events if e.kind is EventKind.LOAD)
    assert (load.src_tier, load.dst_tier, _keys(load)) == (Tier.HOST, Tier.DEVICE, KEYS)
    adopt = next(e for e in events if e.kind is EventKind.ADOPT)
    assert list(zip(adopt.reused_tiers, adopt.reused_tokens, strict=True)) == [(Tier.HOST, 16)]

    cache.evict(EvictParams(num_tokens=256))
    assert cache.evict_host(256) == 16  # now only the storage tier has the prefix
    evict = [(e.tier, _keys(e)) for e in rig.new() if e.kind is EventKind.EVICT]
    assert evict == [(Tier.DEVICE, KEYS), (Tier.HOST, KEYS)]

    probe = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", PROMPT[:-1]))))
    assert probe.device_prefix_len == probe.host_hit_length == 0
    rig.shim.hicache.names.clear()  # as if another process had stored them: keyed from their tokens
    t0 = time.monotonic_ns()
    assert rig.prefetch("r3", probe.last_host_node, PROMPT[:16]) == 16
    t1 = time.monotonic_ns()
    prefetch = next(e for e in rig.new() if e.kind is EventKind.LOAD)
    assert (prefetch.src_tier, prefetch.dst_tier, _keys(prefetch)) == (Tier.DISK, Tier.HOST, KEYS)
    # for the request that waited for it, timed from SGLang's start of the prefetch: the cost of
    # a fetch from storage, which the load-versus-recompute analysis fits
    assert prefetch.request_id == "r3" and prefetch.in_flight and 0 < prefetch.duration_ns <= t1 - t0
    assert transfer_samples(pl.from_arrow(to_arrow([prefetch])))[["src_tier", "dst_tier"]].rows() == [("disk", "host")]

    assert rig.prefetch("r-miss", probe.last_host_node, list(range(5000, 5016))) == 0  # nobody stored it
    cache.revoke_pending_prefetch(CacheRequestHandle("r-none", 0))  # SGLang's release path: nothing in flight
    assert (rig.shim.hicache.prefetches.started, rig.shim.hicache.prefetches.revoked) == (2, 1)
    assert not [e for e in rig.new() if e.kind is EventKind.LOAD]  # a revoked prefetch lands nothing

    third = rig.driver.serve("r3", PROMPT)
    assert third.loaded == 16
    assert cache.clear_storage_backend()
    cache.reset()
    after = rig.driver.serve("r4", PROMPT)
    assert after.reused == 0
    events = rig.new()
    invalidated = {e.tier for e in events if e.kind is EventKind.INVALIDATE}
    assert {Tier.DISK, Tier.DEVICE, Tier.HOST} <= invalidated
    assert all(e.reason is Reason.RESET for e in events if e.kind is EventKind.INVALIDATE)
    assert rig.emitter.shutdown() and rig.shim.errors == 0

    results = {r.request_id: r for r in reconstruct(rig.sink.events, recipe_from_cache(cache))}
    assert results["r2"].verdict is Verdict.PARTIAL and results["r2"].restore_host_bytes > 0
    assert results["r2"].recoverable_hit_tokens == 16 == results["r2"].adopted_tokens
    storage_only = next(r for r in results.values() if r.request_id.startswith("anon-"))
    assert storage_only.verdict is Verdict.PARTIAL and storage_only.reason is GapReason.NONE
    assert storage_only.resident_hit_tokens == 0 and storage_only.recoverable_hit_tokens == 16
    assert storage_only.restore_disk_bytes > 0 and storage_only.restore_host_bytes == 0
    assert results["r3"].verdict is Verdict.PARTIAL and results["r3"].restore_host_bytes > 0
    r4 = results["r4"]  # the reset left the hash naming state that is gone: a hit, none of it usable
    assert r4.verdict is Verdict.PARTIAL and r4.reason is GapReason.INVALIDATED and r4.recoverable_hit_tokens == 0


@pytest.mark.parametrize("core", ["rust", "python"])
def test_a_sliding_window_travels_with_its_pages(core: str) -> None:
    """Full attention + sliding window: the window's state is backed up and loaded back beside
    the KV (SGLang's component transfers); without it the reload would look like unsafe reuse."""
    cache, driver, sink, emitter, shim = shimmed(DriverConfig(mix=Mix.SWA, tree_core=core, page_size=PAGE,
                                                              window=8, kv_tokens=256))
    prompt = list(range(100, 133))
    driver.serve("r1", prompt)
    settle(cache)
    cache.evict(EvictParams(num_tokens=256, swa_num_tokens=256))
    again = driver.serve("r2", prompt)
    assert again.host_hit == 32 and again.loaded == 32
    assert emitter.shutdown() and shim.errors == 0
    moves = {(e.kind, e.component.value, e.src_tier, e.dst_tier): len(_keys(e)) for e in sink.events
             if e.kind in (EventKind.OFFLOAD, EventKind.LOAD)}
    assert moves[(EventKind.LOAD, "sliding_window", Tier.HOST, Tier.DEVICE)] == 8 // PAGE  # the window only
    assert moves[(EventKind.LOAD, "full_attention", Tier.HOST, Tier.DEVICE)] == 32 // PAGE
    assert (EventKind.OFFLOAD, "sliding_window", Tier.DEVICE, Tier.HOST) in moves
    result = next(r for r in reconstruct(sink.events, recipe_from_cache(cache)) if r.request_id == "r2")
    assert result.recoverable_hit_tokens == 32 == result.adopted_tokens and not result.unsafe_reuse
    assert result.verdict is Verdict.PARTIAL


@pytest.mark.parametrize("mix", [Mix.MAMBA, Mix.SWA_MAMBA])
@pytest.mark.parametrize("core", ["rust", "python"])
def test_a_mamba_state_travels_with_its_pages(core: str, mix: Mix) -> None:
    """Full attention + Mamba (+ a window) on 1-token pages, Mamba's host pool page-first as
    SGLang requires. The state kept at the prompt's end is backed up with its KV and loaded
    back once for the tree; SGLang also copies it into the request's own state slot, which is
    the request using it, not a second load. A request that stops one token short finds the
    KV on host but no state at its boundary: a logical hit with nothing recoverable, as SGLang
    says."""
    cache, driver, sink, emitter, shim = shimmed(DriverConfig(mix=mix, tree_core=core, page_size=1, window=8,
                                                              kv_tokens=512, mamba_states=8))
    prompt = list(range(100, 233))
    driver.serve("r1", prompt)
    settle(cache)
    evict = EvictParams(num_tokens=512, swa_num_tokens=512, mamba_num=8)
    cache.evict(evict)
    longer = driver.serve("longer", prompt + list(range(900, 920)))
    assert longer.host_hit == 133 and longer.loaded == 133
    cache.evict(evict)
    short = driver.serve("short", prompt)  # matches 132 tokens: the state is at 133
    assert short.host_hit == 0 and short.full_kv_hit == 132
    assert emitter.shutdown() and shim.errors == 0

    def moved(kind: EventKind, component: str) -> list[int]:
        return [len(_keys(e)) for e in sink.events if e.kind is kind and e.component.value == component]

    assert moved(EventKind.OFFLOAD, "mamba") == [1] and moved(EventKind.LOAD, "mamba") == [1]
    assert sum(moved(EventKind.OFFLOAD, "full_attention")) == sum(moved(EventKind.LOAD, "full_attention")) == 133
    if mix is Mix.SWA_MAMBA:
        assert moved(EventKind.LOAD, "sliding_window") == [8]  # the window only
    results = {r.request_id: r for r in reconstruct(sink.events, recipe_from_cache(cache))}
    assert results["short"].logical_hit_tokens == 132 and results["short"].recoverable_hit_tokens == 0
    assert results["short"].reason is GapReason.NO_CHECKPOINT
    hit = results["longer"]
    assert hit.recoverable_hit_tokens == 133 == hit.adopted_tokens and not hit.unsafe_reuse
    assert hit.verdict is Verdict.PARTIAL and hit.restore_host_bytes > 0


@pytest.mark.parametrize("core", ["rust", "python"])
def test_pages_fetched_under_a_host_node_continue_its_chain(core: str, tmp_path: Path) -> None:
    """A prefix on host and the rest only on storage, stored by another process (its names
    unknown here): the fetched pages are keyed from their tokens, continuing the chain after the
    host node's last page, and get the keys this process gave them when it first served them."""
    rig = Rig(core, tmp_path)
    cache = rig.cache
    head, whole = PROMPT[:8], PROMPT[:16] + [999]
    rig.driver.serve("a", head + [998])  # the tree gets two pages under the root ...
    rig.settle()
    rig.driver.serve("b", whole)  # ... then two more under them: a node of its own
    rig.settle()
    cache.evict(EvictParams(num_tokens=256))
    assert cache.evict_host(8) == 8  # the leaf's host copy goes; the head's stays
    tail_names = [n for n in {p.name.split("__")[0] for p in tmp_path.iterdir()}
                  if rig.shim.hicache.names.get(n) in KEYS[2:]]
    assert len(tail_names) == 2
    for name in tail_names:  # forget the tail's names: as if another process had stored it
        rig.shim.hicache.names._keys.pop(rig.shim.hicache.names.short(name))
    rig.new()
    probe = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", whole[:-1]))))
    assert probe.device_prefix_len == 0 and probe.host_hit_length == 8
    assert rig.prefetch("c", probe.last_host_node, whole[8:16]) == 8
    prefetch = next(e for e in rig.new() if e.kind is EventKind.LOAD)
    assert (prefetch.src_tier, prefetch.dst_tier, _keys(prefetch)) == (Tier.DISK, Tier.HOST, KEYS[2:])
    assert rig.shim.hicache.unnamed_pages == 0
    assert rig.emitter.shutdown() and rig.shim.errors == 0


@pytest.mark.parametrize(("mix", "page"), [(Mix.MAMBA, 1), (Mix.SWA_MAMBA, 1), (Mix.SWA, PAGE)])
@pytest.mark.parametrize("core", ["rust", "python"])
def test_a_state_stored_with_its_pages_comes_back_from_storage(core: str, mix: Mix, page: int,
                                                                  tmp_path: Path) -> None:
    """A window's or Mamba's state is written to storage with the KV, under the names of its
    trailing pages, and a prefetch stages it on host again. Without following it, a resume
    from storage would look like KV with no state at its boundary, and its reuse as unsafe."""
    cache, driver, sink, emitter, shim = shimmed(DriverConfig(mix=mix, tree_core=core, page_size=page, window=8,
                                                              kv_tokens=512, mamba_states=8), tmp_path)
    prompt = list(range(100, 140))
    driver.serve("first", prompt)
    settle(cache)
    deadline = time.monotonic() + 20
    cache.evict(EvictParams(num_tokens=512, swa_num_tokens=512, mamba_num=8))
    assert cache.evict_host(512) == 40  # only storage has the prefix now
    probe = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt))))
    handle = CacheRequestHandle("fetch", 0)
    cache.prefetch_from_storage(handle, probe.last_host_node, array("q", prompt),
                                cache.get_last_hash_value(probe.last_host_node))
    while not cache.check_prefetch_progress(handle) and time.monotonic() < deadline:
        cache.check_hicache_events()
        time.sleep(0.01)
    assert cache.pop_prefetch_loaded_span(handle)[0] == 40
    again = driver.serve("again", prompt + [1])  # resumes at 40, where the state is
    assert again.host_hit == 40 and again.loaded == 40
    assert emitter.shutdown() and shim.errors == 0 and shim.hicache.unnamed_pages == 0

    def moved(component: str, src: Tier, dst: Tier) -> int:
        return sum(len(_keys(e)) for e in sink.events if e.kind in (EventKind.OFFLOAD, EventKind.LOAD)
                   and e.component.value == component and (e.src_tier, e.dst_tier) == (src, dst))

    for component, kept in (("mamba", 1), ("sliding_window", 8 // page)):
        if component in {e.component.value for e in sink.events}:
            assert moved(component, Tier.HOST, Tier.DISK) >= kept
            assert moved(component, Tier.DISK, Tier.HOST) == kept == moved(component, Tier.HOST, Tier.DEVICE)
    fetched = [e for e in sink.events if e.kind is EventKind.LOAD and e.src_tier is Tier.DISK]
    assert len({e.component for e in fetched}) == len(COMPONENTS[mix])  # the KV and each state with it
    assert all(e.request_id == "fetch" for e in fetched)  # the request waited once, for the pages
    assert [(e.component.value, e.in_flight, e.duration_ns > 0) for e in fetched if e.in_flight or e.duration_ns] \
        == [("full_attention", True, True)]
    result = next(r for r in reconstruct(sink.events, recipe_from_cache(cache)) if r.request_id == "again")
    assert result.recoverable_hit_tokens == 40 == result.adopted_tokens and not result.unsafe_reuse
    assert result.verdict is Verdict.PARTIAL


def _page_first_reference(host: list[Any], layers: list[Any], host_slots: list[int], device_slots: list[int],
                          page: int, first_layer: int, to_host: bool) -> None:
    """SGLang's page-first-direct kernels, page by page as its C++ loop goes: host buffer h
    (pages, layers, page, ...) of each part, per-layer device tensors (part 0's layers first)."""
    per_part = len(layers) // len(host)
    for i in range(0, len(host_slots), page):
        host_page, device_start = host_slots[i] // page, device_slots[i]
        for part, buffer in enumerate(host):
            for j in range(per_part):
                device = layers[part * per_part + j]
                if to_host:
                    buffer[host_page, first_layer + j] = device[device_start : device_start + page]
                else:
                    device[device_start : device_start + page] = buffer[host_page, first_layer + j]


@pytest.mark.parametrize(("shape", "parts", "page"), [((2, 5), 2, 4), ((3,), 1, 8), ((1, 4, 2), 1, 1)],
                         ids=["mha-kv", "mla", "mamba-state"])
def test_the_page_first_stand_ins_move_what_the_kernels_would(shape: tuple[int, ...], parts: int, page: int) -> None:
    """The CPU stand-ins for SGLang's page-first-direct copies against a page-by-page rendering
    of its kernels: K and V apart (MHA), one latent buffer (MLA), Mamba's state layout; device
    slots that start off a page boundary; every byte of both sides compared."""
    import torch
    from sglang.srt.mem_cache.pool_host import mha

    patch_hicache_for_cpu()  # what `enable_hicache` installs
    torch.manual_seed(0)
    layers, pages = 3, 10
    device = [torch.randn(64, *shape) for _ in range(layers * parts)]
    host_slots = [s for p in (3, 1, 7) for s in range(p * page, p * page + page)]
    device_slots = [s for start in (9, 40, 21) for s in range(start, start + page)]
    ours, theirs = ([torch.zeros(pages, layers, page, *shape) for _ in range(parts)] for _ in range(2))
    mha.transfer_kv_all_layer_direct_lf_pf(device, ours, torch.tensor(device_slots), torch.tensor(host_slots), page)
    _page_first_reference(theirs, device, host_slots, device_slots, page, 0, to_host=True)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)) and ours[0].any()
    back_ours, back_theirs = ([torch.zeros(64, *shape) for _ in range(parts)] for _ in range(2))
    mha.transfer_kv_per_layer_direct_pf_lf(ours, back_ours, torch.tensor(host_slots), torch.tensor(device_slots),
                                           2, page)
    _page_first_reference(ours, back_theirs, host_slots, device_slots, page, 2, to_host=False)
    assert all(torch.equal(a, b) for a, b in zip(back_ours, back_theirs, strict=True)) and back_ours[0].any()
    assert torch.equal(back_ours[0][9 : 9 + page], device[2][9 : 9 + page])  # layer 2 went there and back


def test_a_storage_tier_attached_at_run_time_is_followed(tmp_path: Path) -> None:
    """SGLang can attach a storage tier to a running engine (`attach_storage_backend`), with a
    new acknowledgement queue: the shim follows the new queue, so writes to disk are reported."""
    import json

    from sglang.srt.environ import envs
    from sglang.srt.runtime_context import get_parallel

    cache, driver, sink, emitter, shim = shimmed(DriverConfig(mix=Mix.FULL, page_size=PAGE, kv_tokens=256))
    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)  # as the engine has it
    with envs.SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR.override(str(tmp_path)):  # read when attached
        ok, why = cache.attach_storage_backend("file", json.dumps({"prefetch_threshold": PAGE}))
    assert ok, why
    driver.serve("r1", PROMPT)
    settle(cache)
    assert emitter.shutdown() and shim.errors == 0
    offloads = [(e.src_tier, e.dst_tier, _keys(e)) for e in sink.events if e.kind is EventKind.OFFLOAD]
    assert offloads == [(Tier.DEVICE, Tier.HOST, KEYS), (Tier.HOST, Tier.DISK, KEYS)]


def test_a_best_effort_prefetch_lands_without_holding_its_request(tmp_path: Path) -> None:
    """Under SGLang's `best_effort` prefetch policy a request is admitted without waiting for
    its prefetch, keeping what has landed by then: the landing's load is timed like any other,
    but not marked as something the request waited on."""
    rig = Rig("rust", tmp_path)
    cache = rig.cache
    rig.driver.serve("r1", PROMPT)
    rig.settle()
    cache.evict(EvictParams(num_tokens=256))
    assert cache.evict_host(256) == 16
    rig.new()
    cache.prefetch_stop_policy = "best_effort"
    probe = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", PROMPT[:-1]))))
    handle = CacheRequestHandle("r2", 0)
    cache.prefetch_from_storage(handle, probe.last_host_node, array("q", PROMPT[:16]),
                                cache.get_last_hash_value(probe.last_host_node))
    deadline = time.monotonic() + 20  # let the copy finish first: best effort keeps only what has landed
    while time.monotonic() < deadline:
        cache.check_hicache_events()
        info = cache.ongoing_prefetch.get(handle)
        if info is None or info.operation.completed_tokens >= 16:
            break
        time.sleep(0.01)
    assert cache.check_prefetch_progress(handle)  # best effort: admitted at its first poll
    assert cache.pop_prefetch_loaded_span(handle)[0] == 16
    (load,) = [e for e in rig.new() if e.kind is EventKind.LOAD]
    assert (load.src_tier, load.dst_tier, _keys(load)) == (Tier.DISK, Tier.HOST, KEYS)
    assert load.request_id == "r2" and not load.in_flight and load.duration_ns > 0
    assert rig.shim.hicache.prefetches.started == 1 and rig.shim.hicache.prefetches.revoked == 0
    assert rig.emitter.shutdown() and rig.shim.errors == 0
