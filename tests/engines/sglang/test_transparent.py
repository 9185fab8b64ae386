"""The shims never change what SGLang's cache does: the same requests served through a cache
with no shim, with the in-process shim, and with the out-of-process capture (HiCache's host and
storage tiers on too) reuse exactly the same tokens from the same tiers, the operator's flush
(`reset`) leaves the same cache, and every method either shim wrapped still has its original's
signature, annotations and name (engines read them; vLLM converts arguments by them).

The cache holds every prompt here (no eviction): SGLang's eviction order between two separate
caches is not deterministic enough to compare two replays (see test_process_mode)."""

from __future__ import annotations

import time
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from transparency import unfaithful

from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.identity import Identity
from kvtrace.instrumentation.replay import tokens_of
from kvtrace.instrumentation.sglang.capture import ProcessShim
from kvtrace.instrumentation.sglang.driver import Driver, DriverConfig, Mix, build_cache, enable_hicache
from kvtrace.instrumentation.sglang.shim import RadixCacheShim
from kvtrace.instrumentation.sinks.memory import MemorySink
from kvtrace.instrumentation.traces import read_trace

TRACE = resources.files("kvtrace.cli") / "data" / "mooncake_conversation_head.jsonl.gz"
IDENTITY = Identity(instance="sglang-0", model="tiny")
REQUESTS = 24


def settle(cache: Any) -> None:
    deadline = time.monotonic() + 20
    while (getattr(cache, "ongoing_write_through", None) or getattr(cache, "ongoing_backup", None)) \
            and time.monotonic() < deadline:
        cache.check_hicache_events()
        time.sleep(0.01)


def serve(config: DriverConfig, mode: str, storage: Path | None) -> tuple[list[Any], tuple[int, ...], Any]:
    """The trace's first requests, twice over (the second pass reuses the first's), then the
    flush an operator asks for; what each request reused, the cache's sizes after the flush,
    and the shim's hooks."""
    cache, allocator, pool = build_cache(config)
    if storage is not None:
        enable_hicache(cache, str(storage))
    shim: Any = None
    emitter = BatchEmitter(MemorySink(), BatchConfig(max_queue_size=1 << 20), register_atexit=False)
    if mode == "inline":
        shim = RadixCacheShim(cache, emitter, IDENTITY).install()
    elif mode == "process":
        shim = ProcessShim(cache, IDENTITY).start()
    hooks = shim.hooks if mode == "inline" else shim.capture.hooks if mode == "process" else None
    faces = unfaithful(hooks.wrapped()) if hooks is not None else {}
    wrapped = len(hooks) if hooks is not None else 0
    try:
        driver = Driver(cache, allocator, pool, config, shim)
        served = []
        for _ in range(2):
            for r in read_trace(str(TRACE), limit=REQUESTS):
                served.append(driver.serve(r.request_id, tokens_of(r)[:2000]))
                settle(cache)
        cache.reset()
        left = (int(cache.evictable_size()), int(cache.protected_size()), int(allocator.available_size()))
    finally:
        if mode == "process":
            shim.close()
    assert emitter.shutdown()
    return served, left, (faces, wrapped)


@pytest.mark.parametrize(("mix", "hicache"), [(Mix.FULL, False), (Mix.SWA_MAMBA, False), (Mix.FULL, True)],
                         ids=["full", "swa-mamba", "full-hicache"])
def test_the_cache_serves_the_same_with_either_shim_and_every_wrapper_wears_its_face(
        mix: Mix, hicache: bool, tmp_path: Path) -> None:
    page = 1 if mix is Mix.SWA_MAMBA else 16
    config = DriverConfig(mix=mix, page_size=page, kv_tokens=200_000)
    outcomes = {}
    for mode in ("off", "inline", "process"):
        storage = tmp_path / mode if hicache else None
        served, left, (faces, wrapped) = serve(config, mode, storage)
        assert faces == {}, (mode, faces)
        assert mode == "off" or wrapped > 5, (mode, wrapped)
        outcomes[mode] = ([(s.request_id, s.device_hit, s.host_hit, s.full_kv_hit, s.loaded, s.reused)
                           for s in served], left)
    assert sum(s[-1] for s in outcomes["off"][0]) > 0, "nothing was reused: the comparison compares nothing"
    assert outcomes["inline"] == outcomes["off"]
    assert outcomes["process"] == outcomes["off"]
