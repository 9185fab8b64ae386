"""Enablement: every `LMCacheEngine` built after `enable()` is instrumented when it is ready.

LMCache has no in-process extension point for observers (its storage plugins are backends that
take part in every lookup and put; its runtime plugins are separate processes), so kvtrace uses
a documented import hook: `enable()` wraps `LMCacheEngine.post_init`, the call every way of
building an engine ends with (vLLM's and SGLang's connectors, LMCache's builder, standalone
use), and attaches an `LMCacheShim` to that one engine. The vLLM connector shim calls `enable()`
before it builds a wrapped LMCache connector, so `KVTRACE_ENABLED=1` is all a vLLM deployment
sets; elsewhere call it once at start-up:

    from kvtrace.instrumentation.lmcache.plugin import enable
    enable()

It does nothing unless `KVTRACE_ENABLED` is true, never raises, and if this LMCache lacks the
hook point it logs once and LMCache runs untraced.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("kvtrace.lmcache")
_enabled = False


def enable() -> bool:
    """Instrument every LMCache engine this process builds from now on; True when the hook is set."""
    global _enabled
    if _enabled:
        return True
    try:
        from kvtrace.instrumentation.config import enabled_settings

        settings = enabled_settings(log)
        if settings is None:
            return False
        try:
            from lmcache.v1.cache_engine import LMCacheEngine
        except ImportError:
            log.warning("kvtrace: LMCache is not importable here; nothing to instrument")
            return False
        from kvtrace.instrumentation.hooks import patch_class

        def attaching(original: Any) -> Any:
            def post_init(self: Any, *args: Any, **kwargs: Any) -> Any:
                result = original(self, *args, **kwargs)
                try:
                    fresh = getattr(self, "_kvtrace_shim", None) is None
                    if fresh and getattr(self, "storage_manager", None) is not None:
                        attach(self, settings)
                except Exception:  # noqa: BLE001 - never stop LMCache from starting
                    log.exception("kvtrace: could not attach to this LMCache engine; it runs untraced")
                return result

            return post_init

        if not patch_class(LMCacheEngine, "post_init", attaching):
            log.warning("kvtrace: this LMCache's engine has no post_init; it runs untraced")
            return False
        _enabled = True
        return True
    except Exception:  # noqa: BLE001
        log.exception("kvtrace: could not instrument LMCache; it runs untraced")
        return False


def attach(engine: Any, settings: Any = None) -> Any:
    """Instrument one engine (after its `post_init`); returns the shim, also kept on the engine."""
    from kvtrace.instrumentation.api import get_emitter
    from kvtrace.instrumentation.config import EmitterSettings, configure, engine_instance
    from kvtrace.instrumentation.lmcache.shim import LMCacheShim

    settings = settings or EmitterSettings.from_env()
    emitter = get_emitter()
    if type(emitter).__name__ == "NoopEmitter":
        emitter = configure(settings, engine="lmcache")
    shim = LMCacheShim(engine, emitter, instance=engine_instance(settings), default_tenant=settings.tenant).install()
    engine._kvtrace_shim = shim
    return shim
