"""`kvtrace replay --engine vllm|sglang|lmcache`: a request trace through an engine's own KV cache, no model.

The engine's real cache code (vLLM's KV-cache manager; SGLang's radix cache on CPU pools; a real
LMCache engine with its CPU and disk backends, storing and retrieving each request's KV) is
driven the way its scheduler drives it, its shim traces it into the store, and the recipe is
read off the engine's own configuration, ready for `kvtrace analyze`. Run from the engine's
environment (`.venvs/<engine>/bin/kvtrace`).

A request the engine would refuse (vLLM: longer than max_model_len, larger than the whole
cache; SGLang: over its context length or its scheduler's input limit) is refused by the driver
as the engine refuses it, counted by reason and skipped; the replay goes on and its report
gives the counts. LMCache refuses nothing: it stores the chunks that fit.
"""

from __future__ import annotations

import sys
from argparse import Namespace
from collections.abc import Callable
from pathlib import Path
from typing import Any

TraceOf = Callable[[Namespace], Any]
StoreOf = Callable[[Namespace], Any]


def _missing(engine: str, name: str, exc: ImportError) -> int:
    print(f"error: --engine {engine} needs {name} in this environment ({exc}); "
          f"build it with `bash scripts/engine-venv.sh {engine}` and run .venvs/{engine}/bin/kvtrace", file=sys.stderr)
    return 2


def _into_store(args: Namespace, reader: Any, store_of: StoreOf, engine: str, desc: str,
                attach: Callable[[Any], Any], serve: Callable[[Any], None],
                drain: Callable[[], None] | None = None) -> tuple[Any, Any, Any]:
    """Serve every trace request with a shim attached to an emitter into the store, counting
    those the engine refuses; `drain` lets the engine finish work it runs in the background
    (LMCache's disk writes) before the flush. Returns (emitter stats, shim, refusal tally)."""
    from kvtrace.cli.progress import bar as progress_bar
    from kvtrace.instrumentation.recording import FLUSH_TIMEOUT_MILLIS, store_emitter
    from kvtrace.instrumentation.refusals import RefusalTally, RequestRefused

    refused = RefusalTally()
    with store_of(args) as store:
        store.init()
        emitter = store_emitter(store, f"{engine}-replay", engine)
        shim = attach(emitter)
        with progress_bar(desc=desc, unit="req", disable=None) as bar:
            for req in reader:
                try:
                    serve(req)
                except RequestRefused as exc:
                    refused.add(exc.refusal)
                bar.update()
        if drain is not None:
            drain()
        emitter.force_flush(timeout_millis=FLUSH_TIMEOUT_MILLIS)
        emitter.shutdown()
    return emitter.stats(), shim, refused


def _finish(args: Namespace, reader: Any, recipe: Any, source: str, summary: str, stats: Any, shim: Any,
            refused: Any, refused_note: str = "") -> int:
    import msgspec

    recipe_out = Path(args.recipe_out or f"{args.model}.recipe.json")
    recipe_out.write_bytes(msgspec.json.encode(recipe))
    print(f"{summary}; {stats.exported} events stored, {stats.dropped} dropped, {shim.errors} hook errors")
    if refused.total:
        print(refused.summary() + refused_note)
    if reader.skipped:
        print(f"skipped {reader.skipped} malformed lines; first: {reader.errors[0]}", file=sys.stderr)
    print(f"recipe from {source}: {recipe_out}")
    print("next: kvtrace analyze   (each lookup judged by the recipe its engine published)")
    return 1 if stats.dropped or shim.errors else 0


def replay_vllm(args: Namespace, trace: TraceOf, store_of: StoreOf) -> int:
    from kvtrace.instrumentation.replay import tokens_of
    from kvtrace.instrumentation.traces import TraceError

    try:
        from kvtrace.instrumentation.vllm.admission import startup_problem
        from kvtrace.instrumentation.vllm.driver import Driver, DriverConfig, Layout, build_manager, cache_limits
        from kvtrace.instrumentation.vllm.recipe import recipe_from_kv_cache_config
        from kvtrace.instrumentation.vllm.shim import CacheManagerShim, Identity
    except ImportError as exc:
        return _missing("vllm", "vLLM", exc)
    config = DriverConfig(layout=Layout(args.vllm_layout), num_blocks=args.vllm_blocks,
                          max_model_len=args.vllm_max_model_len)
    problem = startup_problem(cache_limits(config))
    if problem:
        print(f"warning: {problem}; requests larger than the whole cache are refused", file=sys.stderr)
    manager = build_manager(config)
    recipe = recipe_from_kv_cache_config(manager.kv_cache_config, name=f"vllm-{args.vllm_layout}")
    driver = Driver(manager, config)
    try:
        reader = trace(args)
        stats, shim, refused = _into_store(
            args, reader, store_of, "vllm", "replay (vLLM)",
            lambda emitter: CacheManagerShim(manager, emitter, Identity(instance="vllm-replay", model=args.model,
                                                                        default_tenant=args.tenant)).install(),
            lambda req: driver.serve(req.request_id, tokens_of(req), cache_salt=req.tenant or None))
    except (TraceError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    prefix = driver.stats()
    return _finish(args, reader, recipe, "vLLM's config",
                   f"replayed {prefix.requests} requests through vLLM's KV-cache manager: vLLM counted "
                   f"{prefix.queries} queried and {prefix.hits} hit tokens", stats, shim, refused)


def replay_sglang(args: Namespace, trace: TraceOf, store_of: StoreOf) -> int:
    from kvtrace.instrumentation.identity import Identity
    from kvtrace.instrumentation.refusals import RefusalReason
    from kvtrace.instrumentation.replay import tokens_of
    from kvtrace.instrumentation.traces import TraceError

    try:
        from kvtrace.instrumentation.sglang.admission import startup_warning
        from kvtrace.instrumentation.sglang.driver import Driver, DriverConfig, Mix, build_cache
        from kvtrace.instrumentation.sglang.recipe import recipe_from_cache
        from kvtrace.instrumentation.sglang.shim import RadixCacheShim
    except ImportError as exc:
        return _missing("sglang", "SGLang", exc)
    mix = Mix(args.sglang_mix)
    page = 1 if mix in (Mix.MAMBA, Mix.SWA_MAMBA) else 16  # SGLang's Mamba state needs page 1 (no extra buffer)
    config = DriverConfig(mix=mix, page_size=page, kv_tokens=args.sglang_tokens, tree_core=args.sglang_core,
                          context_len=args.sglang_context_len)
    totals = {"requests": 0, "prompt": 0, "reused": 0}

    def serve(req: Any) -> None:
        served = driver.serve(req.request_id, tokens_of(req), cache_salt=req.tenant or None)
        totals["requests"] += 1
        totals["prompt"] += served.prompt_tokens
        totals["reused"] += served.reused

    try:
        cache, allocator, pool = build_cache(config)
        recipe = recipe_from_cache(cache, name=f"sglang-{args.sglang_mix}")
        driver = Driver(cache, allocator, pool, config)
        warning = startup_warning(driver.limits)
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
        reader = trace(args)

        def attach(emitter: Any) -> Any:
            driver.shim = RadixCacheShim(cache, emitter, Identity(instance="sglang-replay", model=args.model,
                                                                  default_tenant=args.tenant)).install()
            return driver.shim

        stats, shim, refused = _into_store(args, reader, store_of, "sglang", "replay (SGLang)", attach, serve)
    except (TraceError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    aborted = refused.count(RefusalReason.OVER_INPUT_LIMIT)
    stubs = (f"; the scheduler's {aborted} aborted ran as SGLang runs them, a one-token stub each through the cache "
             f"(their lookups are stored)" if aborted else "")
    return _finish(args, reader, recipe, "SGLang's cache",
                   f"replayed {totals['requests']} requests through SGLang's radix cache ({args.sglang_mix}, "
                   f"{args.sglang_core} core): SGLang reused {totals['reused']} of {totals['prompt']} prompt tokens",
                   stats, shim, refused, stubs)


def replay_lmcache(args: Namespace, trace: TraceOf, store_of: StoreOf) -> int:
    import tempfile
    from dataclasses import replace

    from kvtrace.instrumentation.replay import tokens_of
    from kvtrace.instrumentation.traces import TraceError
    from kvtrace.schema.recipes import dense

    try:
        from kvtrace.instrumentation.lmcache.cpu import EngineSpec, build_engine, destroy_engine
        from kvtrace.instrumentation.lmcache.driver import Driver, wait_for_disk
        from kvtrace.instrumentation.lmcache.shim import LMCacheShim
    except ImportError as exc:
        return _missing("lmcache", "LMCache", exc)
    disk = ""
    if args.lmcache_disk_gb > 0:
        disk = args.lmcache_disk_dir or tempfile.mkdtemp(prefix="kvtrace-lmcache-disk-")
    spec = replace(EngineSpec(), model=args.model, chunk_size=args.lmcache_chunk, cpu_gb=args.lmcache_cpu_gb,
                   disk_gb=args.lmcache_disk_gb, disk_path=disk)
    totals = {"requests": 0, "prompt": 0, "hit": 0, "retrieved": 0, "exact": 0}

    def serve(req: Any) -> None:
        served = driver.serve(req.request_id, tokens_of(req), tenant=req.tenant or args.tenant)
        totals["requests"] += 1
        totals["prompt"] += served.prompt_tokens
        totals["hit"] += served.lookup_hit
        totals["retrieved"] += served.retrieved
        totals["exact"] += served.exact

    try:
        engine = build_engine(spec, "kvtrace-replay")
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"error: LMCache could not start: {exc}", file=sys.stderr)
        return 2
    try:
        driver = Driver(engine, spec)
        reader = trace(args)

        def attach(emitter: Any) -> Any:
            return LMCacheShim(engine, emitter, instance="lmcache-replay", default_tenant=args.tenant).install()

        stats, shim, refused = _into_store(args, reader, store_of, "lmcache", "replay (LMCache)", attach, serve,
                                  drain=lambda: wait_for_disk(engine, timeout_s=600))
    except (TraceError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        destroy_engine("kvtrace-replay")
    summary = (f"replayed {totals['requests']} requests through LMCache ({spec.chunk_size}-token chunks, "
               f"{spec.cpu_gb} GiB CPU{f', {spec.disk_gb} GiB disk' if disk else ''}): LMCache found "
               f"{totals['hit']} and delivered {totals['retrieved']} of {totals['prompt']} prompt tokens"
               f"{'' if totals['exact'] == totals['requests'] else '; SOME RETRIEVED KV DIFFERED'}")
    return _finish(args, reader, dense(spec.chunk_size), "LMCache's chunk size", summary, stats, shim, refused)
