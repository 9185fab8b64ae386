"""`kvtrace replay --engine sglang`: a request trace through SGLang's own radix cache, no model.

SGLang's cache classes (the tree on either core, its pools, its eviction) run on CPU pools; the
shim traces them into the store, and the recipe is read off the cache, as for vLLM.
"""

from __future__ import annotations

import sys
from argparse import Namespace
from collections.abc import Callable
from pathlib import Path
from typing import Any


def replay_sglang(args: Namespace, trace: Callable[[Namespace], Any], store_of: Callable[[Namespace], Any]) -> int:
    import msgspec
    from tqdm import tqdm

    from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
    from kvtrace.instrumentation.identity import Identity
    from kvtrace.instrumentation.replay import tokens_of
    from kvtrace.instrumentation.sinks.store import StoreSink
    from kvtrace.instrumentation.traces import TraceError

    try:
        from kvtrace.instrumentation.sglang.driver import Driver, DriverConfig, Mix, build_cache
        from kvtrace.instrumentation.sglang.recipe import recipe_from_cache
        from kvtrace.instrumentation.sglang.shim import RadixCacheShim
    except ImportError as exc:
        print(f"error: --engine sglang needs SGLang in this environment ({exc}); "
              "build it with `bash scripts/engine-venv.sh sglang` and run .venvs/sglang/bin/kvtrace", file=sys.stderr)
        return 2
    mix = Mix(args.sglang_mix)
    page = 1 if mix in (Mix.MAMBA, Mix.SWA_MAMBA) else 16  # SGLang's Mamba state needs page 1 (no extra buffer)
    config = DriverConfig(mix=mix, page_size=page, kv_tokens=args.sglang_tokens, tree_core=args.sglang_core)
    cache, allocator, pool = build_cache(config)
    recipe = recipe_from_cache(cache, name=f"sglang-{args.sglang_mix}")
    recipe_out = Path(args.recipe_out or f"{args.model}.recipe.json")
    prompt = reused = requests = 0
    try:
        reader = trace(args)
        with store_of(args) as store:
            store.init()
            emitter = BatchEmitter(StoreSink(store), BatchConfig(max_queue_size=1 << 20, shutdown_timeout_millis=600_000),
                                   instance="sglang-replay", engine="sglang", register_atexit=False)
            shim = RadixCacheShim(cache, emitter, Identity(instance="sglang-replay", model=args.model,
                                                           default_tenant=args.tenant)).install()
            driver = Driver(cache, allocator, pool, config, shim)
            with tqdm(desc="replay (SGLang)", unit="req", file=sys.stderr, disable=None) as bar:
                for req in reader:
                    served = driver.serve(req.request_id, tokens_of(req))
                    prompt += served.prompt_tokens
                    reused += served.reused
                    requests += 1
                    bar.update()
            emitter.force_flush(timeout_millis=600_000)
            emitter.shutdown()
    except (TraceError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    recipe_out.write_bytes(msgspec.json.encode(recipe))
    stats = emitter.stats()
    print(f"replayed {requests} requests through SGLang's radix cache "
          f"({args.sglang_mix}, {args.sglang_core} core): SGLang reused {reused} of {prompt} prompt tokens; "
          f"{stats.exported} events stored, {stats.dropped} dropped, {shim.errors} hook errors")
    if reader.skipped:
        print(f"skipped {reader.skipped} malformed lines; first: {reader.errors[0]}", file=sys.stderr)
    print(f"recipe from SGLang's cache: {recipe_out}")
    print(f"next: kvtrace analyze --recipe {args.model}={recipe_out}")
    return 1 if stats.dropped or shim.errors else 0
