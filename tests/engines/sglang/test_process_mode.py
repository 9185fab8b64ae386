"""The out-of-process mode on SGLang's real cache: the scheduler thread records, a resolver
process names. Its events must be the in-process shim's events, call for call, and the cache
must never wait for it: not when its ring is full, not when it is stopped or gone.

Both shims observe one cache (the in-process one installed first, the capture wrapping it), so
they see the very same calls; SGLang's eviction order between two separate caches is not
deterministic enough to compare two replays.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvtrace.analysis.reconstruct import reconstruct
from kvtrace.instrumentation.attach import distribution_version
from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.identity import Identity
from kvtrace.instrumentation.replay import tokens_of
from kvtrace.instrumentation.sglang.capture import CaptureStats, ProcessShim, unsupported
from kvtrace.instrumentation.sglang.driver import (
    COMPONENTS,
    ComponentType,
    Driver,
    DriverConfig,
    Mix,
    Route,
    build_cache,
    enable_hicache,
)
from kvtrace.instrumentation.sglang.keys import new_chain
from kvtrace.instrumentation.sglang.recipe import recipe_from_cache
from kvtrace.instrumentation.sglang.shim import RadixCacheShim
from kvtrace.instrumentation.sinks.memory import MemorySink
from kvtrace.instrumentation.traces import read_trace
from kvtrace.schema import EventKind
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import ComponentKind, Reason, Tier
from kvtrace.schema.recipes import recipe_from_json
from kvtrace.schema.wire import SPOOL_SUFFIX, decode_batch, read_spool

TRACE = resources.files("kvtrace.cli") / "data" / "mooncake_conversation_head.jsonl.gz"
IDENTITY = Identity(instance="sglang-0", model="tiny")


def prompts(n: int, cut: int = 3000) -> list[tuple[str, list[int]]]:
    return [(r.request_id, tokens_of(r)[:cut]) for r in read_trace(str(TRACE), limit=n)]


def spooled(directory: Path) -> list[Event]:
    out = []
    for path in sorted(directory.glob(f"*{SPOOL_SUFFIX}")):
        with path.open("rb") as f:
            for payload in read_spool(f, path.name).payloads:
                out.extend(msgspec.msgpack.decode(raw, type=Event) for raw in decode_batch(payload).events)
    return out


def comparable(e: Event) -> bytes:
    """An event as it travels, without what differs by emitter (id, sequence, time)."""
    e = msgspec.msgpack.decode(msgspec.msgpack.encode(e), type=Event)
    return msgspec.msgpack.encode(msgspec.structs.replace(e, ts_ns=0, source_id=0, seq=0))


@pytest.fixture
def spool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The resolver configures its sink from kvtrace's settings, as in an engine: a spool here."""
    monkeypatch.setenv("KVTRACE_SINK", "spool")
    monkeypatch.setenv("KVTRACE_SPOOL_DIR", str(tmp_path))
    monkeypatch.setenv("KVTRACE_SCHEDULE_DELAY_MILLIS", "50")
    return tmp_path


class Both:
    """Tells both shims what each request reused, as the scheduler's hook would."""

    def __init__(self, *shims: object) -> None:
        self.shims = shims

    def record_admission(self, *args: object, **kwargs: object) -> None:
        for shim in self.shims:
            shim.record_admission(*args, **kwargs)  # type: ignore[attr-defined]


def both_modes(config: DriverConfig, built: tuple[Any, Any, Any], replay: Callable[[Driver], None],
               rate: float = 1.0, ring_bytes: int = 64 << 20, longest: int = 0) -> tuple[MemorySink, CaptureStats]:
    """Replay through one cache observed by both shims; the in-process shim's events and the
    capture's counters. Usage is sampled once (the first lookup), so both modes sample at the
    same call. `longest`: the engine's context length, as the plugin gives it."""
    cache, allocator, pool = built
    sink = MemorySink()
    emitter = BatchEmitter(sink, BatchConfig(max_queue_size=1 << 20), register_atexit=False)
    inline = RadixCacheShim(cache, emitter, IDENTITY, sample_rate=rate, usage_interval_s=3600,
                            max_model_len=longest).install()
    process = ProcessShim(cache, IDENTITY, sample_rate=rate, usage_interval_s=3600, ring_bytes=ring_bytes,
                          max_model_len=longest).start()
    try:
        replay(Driver(cache, allocator, pool, config, Both(inline, process)))
        assert process.flush(60)
        stats = process.stats()
    finally:
        process.close()
    assert emitter.shutdown() and inline.errors == 0
    return sink, stats


def _settle(cache: Any) -> None:
    """The scheduler's per-step poll until backups and storage writes are acknowledged."""
    deadline = time.monotonic() + 20
    while (cache.ongoing_write_through or cache.ongoing_backup) and time.monotonic() < deadline:
        cache.check_hicache_events()
        time.sleep(0.01)


def _timeless(e: Event) -> bytes:
    """An event as `comparable`, without durations (each mode reads its own clock) and with a
    lookup that had no request unnamed (each process names it by an object of its own)."""
    anonymous = e.request_id.startswith("anon-")
    return comparable(msgspec.structs.replace(e, duration_ns=0, request_id="anon" if anonymous else e.request_id))


@pytest.mark.parametrize(("mix", "route", "rate"), [(Mix.FULL, Route.CACHE, 1.0), (Mix.MAMBA, Route.CACHE, 1.0),
                                                   (Mix.SWA, Route.CACHE, 1.0), (Mix.SWA_MAMBA, Route.CACHE, 1.0),
                                                   (Mix.FULL, Route.SCHEDULER, 1.0), (Mix.FULL, Route.SCHEDULER, 0.5)])
def test_the_resolver_emits_what_the_in_process_shim_does(mix: Mix, route: Route, rate: float, spool: Path) -> None:
    """Call for call. On the scheduler route the prompt's insert happens inside the request's
    checkpoint and names the tokens its lookup sent instead of carrying them again. Sampled,
    usage is taken after the first lookup either mode reports. With a sliding window, its
    pages are named in the window pool's numbering, which the allocator's live table gives:
    the capture sends what the shim reads of it."""
    paged = mix in (Mix.MAMBA, Mix.SWA_MAMBA)  # SGLang's Mamba mixes need 1-token pages
    config = DriverConfig(mix=mix, page_size=1 if paged else 16, kv_tokens=1 << 15, route=route)
    cache, allocator, pool = built = build_cache(config)

    def replay(driver: Driver) -> None:
        for rid, tokens in prompts(60):
            driver.serve(rid, tokens)
        cache.reset()  # as SGLang's flush_cache: it frees nothing through actions, and must reach the resolver
        pool.clear()
        allocator.clear()
        for rid, tokens in prompts(64)[60:]:
            driver.serve(rid, tokens)

    sink, stats = both_modes(config, built, replay, rate)
    assert stats.dropped == 0 and stats.errors == 0 and stats.resolver_errors == 0 and stats.skipped == 0
    assert stats.resolved == stats.records
    theirs = spooled(spool)
    kinds = {e.kind for e in theirs}
    assert {EventKind.LOOKUP, EventKind.COMMIT, EventKind.EVICT, EventKind.ADOPT, EventKind.USAGE,
            EventKind.INVALIDATE} <= kinds  # evictions happened, usage was sampled, the reset came through
    assert [comparable(e) for e in theirs] == [comparable(e) for e in sink.events]
    if mix in (Mix.SWA, Mix.SWA_MAMBA):  # the window's own pages were named, committed and evicted
        window = COMPONENTS[mix].index(ComponentType.SWA)
        assert {EventKind.COMMIT, EventKind.EVICT} <= {e.kind for e in theirs if e.group_id == window}


@pytest.mark.parametrize("mix", [Mix.FULL, Mix.SWA, Mix.SWA_MAMBA])
def test_each_mode_attaches_once_first_with_the_caches_own_recipe(mix: Mix, spool: Path) -> None:
    """Before anything else, once, each mode says what the engine is: its release, model, context
    length, page size and the cache's recipe, then the device and host tiers invalidated (a new
    process holds nothing there). The resolver says it with what the engine side read. Judged
    by that recipe, the lookups come out as by the recipe the tests derive themselves."""
    paged = mix is Mix.SWA_MAMBA  # SGLang's Mamba mixes need 1-token pages
    config = DriverConfig(mix=mix, page_size=1 if paged else 16, kv_tokens=1 << 15)
    cache, allocator, pool = built = build_cache(config)
    recipe = recipe_from_cache(cache)

    def replay(driver: Driver) -> None:
        for rid, tokens in prompts(24):
            driver.serve(rid, tokens)

    sink, stats = both_modes(config, built, replay, longest=32_768)
    assert stats.dropped == 0 and stats.errors == 0 and stats.resolver_errors == 0
    ours, theirs = sink.events, spooled(spool)
    for events in (ours, theirs):
        attach = events[0]
        assert attach.kind is EventKind.ATTACH and [e.kind for e in events].count(EventKind.ATTACH) == 1
        assert recipe_from_json(attach.recipe) == recipe
        assert (attach.engine, attach.engine_version, attach.model, attach.max_model_len, attach.block_size) == (
            "sglang", distribution_version("sglang"), "tiny", 32_768, config.page_size)
        assert attach.engine_version  # the installed release
        assert [(e.kind, e.tier, e.reason) for e in events[1:3]] == [
            (EventKind.INVALIDATE, Tier.DEVICE, Reason.RESTART), (EventKind.INVALIDATE, Tier.HOST, Reason.RESTART)]
        assert Reason.RESTART not in {e.reason for e in events[3:]}
        published = reconstruct(events)  # no recipe given: the one the engine published
        assert published == reconstruct(events, recipe)
        assert sum(r.recoverable_hit_tokens for r in published) > 0  # a replay with reuse to judge
    assert [comparable(e) for e in theirs] == [comparable(e) for e in ours]


@pytest.mark.parametrize("mode", ["inline", "process"])
def test_a_restart_under_the_same_name_holds_nothing_the_old_process_did(mode: str, spool: Path) -> None:
    """An engine stops and another starts under the same instance name, with an empty cache.
    The old one left one prompt on device (and host) and another on host only (device evicted);
    the new one asks for both and computes them. Neither is reported recoverable (no missed
    reuse): its attach invalidated both tiers. Without the device's, the first would look
    missed; without the host's, the second."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    config = DriverConfig(page_size=4, kv_tokens=256)
    on_host, on_device = list(range(100, 141)), list(range(500, 541))
    sink = MemorySink()

    def run(serve: Callable[[Driver, Any], None]) -> None:
        cache, allocator, pool = build_cache(config)
        enable_hicache(cache)
        if mode == "inline":  # a new process: its own emitter (another source), the same sink
            emitter = BatchEmitter(sink, BatchConfig(), register_atexit=False)
            shim: Any = RadixCacheShim(cache, emitter, IDENTITY, usage_interval_s=0).install()
        else:
            shim = ProcessShim(cache, IDENTITY, usage_interval_s=0).start()
        try:
            serve(Driver(cache, allocator, pool, config, shim), cache)
            _settle(cache)
            if mode == "process":
                assert shim.flush(60) and shim.stats().resolver_errors == 0
        finally:
            if mode == "inline":
                shim.uninstall()
                assert emitter.shutdown() and shim.errors == 0
            else:
                shim.close()

    def first(driver: Driver, cache: Any) -> None:
        driver.serve("old-host", on_host)
        _settle(cache)  # backed up to host
        cache.evict(EvictParams(num_tokens=256))  # device only: host keeps it
        assert driver.serve("old-host-again", on_host).loaded == 40
        cache.evict(EvictParams(num_tokens=256))
        driver.serve("old-device", on_device)

    def second(driver: Driver, cache: Any) -> None:
        assert driver.serve("new-host", on_host).reused == 0  # nothing survived the old process
        assert driver.serve("new-device", on_device).reused == 0

    run(first)
    run(second)
    events = sorted(sink.events if mode == "inline" else spooled(spool), key=lambda e: (e.ts_ns, e.source_id, e.seq))
    assert [e.kind for e in events].count(EventKind.ATTACH) == 2
    results = {r.request_id: r for r in reconstruct(events)}
    assert results["old-host-again"].restore_host_bytes > 0  # the old process did hold it on host
    for rid in ("new-host", "new-device"):
        assert results[rid].recoverable_hit_tokens == 0 and not results[rid].missed_reuse, rid
    for tier, rid in ((Tier.DEVICE, "new-device"), (Tier.HOST, "new-host")):
        kept = [e for e in events if not (e.reason is Reason.RESTART and e.tier is tier)]
        stale = {r.request_id: r for r in reconstruct(kept)}[rid]
        assert stale.recoverable_hit_tokens == 40 and stale.missed_reuse, (tier, rid)


def test_a_ring_that_wraps_many_times_is_followed_record_for_record(spool: Path) -> None:
    """The ring reused lap after lap, as in any engine that runs long enough (the other tests'
    rings never fill once): the SGLang records, padding at each lap's end included, come
    through as they went in. Flushes keep the small ring from dropping. (The race of a position
    read while it is stored is held off in `tests/test_ring.py`, where it showed every time.)"""
    config = DriverConfig(kv_tokens=1 << 15, route=Route.SCHEDULER)
    cache, allocator, pool = built = build_cache(config)
    laps = []

    def replay(driver: Driver) -> None:
        process = driver.shim.shims[1]
        for i, (rid, tokens) in enumerate(prompts(64)):
            driver.serve(rid, tokens)
            if i % 4 == 3:
                assert process.flush(60)
        laps.append(process.ring.position // process.ring.size)

    sink, stats = both_modes(config, built, replay, ring_bytes=1 << 18)
    assert laps[0] >= 4
    assert stats.dropped == 0 and stats.errors == 0 and stats.resolver_errors == 0 and stats.resolved == stats.records
    assert [comparable(e) for e in spooled(spool)] == [comparable(e) for e in sink.events]


def test_a_stopped_resolver_never_stalls_the_cache_and_the_loss_is_reported(spool: Path) -> None:
    config = DriverConfig(kv_tokens=1 << 15)
    reference = Driver(*build_cache(config), config)
    cache, allocator, pool = build_cache(config)
    # 128 KiB: room for one request's records (~51 KB here) and the padding a wrap can waste
    process = ProcessShim(cache, IDENTITY, ring_bytes=1 << 17, usage_interval_s=0).start()
    try:
        assert process.flush(60)  # up and reading
        os.kill(process.process.pid, signal.SIGSTOP)
        driver = Driver(cache, allocator, pool, config, process)
        started = time.monotonic()
        for rid, tokens in prompts(40):
            assert driver.serve(rid, tokens) == reference.serve(rid, tokens)  # the cache is unaffected
        assert time.monotonic() - started < 60
        assert process.stats().dropped > 0  # the ring filled and refused, counted
        os.kill(process.process.pid, signal.SIGCONT)
        assert process.flush(60)  # the backlog read, and the loss told (it goes ahead of the flush)
        for rid, tokens in prompts(45)[40:]:  # one at a time: this small ring holds one request
            driver.serve(rid, tokens)
            assert process.flush(60)
        stats = process.stats()
    finally:
        process.close()
    assert stats.lost_resets >= 1 and stats.resolver_errors == 0
    events = spooled(spool)
    # the loss's resets (the attach's restart invalidations come first, and are not the loss's)
    resets = [e for e in events if e.kind is EventKind.INVALIDATE and e.reason is not Reason.RESTART]
    assert resets and all(e.tier is Tier.DEVICE and e.reason is Reason.EXPLICIT and e.block_key == 0 for e in resets)
    # What got through after the loss is still named and committed.
    assert any(e.kind is EventKind.COMMIT for e in events[events.index(resets[-1]):])


def test_a_dead_resolver_costs_the_cache_nothing(spool: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = DriverConfig(kv_tokens=1 << 15)
    cache, allocator, pool = build_cache(config)
    process = ProcessShim(cache, IDENTITY, ring_bytes=1 << 16, usage_interval_s=0).start()
    try:
        process.process.kill()
        process.process.wait(10)
        driver = Driver(cache, allocator, pool, config, process)
        with caplog.at_level("ERROR", logger="kvtrace.sglang"):
            for rid, tokens in prompts(20):
                driver.serve(rid, tokens)
        assert "resolver process has exited" in caplog.text
        started = time.monotonic()
        assert not process.flush(30)  # says so at once instead of waiting out the timeout
        assert time.monotonic() - started < 5
        assert process.capture.errors == 0
        assert not process.capture.hooks  # it noticed and stopped recording: the cache is unwrapped
    finally:
        process.close()


def test_a_new_request_object_under_a_known_id_is_named_by_its_own_tokens(spool: Path) -> None:
    """No admission between two requests under one id: the second one's ask is a repeat (no
    tokens travel) but comes from a new object, and its checkpoint must carry its own tokens,
    not name the first one's."""
    config = DriverConfig(kv_tokens=1 << 15, route=Route.SCHEDULER)
    cache, allocator, pool = build_cache(config)
    sink = MemorySink()
    emitter = BatchEmitter(sink, BatchConfig(), register_atexit=False)
    inline = RadixCacheShim(cache, emitter, IDENTITY, usage_interval_s=0).install()
    process = ProcessShim(cache, IDENTITY, usage_interval_s=0).start()
    try:
        driver = Driver(cache, allocator, pool, config)  # tells neither shim of admissions
        first, second = list(range(10_000, 13_000)), list(range(50_000, 53_000))  # both miss: a repeat
        for tokens in (first, second):
            assert driver.serve("same-id", tokens).reused == 0
        assert process.flush(60)
        stats = process.stats()
    finally:
        process.close()
    assert emitter.shutdown() and inline.errors == 0 and stats.resolver_errors == 0 and stats.lost_resets == 0
    commits = [e for e in sink.events if e.kind is EventKind.COMMIT]
    assert len(commits) == 2 and commits[0].block_key != commits[1].block_key
    assert [comparable(e) for e in spooled(spool)] == [comparable(e) for e in sink.events]


@pytest.mark.parametrize("inside", ["an eviction after the insert", "the request's lookup before it"])
def test_calls_inside_a_checkpoint_keep_the_modes_in_step(inside: str, spool: Path) -> None:
    """The capture opens a checkpoint lazily, with the first record inside it, and holds an
    insert's INSERTED back to fold the checkpoint's END into it. SGLang 0.5.23 makes no other
    wrapped call inside a checkpoint; one that did must still be recorded in the engine's
    order: an eviction after the insert behind the held INSERTED (else the resolver's calls
    never close again and no commit follows; this case fails without that), a lookup of the
    request ahead of the insert inside the checkpoint that lookup's record opens."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    config = DriverConfig(kv_tokens=1 << 15, route=Route.SCHEDULER)
    cache, allocator, pool = built = build_cache(config)
    into_tree = cache.checkpoint_into_tree

    def checkpoint_into_tree(req: object, *args: object, **kwargs: object) -> None:
        if inside.startswith("the request's lookup"):
            cache.match_prefix(MatchPrefixParams(key=RadixKey(req.origin_input_ids), req=req))  # type: ignore[attr-defined]
        into_tree(req, *args, **kwargs)
        if inside.startswith("an eviction"):
            cache.evict(EvictParams(num_tokens=64))

    cache.checkpoint_into_tree = checkpoint_into_tree

    def replay(driver: Driver) -> None:
        for rid, tokens in prompts(30):
            driver.serve(rid, tokens)

    sink, stats = both_modes(config, built, replay)
    assert stats.dropped == 0 and stats.resolver_errors == 0 and stats.lost_resets == 0
    ours = [e.kind for e in sink.events if e.reason is not Reason.RESTART]  # less the attach's invalidations
    assert ours.count(EventKind.COMMIT) >= 25 and EventKind.EVICT in ours
    assert EventKind.INVALIDATE not in ours
    assert [comparable(e) for e in spooled(spool)] == [comparable(e) for e in sink.events]


@pytest.mark.parametrize("locked", [False, True], ids=["rebuilt", "recovered-under-a-lock"])
def test_a_window_restored_over_its_tombstone_is_named_alike_in_both_modes(locked: bool, spool: Path) -> None:
    """A prompt's window evicted while its full-attention KV stays (a tombstone), then the prompt
    inserted again. Unlocked, SGLang frees the old full-attention slots and rebuilds the window
    from the new ones; under a running request's lock, it keeps the locked slots and moves the
    incoming window's table entries onto them (`RecoverSWAWithLockedFull`). The shim reads the
    table after the action: the capture must send what it holds then, not before. The window
    pool starts 37 pages in, so its numbering is not the full pool's."""
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    config = DriverConfig(mix=Mix.SWA, kv_tokens=1 << 15)
    cache, allocator, pool = built = build_cache(config)
    allocator.swa_attn_allocator.alloc(37 * 16)  # held for good: the two numberings differ
    actions: list[str] = []
    apply = cache._apply_cache_action

    def seen(action: Any) -> Any:
        actions.append(type(action).__name__)
        return apply(action)

    cache._apply_cache_action = seen  # under both shims: what SGLang did, in order
    prompt = list(range(1000, 3048))

    def replay(driver: Driver) -> None:
        driver.serve("first", prompt)
        if locked:  # a running request holds the prompt's pages
            req = driver._req("running", array("q", prompt))
            node = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt)), req=req)).last_device_node
            lock = cache.inc_lock_ref(node)
        cache.evict(EvictParams(swa_num_tokens=4096))  # the window only: a tombstone
        actions.clear()
        assert driver.serve("again", prompt).full_kv_hit > 0  # the KV was still there
        driver.serve("longer", prompt + [7] * 64)
        if locked:
            cache.dec_lock_ref(node, lock.to_dec_params())
        cache.evict(EvictParams(num_tokens=1 << 15, swa_num_tokens=1 << 15))  # every window freed by its name
        for rid, tokens in prompts(20):
            driver.serve(rid, tokens)

    sink, stats = both_modes(config, built, replay)
    assert ("RecoverSWAWithLockedFull" if locked else "SWARebuild") in actions  # the case this test is about
    assert stats.dropped == 0 and stats.errors == 0 and stats.resolver_errors == 0 and stats.lost_resets == 0
    window = COMPONENTS[Mix.SWA].index(ComponentType.SWA)
    evicted = {k for e in sink.events if e.kind is EventKind.EVICT and e.group_id == window
               for k in (e.block_key, *e.more_keys)}
    restored = [e for e in sink.events if e.kind is EventKind.COMMIT and e.group_id == window
                and e.block_key in evicted]
    assert restored  # the window's pages are committed again under their names
    assert [comparable(e) for e in spooled(spool)] == [comparable(e) for e in sink.events]


@pytest.mark.parametrize("mix", list(Mix))
def test_hicaches_host_tier_is_followed_alike_in_both_modes(mix: Mix, spool: Path) -> None:
    """HiCache's host tier on CPU (the accelerator copies stood in): every insert backed up to
    host, acknowledged at the scheduler's poll, host pages evicted, host hits loaded back. The
    capture records each copy where the in-process hooks read it, with the time it read; the
    resolver replays them through the same hooks. Durations are each mode's own clock reads, so
    they are compared apart. With Mamba, a request asked again goes one token further, to resume
    from the state kept at the prompt's end."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    paged = mix in (Mix.MAMBA, Mix.SWA_MAMBA)  # SGLang's Mamba mixes need 1-token pages
    config = DriverConfig(mix=mix, page_size=1 if paged else 16, kv_tokens=1 << 15)
    cache, allocator, pool = built = build_cache(config)
    enable_hicache(cache, host_ratio=2)
    requests = prompts(60)

    def serve(driver: Driver, batch: list[tuple[str, list[int]]]) -> None:
        for rid, tokens in batch:
            driver.serve(rid, tokens)
            cache.check_hicache_events()  # the scheduler's per-step poll: backups acknowledged

    def replay(driver: Driver) -> None:
        serve(driver, requests[:12])
        _settle(cache)
        # device only: host keeps them
        cache.evict(EvictParams(num_tokens=1 << 15, swa_num_tokens=1 << 15, mamba_num=config.mamba_states))
        further = [1] if paged else []
        serve(driver, [(f"again-{rid}", tokens + further) for rid, tokens in requests[:4]])  # host hits, loaded back
        serve(driver, requests[12:])  # the host tier fills and evicts
        _settle(cache)

    sink, stats = both_modes(config, built, replay)
    assert stats.dropped == 0 and stats.errors == 0 and stats.resolver_errors == 0 and stats.lost_resets == 0
    ours, theirs = sink.events, spooled(spool)
    moves = {(e.kind, e.src_tier, e.dst_tier) for e in ours}
    assert {(EventKind.OFFLOAD, Tier.DEVICE, Tier.HOST), (EventKind.LOAD, Tier.HOST, Tier.DEVICE)} <= moves
    assert any(e.kind is EventKind.EVICT and e.tier is Tier.HOST for e in ours)
    if paged:  # each host hit loaded the state at its boundary back once, for the tree
        loaded = [e for e in ours if e.kind is EventKind.LOAD and e.component is ComponentKind.MAMBA]
        from_host = [e for e in ours if e.kind is EventKind.ADOPT and Tier.HOST in e.reused_tiers]
        assert len(loaded) == len(from_host) >= 4 and all(not e.more_keys for e in loaded)
        assert any(e.kind is EventKind.OFFLOAD and e.component is ComponentKind.MAMBA for e in ours)

    assert [_timeless(e) for e in theirs] == [_timeless(e) for e in ours]
    # The resolver's durations are the capture's clock reads on the scheduler thread, next to
    # the in-process hooks' own: the same copies' times, not the time the replay took.
    pairs = [(a.duration_ns, b.duration_ns) for a, b in zip(theirs, ours, strict=True)
             if a.kind in (EventKind.OFFLOAD, EventKind.LOAD)]
    theirs_total, ours_total = sum(a for a, _ in pairs), sum(b for _, b in pairs)
    assert abs(theirs_total - ours_total) <= ours_total / 10  # a thread switch may part two reads
    assert max(a for a, _ in pairs) > 5_000_000 and max(b for _, b in pairs) > 5_000_000  # one waited for a poll


def test_hicaches_storage_tier_is_followed_alike_in_both_modes(spool: Path, tmp_path: Path) -> None:
    """HiCache's file storage tier: host pages written to disk and acknowledged, prefetches
    landing on host, the tier cleared. Some pages on disk were stored by another engine, so their
    names are unknown here: one prefetch lands under the root and is keyed from its tokens,
    another under a node this engine stored and continues that node's chain."""
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle, EvictParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    config = DriverConfig(page_size=4, kv_tokens=256)
    storage = str(tmp_path / "l3")
    theirs_only, head, whole = list(range(700, 717)), list(range(100, 108)), list(range(100, 116)) + [999]
    other, other_allocator, other_pool = build_cache(config)  # another engine on the same storage
    enable_hicache(other, storage)
    other_driver = Driver(other, other_allocator, other_pool, config)
    other_driver.serve("x", theirs_only)
    other_driver.serve("y", whole)
    _settle(other)
    cache, allocator, pool = built = build_cache(config)
    enable_hicache(cache, storage)

    def prefetch(rid: str, tokens: list[int]) -> int:
        probe = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
        handle = CacheRequestHandle(rid, 0)
        node = probe.last_host_node
        cache.prefetch_from_storage(handle, node, array("q", tokens[probe.device_prefix_len + probe.host_hit_length:]),
                                    cache.get_last_hash_value(node))
        deadline = time.monotonic() + 20
        while not cache.check_prefetch_progress(handle) and time.monotonic() < deadline:
            cache.check_hicache_events()
            time.sleep(0.01)
        return cache.pop_prefetch_loaded_span(handle)[0]

    def replay(driver: Driver) -> None:
        driver.serve("a", head + [998])  # stored here: its names are known
        _settle(cache)
        cache.evict(EvictParams(num_tokens=256))
        assert prefetch("p1", theirs_only[:16]) == 16  # under the root, stored by the other engine
        assert prefetch("p2", whole[:16]) == 8  # under "a"'s node, whose pages are on host
        assert prefetch("p3", list(range(5000, 5016))) == 0  # nobody stored these: revoked
        driver.serve("b", whole)  # loaded back from host
        _settle(cache)
        assert cache.clear_storage_backend()
        cache.reset()

    sink, stats = both_modes(config, built, replay)
    assert stats.dropped == 0 and stats.errors == 0 and stats.resolver_errors == 0 and stats.lost_resets == 0
    assert (stats.prefetches_started, stats.prefetches_revoked, stats.unnamed_pages) == (3, 1, 0)
    ours, theirs = sink.events, spooled(spool)

    def keys(e: Event) -> list[int]:
        return [e.block_key, *e.more_keys]

    def chain(tokens: list[int]) -> list[int]:
        return new_chain(None, None).extend(array("q", tokens), 4).tolist()

    written = [keys(e) for e in ours if e.kind is EventKind.OFFLOAD and e.dst_tier is Tier.DISK]
    assert written[0] == chain(head)  # "a"'s pages, written to disk
    fetched = [keys(e) for e in ours if e.kind is EventKind.LOAD and e.src_tier is Tier.DISK]
    assert fetched == [chain(theirs_only[:16]), chain(whole[:16])[2:]]  # keyed from their tokens
    assert any(e.kind is EventKind.INVALIDATE and e.tier is Tier.DISK for e in ours)
    assert [_timeless(e) for e in theirs] == [_timeless(e) for e in ours]
    # each mode timed the fetches on its own clock, from SGLang's start of each prefetch
    waits = [(e.request_id, e.in_flight, e.duration_ns > 0) for e in theirs if e.kind is EventKind.LOAD
             and e.src_tier is Tier.DISK]
    assert waits == [("p1", True, True), ("p2", True, True)]


@pytest.mark.parametrize(("mix", "page"), [(Mix.MAMBA, 1), (Mix.SWA_MAMBA, 1), (Mix.SWA, 4)])
def test_states_stored_with_their_pages_are_followed_alike_in_both_modes(mix: Mix, page: int, spool: Path,
                                                                          tmp_path: Path) -> None:
    """A window's or Mamba's state written to storage with its pages and staged on host again by
    a prefetch: the capture records the states a write carries and those a prefetch's commit
    stages (less what it frees again) where the in-process hooks read them."""
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle, EvictParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    config = DriverConfig(mix=mix, page_size=page, window=8, kv_tokens=512, mamba_states=8)
    cache, allocator, pool = built = build_cache(config)
    enable_hicache(cache, str(tmp_path))
    prompt = list(range(100, 140))

    def replay(driver: Driver) -> None:
        driver.serve("first", prompt)
        _settle(cache)
        cache.evict(EvictParams(num_tokens=512, swa_num_tokens=512, mamba_num=8))
        assert cache.evict_host(512) == 40
        probe = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt))))
        handle = CacheRequestHandle("fetch", 0)
        cache.prefetch_from_storage(handle, probe.last_host_node, array("q", prompt),
                                    cache.get_last_hash_value(probe.last_host_node))
        deadline = time.monotonic() + 20
        while not cache.check_prefetch_progress(handle) and time.monotonic() < deadline:
            cache.check_hicache_events()
            time.sleep(0.01)
        assert cache.pop_prefetch_loaded_span(handle)[0] == 40
        assert driver.serve("again", prompt + [1]).loaded == 40

    sink, stats = both_modes(config, built, replay)
    assert stats.dropped == 0 and stats.errors == 0 and stats.resolver_errors == 0 and stats.lost_resets == 0
    ours, theirs = sink.events, spooled(spool)
    states = {(e.kind, e.src_tier, e.dst_tier) for e in ours if e.component is not ComponentKind.FULL_ATTENTION}
    assert {(EventKind.OFFLOAD, Tier.HOST, Tier.DISK), (EventKind.LOAD, Tier.DISK, Tier.HOST)} <= states
    assert [_timeless(e) for e in theirs] == [_timeless(e) for e in ours]


@pytest.mark.parametrize("how", ["attached at run time", "detached and attached again", "added with the host tier"])
def test_a_storage_tier_added_later_is_followed(how: str, spool: Path, tmp_path: Path) -> None:
    """SGLang can attach a storage tier at run time, and detach and attach one again, each time
    with a new acknowledgement queue; or the tiers may come after the capture started. Either
    way both modes follow the storage tier, to the last writes."""
    import json

    from sglang.srt.environ import envs
    from sglang.srt.runtime_context import get_parallel

    config = DriverConfig(kv_tokens=1 << 15)
    cache, allocator, pool = built = build_cache(config)
    at_run_time = how != "added with the host tier"
    if at_run_time:
        enable_hicache(cache)  # the host tier first, followed
    requests = prompts(9)

    def attach() -> None:  # what the scheduler's process has set up by then
        get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
        with envs.SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR.override(str(tmp_path / "l3")):  # read when attached
            ok, why = cache.attach_storage_backend("file", json.dumps({"prefetch_threshold": 16}))
        assert ok, why

    def replay(driver: Driver) -> None:
        for rid, tokens in requests[:3]:
            driver.serve(rid, tokens)
        if at_run_time:
            attach()
        else:
            enable_hicache(cache, str(tmp_path / "l3"))
        for rid, tokens in requests[3:6]:
            driver.serve(rid, tokens)
        _settle(cache)
        if how == "detached and attached again":
            ok, why = cache.detach_storage_backend()
            assert ok, why
            attach()
        for rid, tokens in requests[6:]:
            driver.serve(rid, tokens)
        _settle(cache)

    sink, stats = both_modes(config, built, replay)
    assert stats.lost_resets == 0 and stats.resolver_errors == 0 and stats.errors == 0
    ours, theirs = sink.events, spooled(spool)
    last = next(i for i, e in enumerate(ours) if e.kind is EventKind.LOOKUP and e.request_id == requests[6][0])
    assert any(e.kind is EventKind.OFFLOAD and e.dst_tier is Tier.DISK for e in ours[last:])
    assert [_timeless(e) for e in theirs] == [_timeless(e) for e in ours]


def test_streaming_sessions_are_followed_alike_in_both_modes(spool: Path) -> None:
    """A streaming session keeps each turn's KV row for the next turn, outside the tree; a
    request outside the session with the same tokens puts them in the tree too, and a second
    session keeps some of them too, until a turn of it is aborted and hands its row to the tree;
    closing a session gives its row back. Both modes commit the
    session's pages where it keeps them, and evict them when it closes, but not the copies the
    tree or the other session holds."""
    config = DriverConfig(page_size=1, kv_tokens=1 << 12, route=Route.SCHEDULER)
    cache, allocator, pool = built = build_cache(config)
    tokens = [t for _, prompt in prompts(1, cut=21) for t in prompt]

    def replay(driver: Driver) -> None:
        nonlocal tokens
        for turn in range(3):
            assert driver.serve_turn("s", f"turn-{turn}", tokens).device_hit == (0 if turn == 0 else len(tokens) - 9)
            tokens = tokens + list(range(500 + 10 * turn, 509 + 10 * turn))
        driver.serve("outside", tokens[:30])
        driver.serve_turn("s2", "other-0", tokens[:35])
        driver.close_session("s")
        assert driver.serve("after", tokens[:30]).device_hit == 29  # the tree's copy
        assert driver.serve_turn("s2", "other-1", tokens[:36]).device_hit == 35
        driver.serve_turn("s2", "other-2", tokens[:38], aborted=True)  # the row goes to the tree
        driver.serve_turn("s2", "other-3", tokens[:39])
        driver.close_session("s2")

    sink, stats = both_modes(config, built, replay)
    assert stats.dropped == 0 and stats.errors == 0 and stats.resolver_errors == 0 and stats.lost_resets == 0
    ours, theirs = sink.events, spooled(spool)
    assert any(e.kind is EventKind.EVICT and e.reason is Reason.EXPLICIT for e in ours)
    assert [comparable(e) for e in theirs] == [comparable(e) for e in ours]


@pytest.mark.parametrize("page", [16, 1])
def test_chunked_prefill_decode_and_retraction_are_followed_alike_in_both_modes(page: int, spool: Path) -> None:
    """Requests prefilled in chunks side by side (the second's shared chunks are duplicates the
    tree frees), decoding outputs into the tree, a next turn over them, and a request preempted
    in decode after a chunk, its chunk evicted while it waits, admitted again with the outputs
    it had made."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    config = DriverConfig(page_size=page, kv_tokens=1 << 12, route=Route.SCHEDULER)
    cache, allocator, pool = built = build_cache(config)
    doc = [t for _, prompt in prompts(1, cut=200) for t in prompt]

    def replay(driver: Driver) -> None:
        a, b = doc + list(range(1, 40)), doc + list(range(50, 90))
        runs = [driver.admit("a", a, outputs=range(7000, 7030)), driver.admit("b", b, outputs=[9, 9, 9])]
        for end in range(64, 257, 64):
            for run in runs:
                driver.prefill(run, end)
        for run in runs:
            driver.decode(run)
            driver.finish(run)
        assert driver.serve("a-turn-2", a + list(range(7000, 7030)) + [3] * 20).device_hit > len(a)
        c = driver.admit("c", doc + list(range(400, 500)), outputs=[5] * 20)
        driver.prefill(c, 256)
        driver.prefill(c)
        driver.decode(c, 5)
        driver.retract(c)
        cache.evict(EvictParams(num_tokens=1 << 12))
        driver.readmit(c)
        driver.prefill(c)
        driver.decode(c)
        driver.finish(c)

    sink, stats = both_modes(config, built, replay)
    assert stats.dropped == 0 and stats.errors == 0 and stats.resolver_errors == 0 and stats.lost_resets == 0
    ours, theirs = sink.events, spooled(spool)
    assert {EventKind.COMMIT, EventKind.EVICT} <= {e.kind for e in ours}
    assert [comparable(e) for e in theirs] == [comparable(e) for e in ours]


def test_caches_it_does_not_cover_are_refused_by_name() -> None:
    cache, _, _ = build_cache(DriverConfig(kv_tokens=1 << 15, tree="pure_swa"))
    assert "PureSWARadixCache" in (unsupported(cache) or "")
    with pytest.raises(ValueError, match="PureSWARadixCache"):
        ProcessShim(cache, IDENTITY)


def test_a_request_asked_again_after_its_admission_is_reported_with_its_new_tokens(spool: Path) -> None:
    """A request's repeated asks carry no tokens; once it is admitted, its next ask (a retracted
    request, grown by its output) must carry them again, or the resolver would name old pages.
    A new request object under a used id starts a new page chain in both modes."""
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.sampling.sampling_params import SamplingParams

    cache, _, _ = build_cache(DriverConfig(kv_tokens=1 << 15))
    sink = MemorySink()
    emitter = BatchEmitter(sink, BatchConfig(), register_atexit=False)
    inline = RadixCacheShim(cache, emitter, IDENTITY, usage_interval_s=0).install()
    process = ProcessShim(cache, IDENTITY, usage_interval_s=0).start()
    both = Both(inline, process)
    first = array("q", range(10_000, 10_320))
    try:
        other = array("q", range(70_000, 70_352))  # the same id, other content: a new page chain
        for tokens in (first, first, first + array("q", range(50_000, 50_064)), other):
            req = Req(rid="again", origin_input_text="", origin_input_ids=tokens,
                      sampling_params=SamplingParams(max_new_tokens=1))
            cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens[:-1]), req=req))  # asked, a miss each time
            cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens[:-1]), req=req))  # asked again: a repeat
            both.record_admission("again", len(tokens), device=0)
        assert process.flush(60)
    finally:
        process.close()
    assert emitter.shutdown()
    lookups = [e.prompt_tokens for e in sink.events if e.kind is EventKind.LOOKUP]
    assert lookups == [320, 320, 384, 352]  # once per admission, each with its request's tokens
    assert [comparable(e) for e in spooled(spool)] == [comparable(e) for e in sink.events]
