"""Zero-code enablement: an SGLang general plugin that instruments every radix cache it builds.

SGLang loads the entry points of group `sglang.srt.plugins` in each of its processes (and
`SGLANG_PLUGINS` filters them by name). When kvtrace is installed this runs there; it does
nothing unless `KVTRACE_ENABLED` is true (see `kvtrace.instrumentation.config` for the sink
settings). It registers two hooks through SGLang's own hook registry:

- after `sglang.srt.mem_cache.registry.create_tree_cache`: the cache SGLang just built (by
  whichever factory; the scheduler's simulated waiting-queue tree is built elsewhere and stays
  untouched) gets a `RadixCacheShim` with the engine's identity and context length (which its
  attach event says, see `context_length`). Every tensor-parallel rank mirrors the tree, so
  only the first rank of each attention replica is instrumented;
- after `ScheduleBatch.prepare_for_extend`: where SGLang splits each admitted request's cached
  prefix by tier (`cached_tokens_device`, `_host`, `_storage`), the shim records the adopt.

If SGLang lacks the registry or a target, it logs once and the engine runs untraced.

By default the shim's work runs off the scheduler thread (`KVTRACE_SGLANG_MODE=process`): the
thread only copies what the shim reads into shared memory and a resolver process does the rest
(see `capture`). That is what costs the scheduler least, and a GPU host has cores to spare for
the resolver. A cache the mode does not cover (the older single-component trees), or a host
without room for the ring, is traced in-process, with a log line saying why.
`KVTRACE_SGLANG_MODE=inline` keeps everything on the scheduler thread: no second process, and
nothing is dropped when the engine outruns the resolver, at the scheduler's expense.
"""

from __future__ import annotations

import atexit
import logging
import os
from enum import StrEnum
from typing import Any

from kvtrace.instrumentation.switch import tracing_requested

log = logging.getLogger("kvtrace.sglang")
CACHE_TARGET = "sglang.srt.mem_cache.registry.create_tree_cache"
ADMIT_TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend"
_installed = False
_settings: Any = None


class Mode(StrEnum):
    """Where the shim's work runs (`KVTRACE_SGLANG_MODE`)."""

    PROCESS = "process"  # a resolver process; the scheduler thread only copies (the default)
    INLINE = "inline"  # all of it on the scheduler thread


def mode_from_env(env: Any = None) -> Mode:
    """`KVTRACE_SGLANG_MODE`, unset or empty meaning the default; a wrong value is an error
    that names it (the plugin then leaves tracing off, as for any wrong setting)."""
    raw = (os.environ if env is None else env).get("KVTRACE_SGLANG_MODE", "").strip().lower()
    try:
        return Mode(raw or Mode.PROCESS)
    except ValueError:
        from kvtrace.instrumentation.config import ConfigError

        raise ConfigError(f"KVTRACE_SGLANG_MODE={raw!r}: expected one of {', '.join(Mode)}") from None


def register() -> None:
    """The entry point SGLang calls; safe to call many times, never raises."""
    global _installed, _settings
    if _installed or not tracing_requested():  # off: nothing more of kvtrace is imported
        return
    try:
        from kvtrace.instrumentation.config import ConfigError, enabled_settings

        settings = enabled_settings(log)
        if settings is None:
            return
        try:
            mode_from_env()
        except ConfigError as exc:
            log.error("kvtrace: %s; tracing is off", exc)
            return
        try:
            from sglang.srt.plugins.hook_registry import HookRegistry, HookType
        except ImportError:
            log.warning("kvtrace: this SGLang has no plugin hook registry; tracing is off")
            return
        _settings = settings
        HookRegistry.register(CACHE_TARGET, after_create_tree_cache, HookType.AFTER)
        HookRegistry.register(ADMIT_TARGET, after_prepare_for_extend, HookType.AFTER)
        _installed = True
    except Exception:  # noqa: BLE001 - never stop SGLang from starting
        log.exception("kvtrace: could not instrument SGLang; the engine runs without tracing")


def after_create_tree_cache(cache: Any, ctx: Any = None, *args: Any, **kwargs: Any) -> None:
    """Attach a shim to the cache SGLang built; returns None so SGLang keeps its result."""
    try:
        if ctx is not None and not first_rank_of_replica(ctx):
            return None
        if not (hasattr(cache, "match_prefix") and hasattr(cache, "insert")):
            log.warning("kvtrace: %s is not a radix cache; it runs without tracing", type(cache).__name__)
            return None
        attach(cache, ctx)
    except Exception:  # noqa: BLE001
        log.exception("kvtrace: could not attach to this radix cache; it runs without tracing")
    return None


def first_rank_of_replica(ctx: Any) -> bool:
    """Every tensor-parallel rank of an attention replica mirrors one tree: trace the first.
    With data-parallel attention each replica (a group of tp_size / dp_size ranks) has its own."""
    tp_rank, tp_size = int(getattr(ctx, "tp_rank", 0) or 0), int(getattr(ctx, "tp_size", 1) or 1)
    args = getattr(ctx, "server_args", None)
    dp = int(getattr(args, "dp_size", 1) or 1) if getattr(args, "enable_dp_attention", False) else 1
    return tp_rank % max(tp_size // max(dp, 1), 1) == 0


def attach(cache: Any, ctx: Any = None, settings: Any = None, mode: Mode | None = None) -> Any:
    """Instrument one radix cache (in `mode`, else as `KVTRACE_SGLANG_MODE` says); returns the
    shim, a `ProcessShim` or a `RadixCacheShim` (also kept on the cache)."""
    from kvtrace.instrumentation.api import get_emitter
    from kvtrace.instrumentation.config import EmitterSettings, configure, engine_instance
    from kvtrace.instrumentation.identity import Identity
    from kvtrace.instrumentation.sglang.shim import RadixCacheShim

    settings = settings or _settings or EmitterSettings.from_env()
    args = getattr(ctx, "server_args", None)
    model = str(getattr(args, "served_model_name", None) or getattr(args, "model_path", "") or "")
    identity = Identity(instance=engine_instance(settings), model=model,
                        model_revision=str(getattr(args, "revision", None) or ""),
                        kv_dtype=str(getattr(args, "kv_cache_dtype", "") or ""), default_tenant=settings.tenant)
    longest = context_length(ctx)
    if (mode or mode_from_env()) is Mode.PROCESS:
        from kvtrace.instrumentation.sglang.capture import ProcessShim, unsupported

        why = unsupported(cache)
        if why is None:
            try:
                process = ProcessShim(cache, identity, sample_rate=settings.sample_rate,
                                      max_model_len=longest).start()
            except Exception as exc:  # noqa: BLE001 - no room for the ring, no interpreter to start
                why = f"this host ({exc})"
            else:
                atexit.register(process.close)
                cache._kvtrace_shim = process
                return process
        log.warning("kvtrace: out-of-process mode does not cover %s; tracing this cache in-process", why)
    emitter = get_emitter()
    if type(emitter).__name__ == "NoopEmitter":
        emitter = configure(settings, engine="sglang")
    shim = RadixCacheShim(cache, emitter, identity, sample_rate=settings.sample_rate, max_model_len=longest).install()
    cache._kvtrace_shim = shim
    return shim


def context_length(ctx: Any) -> int:
    """The longest request, prompt and output, the engine serves: the context length SGLang's
    model config settled on (the model's own, or `--context-length`), which the scheduler bounds
    requests by. 0 without a build context that has one."""
    return int(getattr(getattr(ctx, "model_config", None), "context_len", 0) or 0)


def admission_split(req: Any, admission: int) -> tuple[int, int, int]:
    """What an admission reuses per tier (device, host, storage). SGLang splits a request's
    first admission itself (`cached_tokens_device/_host/_storage`) and never again once it has
    been retracted (its `retracted_stain`: its metrics keep the first hit), so a readmission is
    split here the same way, from the match it was admitted on."""
    if not admission:
        return (int(getattr(req, "cached_tokens_device", 0) or 0), int(getattr(req, "cached_tokens_host", 0) or 0),
                int(getattr(req, "cached_tokens_storage", 0) or 0))
    prefix = int(getattr(req, "prefix_len", 0) or 0)
    try:
        from sglang.srt.managers.schedule_batch import split_cached_prefix_by_tier

        device, host, storage = split_cached_prefix_by_tier(
            prefix_len=prefix, host_hit_len=int(req.materialized_host_hit_len()),
            storage_hit_len=int(getattr(req, "storage_hit_length", 0) or 0),
            storage_hit_start=getattr(req, "storage_hit_start", None),
            host_hit_is_storage=bool(getattr(req, "host_hit_is_storage", False)))
        return int(device), int(host), int(storage)
    except Exception:  # noqa: BLE001 - another SGLang release: all of it as the device's
        return prefix, 0, 0


def after_prepare_for_extend(result: Any, batch: Any = None, *args: Any, **kwargs: Any) -> None:
    """Each newly admitted request's reuse, per tier, as SGLang itself reports it."""
    try:
        shim = getattr(getattr(batch, "tree_cache", None), "_kvtrace_shim", None)
        if shim is None:
            return None
        for req in getattr(batch, "reqs", ()) or ():
            # Once per admission: a chunked prefill's later chunks are the same admission; a
            # retracted request's next one is new (it was matched again, and reuses anew).
            admission = int(getattr(req, "retraction_count", 0) or 0)
            if getattr(req, "_kvtrace_adopted", -1) >= admission:
                continue
            req._kvtrace_adopted = admission
            # what it was matched on: its prompt, and after a retraction the outputs it had made
            prompt = len(getattr(req, "origin_input_ids", ()) or ()) + len(getattr(req, "output_ids", ()) or ())
            device, host, storage = admission_split(req, admission)
            shim.record_admission(str(req.rid), prompt, device=device, host=host, storage=storage,
                                  tenant=getattr(req, "cache_salt", None))
    except Exception:  # noqa: BLE001
        log.exception("kvtrace: recording SGLang admissions failed; the engine goes on")
    return None
