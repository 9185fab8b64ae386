"""vLLM's prefix cache with LMCache behind it: the two shims' events join into one picture per
request.

vLLM's LMCache connector moves KV with accelerator kernels only, so a vLLM engine cannot run it
here. Both caches are real and run in this process: vLLM's own KV-cache manager (its hashing,
hits, caching and LRU eviction, under the cache-manager shim) and a real LMCache engine (CPU
and disk backends, under the LMCache shim). The test plays the connector's part between them
as vLLM's LMCache connector does: ask LMCache past the device hit, load the rest of the hit
(minus the last prompt token, which vLLM always computes), store what was computed.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from importlib import resources
from pathlib import Path

import msgspec
import pyarrow.parquet as pq
import torch
from vllm.v1.request import RequestStatus

from kvtrace.analysis.join import join_store
from kvtrace.analysis.reconstruct import reconstruct
from kvtrace.cli.main import main
from kvtrace.instrumentation.attach import distribution_version
from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.lmcache.cpu import EngineSpec, build_engine, destroy_engine
from kvtrace.instrumentation.lmcache.driver import kv_for, wait_for_disk
from kvtrace.instrumentation.lmcache.shim import LMCacheShim
from kvtrace.instrumentation.replay import tokens_of
from kvtrace.instrumentation.sinks.memory import MemorySink
from kvtrace.instrumentation.traces import read_trace
from kvtrace.instrumentation.vllm.driver import Driver, DriverConfig, build_manager
from kvtrace.instrumentation.vllm.recipe import recipe_from_kv_cache_config
from kvtrace.instrumentation.vllm.shim import CacheManagerShim, Identity
from kvtrace.schema.kinds import EventKind, Tier
from kvtrace.schema.recipes import dense, recipe_from_json
from kvtrace.schema.verdicts import Verdict

TRACE = resources.files("kvtrace.cli") / "data" / "mooncake_conversation_head.jsonl.gz"


def serve(vllm: Driver, lmc, spec: EngineSpec, rid: str, tokens: list[int]) -> dict:  # noqa: ANN001
    mgr, n, chunk = vllm.manager, len(tokens), spec.chunk_size
    req = vllm.request(rid, tokens)
    mgr.new_step_starts()
    blocks, hit, _ = mgr.get_computed_blocks(req)
    wait_for_disk(lmc)
    found = int(lmc.lookup(tokens, lookup_id=rid))  # the connector asks LMCache for the whole prompt
    usable = min(found, n - 1)  # vLLM computes the last token whatever LMCache holds
    external = max(usable - hit, 0)
    retrieved = 0
    if external:
        kv = torch.zeros_like(kv_for(spec, tokens[:found]))
        mask = torch.ones(found, dtype=torch.bool)
        mask[: hit // chunk * chunk] = False  # chunks vLLM holds on device are not loaded
        got = lmc.retrieve(tokens[:found], mask=mask, kvcaches=kv, slot_mapping=torch.arange(found), req_id=rid)
        retrieved = int(got.sum())
        assert hit // chunk * chunk + retrieved >= hit + external, rid  # the load covers what vLLM counts
        req._kvtrace_external = (external, Tier.HOST)  # what the connector shim leaves for the adopt
    out = mgr.allocate_slots(req, n - hit - external, num_new_computed_tokens=hit, new_computed_blocks=blocks,
                             num_external_computed_tokens=external)
    assert out is not None, rid
    mgr.record_prefix_cache_stats(req, hit)
    req.status = RequestStatus.RUNNING
    req.num_computed_tokens = n
    stored_from = found // chunk * chunk
    if stored_from < n // chunk * chunk:  # LMCache keeps whole chunks; store what it lacks
        mask = torch.ones(n, dtype=torch.bool)
        mask[:stored_from] = False
        lmc.store(tokens, mask=mask, kvcaches=kv_for(spec, tokens), slot_mapping=torch.arange(n))
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    mgr.free(req)
    return {"hit": hit, "found": found, "external": external, "retrieved": retrieved}


def workload() -> list[tuple[str, list[int]]]:
    """Questions about 12 documents (the Mooncake trace's first block of tokens shared by all),
    three rounds: by the next round the device has evicted most documents, LMCache has not."""
    shared = tokens_of(next(iter(read_trace(str(TRACE), limit=1))))[:512]
    docs = [shared + [(d * 7919 + i) % 30_000 + 1 for i in range(300 + 200 * (d % 6))] for d in range(12)]
    return [(f"q{r}-d{d}", doc + [30_001 + r, 30_100 + d] * 8) for r in range(3) for d, doc in enumerate(docs)]


def run_both(tmp_path: Path) -> tuple[list, dict, object, EngineSpec]:
    """The workload through vLLM's cache manager and LMCache, both traced into one sink."""
    spec = replace(EngineSpec(layers=1, heads=1, head_size=8, chunk_size=256), cpu_gb=0.004, disk_gb=1.0,
                   disk_path=str(tmp_path / "disk"), model="tiny")  # one model, as vLLM and its LMCache report it
    config = DriverConfig(num_blocks=400)  # 6,400 tokens on device: a few documents at a time
    manager = build_manager(config)
    sink = MemorySink()
    emitter = BatchEmitter(sink, BatchConfig(max_queue_size=1 << 20), register_atexit=False)
    vshim = CacheManagerShim(manager, emitter, Identity(instance="node-1", model="tiny")).install()
    lmc_id = f"j-{uuid.uuid4().hex[:8]}"
    lmc = build_engine(spec, lmc_id)
    lshim = LMCacheShim(lmc, emitter, instance="node-1").install()
    try:
        vllm = Driver(manager, config)
        served = {rid: serve(vllm, lmc, spec, rid, tokens) for rid, tokens in workload()}
        wait_for_disk(lmc)
        assert emitter.force_flush(30_000) and vshim.errors == 0 and lshim.errors == 0
    finally:
        emitter.shutdown()
        destroy_engine(lmc_id)
    events = sorted(sink.events, key=lambda e: (e.ts_ns, e.source_id, e.seq))
    return events, served, recipe_from_kv_cache_config(manager.kv_cache_config), spec


def test_vllm_and_lmcache_events_join_into_one_picture_per_request(tmp_path: Path) -> None:
    events, served, vrecipe, spec = run_both(tmp_path)
    engine = reconstruct([e for e in events if e.engine == "vllm"], vrecipe)
    store = reconstruct([e for e in events if e.engine == "lmcache"], dense(spec.chunk_size))
    assert {r.instance for r in store} == {"node-1/lmcache"}
    joined = {j.request_id: j for j in join_store(engine, store)}
    assert set(joined) == set(served)
    loaded = 0
    for rid, s in served.items():
        j = joined[rid]
        assert j.device_logical_tokens == s["hit"], rid  # vLLM's own hit
        assert j.store_logical_tokens == min(s["found"], j.prompt_tokens - 1), rid  # LMCache's own, as vLLM uses it
        assert j.logical_hit_tokens == max(s["hit"], min(s["found"], j.prompt_tokens - 1)), rid
        # everything vLLM reused, device and LMCache, is justified by one side or the other
        assert j.adopted_tokens == s["hit"] + s["external"] == j.recoverable_hit_tokens, rid
        assert not j.unsafe_reuse and not j.missed_reuse, rid
        if s["external"]:
            loaded += 1
            assert j.verdict is Verdict.PARTIAL and j.restore_bytes > 0, rid  # a fetch from LMCache's tiers
            assert j.store_logical_tokens > j.device_logical_tokens, rid
            assert j.store_adopted_tokens >= s["retrieved"], rid
    assert loaded > 0  # some requests lost their device blocks and came back from LMCache
    # the engine's view alone cannot justify LMCache's tokens: that is what the join is for
    alone = {r.request_id: r for r in engine}
    assert any(alone[rid].unsafe_reuse for rid, s in served.items() if s["external"])


def test_each_engine_publishes_its_own_recipe_and_the_join_needs_none_given(tmp_path: Path) -> None:
    """vLLM and LMCache each attach once, first, with their own recipes (16-token blocks, one
    full-attention group of 256-token chunks), so the join comes out the same with no recipe
    given as with the ones the test above names."""
    events, served, vrecipe, spec = run_both(tmp_path)
    for engine, instance, recipe in (("vllm", "node-1", vrecipe), ("lmcache", "node-1/lmcache",
                                                                   dense(spec.chunk_size))):
        own = [e for e in events if e.engine == engine]
        attach = own[0]
        assert attach.kind is EventKind.ATTACH and [e.kind for e in own].count(EventKind.ATTACH) == 1
        assert (attach.instance, attach.model) == (instance, "tiny")
        assert recipe_from_json(attach.recipe).groups == recipe.groups
    lmcache = next(e for e in events if e.engine == "lmcache")
    assert (lmcache.block_size, lmcache.engine_version) == (spec.chunk_size, distribution_version("lmcache"))
    given = join_store(reconstruct([e for e in events if e.engine == "vllm"], vrecipe),
                       reconstruct([e for e in events if e.engine == "lmcache"], dense(spec.chunk_size)))
    published = join_store(reconstruct([e for e in events if e.engine == "vllm"]),
                           reconstruct([e for e in events if e.engine == "lmcache"]))
    assert published == given and {j.request_id for j in published} == set(served)


def test_analyze_prints_and_writes_the_joined_picture(capsys, store, tmp_path: Path) -> None:  # noqa: ANN001
    events, served, vrecipe, spec = run_both(tmp_path)
    store.insert_events(events)
    (tmp_path / "v.json").write_bytes(msgspec.json.encode(vrecipe))
    (tmp_path / "l.json").write_bytes(msgspec.json.encode(dense(spec.chunk_size)))
    out = tmp_path / "joined.parquet"
    code = main(["--dsn", str(store.dsn), "analyze", "--recipe", f"tiny={tmp_path / 'v.json'}",
                 "--recipe", f"lmcache:tiny={tmp_path / 'l.json'}", "--joined-output", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and "engine + KV store" in printed, printed
    rows = {r["request_id"]: r for r in pq.read_table(out).to_pylist()}
    assert set(rows) == set(served)
    for rid, s in served.items():
        r = rows[rid]
        assert r["engine_instance"] == "node-1" and r["store_instance"] == "node-1/lmcache"
        assert r["adopted_tokens"] == s["hit"] + s["external"] == r["recoverable_hit_tokens"], rid
        assert not r["unsafe_reuse"], rid
    # no --recipe: each engine's own, as it attached, and the same picture
    bare = tmp_path / "joined-bare.parquet"
    assert main(["--dsn", str(store.dsn), "analyze", "--joined-output", str(bare)]) == 0
    capsys.readouterr()
    by_request = {r["request_id"]: r for r in pq.read_table(bare).to_pylist()}
    assert by_request == rows
