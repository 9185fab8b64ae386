"""Zero-code enablement: a vLLM general plugin that instruments every scheduler it sees.

vLLM loads the entry points of group `vllm.general_plugins` in each of its processes. When
kvtrace is installed this runs there; it does nothing unless `KVTRACE_ENABLED` is true (see
`kvtrace.instrumentation.config` for the sink settings), and if vLLM lacks a hook point it logs
once and leaves the engine as it is. It patches `Scheduler.__init__` so that each scheduler's
KV-cache manager gets a `CacheManagerShim` with the engine's identity (model, revision, KV
dtype), and the emitter is configured once per process.
"""

from __future__ import annotations

import logging
from typing import Any

from kvtrace.instrumentation.switch import tracing_requested

log = logging.getLogger("kvtrace.vllm")
_installed = False


def register() -> None:
    """The entry point vLLM calls; safe to call many times, never raises."""
    global _installed
    if _installed or not tracing_requested():  # off: nothing more of kvtrace is imported
        return
    try:
        from kvtrace.instrumentation.config import enabled_settings

        settings = enabled_settings(log)
        if settings is None:
            return
        _installed = True  # before patching: a second call must never patch (and trace) twice
        _patch_scheduler(settings)
    except Exception:  # noqa: BLE001 - never stop vLLM from starting
        log.exception("kvtrace: could not instrument vLLM; the engine runs without tracing")
        return
    try:
        _patch_engine_core()
    except Exception:  # noqa: BLE001
        log.exception("kvtrace: could not set up the correctness canary; tracing goes on without it")


def _patch_scheduler(settings: Any) -> None:
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError:
        log.warning("kvtrace: vLLM's v1 Scheduler is not importable; tracing is off")
        return
    from kvtrace.instrumentation.hooks import patch_class

    def with_shim(original: Any) -> Any:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            try:
                attach(self, settings)
            except Exception:  # noqa: BLE001
                log.exception("kvtrace: could not attach to this scheduler; it runs without tracing")

        return __init__

    patch_class(Scheduler, "__init__", with_shim)


def _patch_engine_core() -> None:
    """The correctness canary (KVTRACE_VERIFY_RATE > 0) sits on the engine core, beside the
    scheduler it sends its re-runs to. It attaches at the core's first request: in the engine
    core's own process (`vllm serve`) plugins are loaded inside `EngineCore.__init__`, too late
    to wrap that constructor, while a method patched on the class reaches the instance."""
    from kvtrace.instrumentation.config import ConfigError
    from kvtrace.instrumentation.vllm.canary import CanarySettings
    from kvtrace.instrumentation.vllm.canary import attach as attach_canary

    try:
        canary = CanarySettings.from_env()
    except ConfigError as exc:
        log.error("kvtrace: %s; the canary is off", exc)
        return
    if not canary.enabled:
        return
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:
        log.warning("kvtrace: vLLM's v1 EngineCore is not importable; the canary is off")
        return
    from kvtrace.instrumentation.hooks import patch_class

    def with_canary(original: Any) -> Any:
        def add_request(self: Any, request: Any, request_wave: int = 0) -> Any:
            if not hasattr(self, "_kvtrace_canary"):  # never self.__dict__: it would slow the engine's attribute reads
                self._kvtrace_canary = None
                try:
                    attached = attach_canary(self, canary) is not None
                except Exception:  # noqa: BLE001 - only the attach is fenced: the request is the engine's business
                    log.exception("kvtrace: could not attach the canary; the engine runs without it")
                    attached = False
                if attached:
                    return self.add_request(request, request_wave)  # through the canary's own wrapper
            return original(self, request, request_wave)

        return add_request

    patch_class(EngineCore, "add_request", with_canary)


def attach(scheduler: Any, settings: Any = None) -> Any:
    """Instrument one scheduler's KV-cache manager; returns the shim."""
    from kvtrace.instrumentation.api import get_emitter
    from kvtrace.instrumentation.config import EmitterSettings, configure, engine_instance
    from kvtrace.instrumentation.vllm.shim import CacheManagerShim, Identity

    settings = settings or EmitterSettings.from_env()
    emitter = get_emitter()
    if type(emitter).__name__ == "NoopEmitter":
        emitter = configure(settings, engine="vllm")
    config = scheduler.vllm_config
    model = config.model_config
    identity = Identity(
        instance=engine_instance(settings),
        model=str(getattr(model, "served_model_name", None) or model.model),
        model_revision=str(getattr(model, "revision", None) or ""),
        kv_dtype=str(getattr(config.cache_config, "cache_dtype", "") or ""),
        default_tenant=settings.tenant,
    )
    shim = CacheManagerShim(scheduler.kv_cache_manager, emitter, identity, sample_rate=settings.sample_rate).install()
    shim.watch_preemptions(scheduler)
    scheduler._kvtrace_shim = shim
    from kvtrace.instrumentation.vllm.weights import track

    track(shim, model)  # a never-empty revision, moved on every weight update
    return shim
