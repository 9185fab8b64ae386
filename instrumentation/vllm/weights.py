"""Which weights computed a block: a revision that changes whenever the engine's weights do.

Reuse is only valid under the weights that computed the KV. vLLM keys its prefix cache by
tokens (and adapter, salt), not by weights, so after an in-place update (`reload_weights` from
an edited checkpoint, RL weight syncs) it reuses KV computed with the old weights. kvtrace
stamps every event with a revision that is never empty (an empty one means "not reported" to
the analysis and would hide exactly this) and moves it on each weight update, so such reuse is
an identity mismatch, whether or not the engine resets its cache:

    <HF revision or "local">:<fingerprint of the checkpoint files>:<vLLM weight version>+<updates>

The fingerprint hashes the weight files' names, sizes and modification times (not their bytes:
that would read gigabytes at start-up). The update counter catches in-memory updates that leave
the files alone; when the weights did not really change, the oracle (`kvtrace verify`) shows
the alarm was conservative.

The hook is `EngineCore.collective_rpc`, which runs in the scheduler's process (where the
shim lives) in-process and with multiprocessing alike; a worker-side hook would not reach it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import weakref
from pathlib import Path
from typing import Any

from kvtrace.instrumentation.hooks import patch_class

log = logging.getLogger("kvtrace.vllm")

WEIGHT_METHODS = frozenset({"reload_weights", "update_weights", "finish_weight_update", "load_weights"})
"""Worker calls (by name) after which the engine's weights may differ."""
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_shims: weakref.WeakSet[Any] = weakref.WeakSet()
_adapters: dict[tuple[str, str], str] = {}  # (name, path) -> label
_updates = 0
_patched = False


def fingerprint(model: str, recursive: bool = True) -> str:
    """12 hex digits naming the weight files of a local checkpoint (or an adapter's folder, not
    recursive); "" when `model` is not a local directory (a hub name: its revision names it)."""
    if not os.path.isdir(model):
        return ""
    root = Path(model)
    files = root.rglob("*") if recursive else (Path(e.path) for e in os.scandir(model))
    digest = hashlib.sha256()
    for path in sorted(p for p in files if p.suffix in _WEIGHT_SUFFIXES and p.is_file()):
        st = path.stat()
        digest.update(f"{path.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:12]


def revision(model_config: Any, weight_version: str = "", updates: int = 0, model_path: str | None = None) -> str:
    """The revision stamped on events: never empty."""
    hf = str(getattr(model_config, "revision", None) or "local")
    path = model_path or str(getattr(model_config, "model", "") or "")
    return f"{hf}:{fingerprint(path) or '-'}:{weight_version or 'default'}+{updates}"


def track(shim: Any, model_config: Any) -> None:
    """Follow this shim's weights: stamp the current revision now and after every update."""
    shim._kvtrace_model_config = model_config
    shim.set_model_revision(revision(model_config, updates=_updates))
    _shims.add(shim)
    _patch_engine_core()


def adapter_label(lora: Any) -> str:
    """An adapter's identity: its name and a fingerprint of its files, `name@<12 hex>`.

    vLLM keys cached blocks by adapter name and path, so rewriting an adapter's files and
    reloading it in place (`load_inplace`) reuses KV its old weights computed. The fingerprint
    is read once per adapter and again whenever a request or `add_lora` reloads it in place, so
    blocks from before the reload no longer match."""
    if lora is None:
        return ""
    name = str(getattr(lora, "lora_name", "") or "")
    path = str(getattr(lora, "lora_path", "") or "")
    key = (name, path)
    label = _adapters.get(key)
    # A served engine keeps the request that reloaded an adapter in place and sends later
    # requests with it, so this runs per event for them: a handful of stat calls, no walk.
    if label is None or getattr(lora, "load_inplace", False):
        mark = fingerprint(path, recursive=False) if path else ""
        label = _adapters[key] = f"{name}@{mark}" if mark else name
    return label


def _method_name(method: Any) -> str:
    return method if isinstance(method, str) else str(getattr(method, "__name__", ""))


def weights_changed(method: str, args: Any = (), kwargs: Any = None, weight_version: str = "") -> None:
    """Move every tracked shim in this process to a new revision."""
    global _updates
    _updates += 1
    path = None
    if method == "reload_weights":  # `weights_path=` repoints the worker at other files
        path = (kwargs or {}).get("weights_path") or None
    for shim in list(_shims):
        try:
            shim.set_model_revision(revision(shim._kvtrace_model_config, weight_version, _updates, path))
        except Exception:  # noqa: BLE001 - never fail the engine's weight update
            log.exception("kvtrace: could not record a weight update")


def _patch_engine_core() -> None:
    global _patched
    if _patched:
        return
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:
        log.warning("kvtrace: vLLM's EngineCore is not importable; weight updates are not tracked")
        return

    def recording_updates(original: Any) -> Any:
        def collective_rpc(self: Any, method: Any, timeout: Any = None, args: tuple = (), kwargs: Any = None) -> Any:
            result = original(self, method, timeout, args, kwargs)
            try:
                name = _method_name(method)
                if name in WEIGHT_METHODS:
                    weights_changed(name, args, kwargs, str(getattr(self, "_weight_version", "") or ""))
            except Exception:  # noqa: BLE001
                log.exception("kvtrace: could not record a weight update")
            return result

        return collective_rpc

    if not patch_class(EngineCore, "collective_rpc", recording_updates):
        log.warning("kvtrace: vLLM's EngineCore has no collective_rpc; weight updates are not tracked")
        return
    _patched = True
    # An in-place adapter reload re-reads its fingerprint; a new weight version moves the revision.
    _after(EngineCore, "add_lora", lambda core, lora_request, *a, **k: adapter_label(lora_request))
    _after(EngineCore, "set_weight_version", lambda core, *a, **k: weights_changed(
        "set_weight_version", weight_version=str(getattr(core, "_weight_version", "") or "")))


def _after(cls: Any, name: str, hook: Any) -> None:
    """Run `hook(self, *args)` after `cls.name`, fenced; nothing when vLLM has no such method."""

    def hooked(original: Any) -> Any:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            try:
                hook(self, *args, **kwargs)
            except Exception:  # noqa: BLE001 - never fail the engine's call
                log.exception("kvtrace: the %s hook failed", name)
            return result

        return wrapper

    patch_class(cls, name, hooked)
