"""The connector shim: a KV connector that wraps another one and reports its offloads and loads.

Configure it in place of the real connector and name the real one inside:

    KVTransferConfig(kv_connector="KvtraceConnector",  # or KvtraceConnectorHMA for hybrid models
                     kv_connector_module_path="kvtrace.instrumentation.vllm.connector",
                     kv_role="kv_both",
                     kv_connector_extra_config={"kvtrace_inner": "OffloadingConnector", ...})

Every call is forwarded unchanged: vLLM's base class has a default for almost every method, so
the wrapper defines a forwarding method for each one (generated from the base class, so a new
vLLM method is forwarded too, never silently replaced by the base default). Observed, on the
scheduler side, where block keys are known:
- `offload` (device -> the connector's tier) when the connector's metadata schedules a store
  (OffloadingConnector `store_jobs`, ExampleConnector requests with `is_store`), as a run of
  block keys read from the device blocks;
- `load` (the tier -> device) for a request admitted with external tokens
  (`update_state_after_alloc`), emitted when the scheduler hears the load is done, with its
  duration, and `in_flight` set when the connector loads asynchronously (the request waited).
`nbytes` is per block (in a run too): the group's page size x its layers. The tier comes from
`kvtrace_tier` in the extra config, or from the connector (host for CPU offloading, disk for
the example disk connector, remote otherwise). Evictions inside the connector's own tier are not
visible through this API and are not reported.
"""

from __future__ import annotations

import importlib
import logging
import struct
import time
from typing import Any

from msgspec.structs import replace
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

from kvtrace.instrumentation.api import get_emitter
from kvtrace.instrumentation.vllm.plugin import engine_instance
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import ComponentKind, EventKind, Tier

log = logging.getLogger("kvtrace.vllm.connector")
_U64 = struct.Struct(">Q").unpack_from
_DEFAULT_TIER = {"OffloadingConnector": Tier.HOST, "SimpleCPUOffloadConnector": Tier.HOST,
                 "ExampleConnector": Tier.DISK}


def inner_class(extra: dict[str, Any] | None) -> type:
    """The wrapped connector's class, from `kvtrace_inner` (+ `kvtrace_inner_module`)."""
    extra = extra or {}
    name = extra.get("kvtrace_inner")
    if not name:
        raise ValueError("KvtraceConnector needs kv_connector_extra_config['kvtrace_inner']: the connector to wrap")
    module = extra.get("kvtrace_inner_module")
    if module:
        return getattr(importlib.import_module(module), name)
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return KVConnectorFactory.get_connector_class_by_name(name)


class _Observing(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        cls = inner_class(extra)
        self._inner = cls(vllm_config, role, kv_cache_config)
        self._tier = Tier(extra.get("kvtrace_tier") or _DEFAULT_TIER.get(cls.__name__, Tier.REMOTE))
        self._block_size = int(vllm_config.cache_config.block_size)
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        self._bytes_per_block = [
            int(g.kv_cache_spec.page_size_bytes) * (1 if type(g.kv_cache_spec).__name__ == "UniformTypeKVCacheSpecs"
                                                    else len(g.layer_names))
            for g in groups
        ] or [0]
        model = vllm_config.model_config
        self._base = Event(kind=EventKind.OFFLOAD, engine="vllm", model=str(model.model), instance=engine_instance(),
                           component=ComponentKind.FULL_ATTENTION, block_size=self._block_size,
                           group_block_keys=(), group_hit_tokens=(), reused_tiers=(), reused_tokens=())  # type: ignore[arg-type]
        self._pool: Any = None
        self._matched: dict[str, tuple[int, bool]] = {}  # request -> (local hit tokens, async load)
        self._loading: dict[str, tuple[Event, int]] = {}  # request -> (its load, admitted at, ns)
        self.errors = 0

    # -- observed -----------------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._pool = kv_cache_manager.block_pool
        return self._inner.bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        n, load_async = self._inner.get_num_new_matched_tokens(request, num_computed_tokens)
        if n:  # asked again until admitted: the last answer counts
            self._matched[request.request_id] = (int(num_computed_tokens), bool(load_async))
        return n, load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> Any:
        result = self._inner.update_state_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens > 0:
            try:
                request._kvtrace_external = (int(num_external_tokens), self._tier)  # for the adopt event
                self._loaded(request, num_external_tokens)
            except Exception:  # noqa: BLE001 - the engine must never see kvtrace fail
                self._failed("update_state_after_alloc")
        return result

    def update_connector_output(self, connector_output: Any) -> Any:
        result = self._inner.update_connector_output(connector_output)
        try:
            self._finished_loads(connector_output)
        except Exception:  # noqa: BLE001
            self._failed("update_connector_output")
        return result

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = self._inner.build_connector_meta(scheduler_output)
        try:
            self._stored(meta)
        except Exception:  # noqa: BLE001
            self._failed("build_connector_meta")
        return meta

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)  # keep the base's view consistent too
        self._inner.bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._inner.clear_connector_metadata()

    def _failed(self, hook: str) -> None:
        self.errors += 1
        if self.errors == 1:
            log.exception("kvtrace: the connector %s hook failed; counting further failures silently", hook)

    def _loaded(self, request: Any, num_external_tokens: int) -> None:
        b = self._block_size
        local, in_flight = self._matched.pop(request.request_id, (0, False))
        start, count = local // b, num_external_tokens // b
        keys = [_U64(h, len(h) - 8)[0] or 1 for h in request.block_hashes[start:start + count]]
        if not keys:
            return
        load = replace(
            self._base, kind=EventKind.LOAD, src_tier=self._tier, dst_tier=Tier.DEVICE, block_key=keys[0],
            more_keys=keys[1:], token_start=start * b, token_end=(start + len(keys)) * b,
            nbytes=self._bytes_per_block[0], in_flight=in_flight,
            request_id=str(request.request_id), tenant=getattr(request, "cache_salt", None) or "")
        self._loading[str(request.request_id)] = (load, time.monotonic_ns())

    def _finished_loads(self, output: Any) -> None:
        """Emit admitted loads once the scheduler hears they are done, with how long it took:
        an asynchronous load when its request is in `finished_recving`, a synchronous one at the
        end of the step that ran it (so its duration includes that step). Failed loads are
        dropped: vLLM recomputes those tokens."""
        if not self._loading:
            return
        now = time.monotonic_ns()
        done = set(getattr(output, "finished_recving", None) or ())
        failed = set(getattr(output, "failed_recving", None) or ())
        for rid, (load, admitted) in list(self._loading.items()):
            if rid in failed:
                del self._loading[rid]
            elif rid in done or not load.in_flight:
                del self._loading[rid]
                get_emitter().emit(replace(load, duration_ns=now - admitted))

    def _stored(self, meta: Any) -> None:
        if self._pool is None:
            return
        device_blocks: list[int] = []
        if hasattr(meta, "store_jobs"):  # OffloadingConnector: device blocks -> tier chunks
            for job in meta.store_jobs.values():
                device_blocks.extend(int(i) for i in job.src_spec.block_ids)
        elif hasattr(meta, "requests"):  # ExampleConnector: slot mappings of requests to save
            for rm in meta.requests:
                if rm.is_store:
                    device_blocks.extend(sorted({int(s) // self._block_size for s in rm.slot_mapping.tolist()}))
        keys = []
        for block_id in device_blocks:
            key = self._pool.blocks[block_id]._block_hash
            if key is not None:  # a partial block has no key yet: nothing reusable is stored
                keys.append(_U64(key, len(key) - 12)[0] or 1)
        if keys:
            get_emitter().emit(replace(
                self._base, kind=EventKind.OFFLOAD, src_tier=Tier.DEVICE, dst_tier=self._tier, block_key=keys[0],
                more_keys=keys[1:], nbytes=self._bytes_per_block[0]))

    # -- class-level hooks: vLLM calls them on the class, so the inner class comes from config --
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> Any:
        return inner_class(vllm_config.kv_transfer_config.kv_connector_extra_config).get_required_kvcache_layout(
            vllm_config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: Any) -> bool:
        return inner_class(extra_config).requires_piecewise_for_cudagraph(extra_config)

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        return inner_class(vllm_config.kv_transfer_config.kv_connector_extra_config).build_prom_metrics(
            vllm_config, *args, **kwargs)


def _forward(name: str) -> Any:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._inner, name)(*args, **kwargs)

    method.__name__ = name
    return method


def _forward_property(name: str) -> property:
    return property(lambda self: getattr(self._inner, name))


# Forward every base-class method and property the wrapper does not observe itself.
_SKIP = {"role", "_get_connector_metadata", "build_kv_connector_stats"}
for _name, _value in list(vars(KVConnectorBase_V1).items()):
    if _name.startswith("__") or _name in _SKIP or _name in vars(_Observing):
        continue
    if isinstance(_value, property):
        setattr(_Observing, _name, _forward_property(_name))
    elif callable(_value) and not isinstance(_value, (classmethod, staticmethod)):
        setattr(_Observing, _name, _forward(_name))


class KvtraceConnector(_Observing):
    """For connectors without hybrid-model (HMA) support, such as the example disk connector."""


class KvtraceConnectorHMA(_Observing, SupportsHMA):
    """For connectors with HMA support (vLLM decides from the configured class)."""

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> Any:
        return self._inner.request_finished_all_groups(request, block_ids)
