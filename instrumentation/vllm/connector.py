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
  (OffloadingConnector `store_jobs`, ExampleConnector requests with `is_store`);
- `load` (the tier -> device) for a request admitted with external tokens
  (`update_state_after_alloc`), emitted when the scheduler hears the load is done, with its
  duration, and `in_flight` set when the connector loads asynchronously (the request waited).

Both are runs, one event per KV-cache group that moved blocks (hybrid models under vLLM's HMA
have several: full attention, sliding window, Mamba), named as the cache-manager shim names
that group's commits: the same `group_id`, `component` and block keys, with `token_start` /
`token_end` spanning the group's blocks in the run. What moved is read from the connector, not
assumed: the device blocks of each group in OffloadingConnector's store and load jobs (a
sliding-window or Mamba group moves only the blocks it needs); for other connectors, the
blocks ExampleConnector's store names, and for a load the group's blocks allocated for the
external tokens. `nbytes` is per block (in a run too): the group's page size x its layers.
The tier comes from `kvtrace_tier` in the extra config, or from the connector (host for CPU
offloading, disk for the example disk connector, remote otherwise). Evictions inside the
connector's own tier are not visible through this API and are not reported.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from msgspec.structs import replace
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

from kvtrace.instrumentation.api import get_emitter
from kvtrace.instrumentation.config import engine_instance
from kvtrace.instrumentation.hooks import transparent
from kvtrace.instrumentation.vllm.recipe import component_of
from kvtrace.instrumentation.vllm.shim import bytes_per_block, key_of, key_of_pool_key
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import EventKind, Tier

log = logging.getLogger("kvtrace.vllm.connector")
_DEFAULT_TIER = {"OffloadingConnector": Tier.HOST, "SimpleCPUOffloadConnector": Tier.HOST,
                 "ExampleConnector": Tier.DISK}

Found = list[tuple[int, int]]  # (block index in the request's group, block key), in order


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


def spec_group_ids(kv_cache_config: Any) -> tuple[int, ...]:
    """The KV-cache groups OffloadingConnector's transfer specs list, in their order: it moves
    the prefix-cacheable groups only, so position i of a spec is not always group i."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import get_offloading_group_ids

        return tuple(int(g) for g in get_offloading_group_ids(kv_cache_config))
    except Exception:  # noqa: BLE001 - another vLLM: fall back to every group, in order
        return tuple(range(len(getattr(kv_cache_config, "kv_cache_groups", None) or ())))


def request_keys(request: Any) -> list[int]:
    """Block keys of the request's hash chain, kept on the request as the cache-manager shim
    keeps them (same attribute, same keys), so the two shims compute each key once."""
    keys: list[int] | None = getattr(request, "_kvtrace_keys", None)
    hashes = request.block_hashes
    if keys is None:
        keys = request._kvtrace_keys = []
    if len(keys) < len(hashes):
        keys.extend(key_of(h) for h in hashes[len(keys):])
    return keys


@dataclass(slots=True)
class _Load:
    """A load admitted and not yet reported."""

    runs: list[Event]  # one per group: from the allocation, then from the connector's load job
    admitted_ns: int
    in_flight: bool


class _Observing(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        cls = inner_class(extra)
        if "lmcache" in f"{cls.__module__}.{cls.__name__}".lower():
            # LMCache behind the connector: its own engine is traced too (see the LMCache shim)
            from kvtrace.instrumentation.lmcache.plugin import enable

            enable()
        self._inner = cls(vllm_config, role, kv_cache_config)
        self._tier = Tier(extra.get("kvtrace_tier") or _DEFAULT_TIER.get(cls.__name__, Tier.REMOTE))
        self._block_size = int(vllm_config.cache_config.block_size)
        groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
        self._bytes_per_block = [bytes_per_block(g) for g in groups] or [0]
        self._group_block_size = [int(g.kv_cache_spec.block_size) for g in groups] or [self._block_size]
        self._spec_groups = spec_group_ids(kv_cache_config)
        self._hash_block_size = self._group_block_size[0]  # the pool's, once bound (as the shim does)
        model = vllm_config.model_config
        base = Event(kind=EventKind.OFFLOAD, engine="vllm", model=str(model.model), instance=engine_instance(),
                     group_block_keys=(), group_hit_tokens=(), reused_tiers=(), reused_tokens=())  # type: ignore[arg-type]
        specs = [g.kv_cache_spec for g in groups] or [None]
        self._group_base = [  # each group's events: its id, component, block size and bytes per block
            replace(base, group_id=g, component=component_of(spec), block_size=self._group_block_size[g],
                    nbytes=self._bytes_per_block[g])
            for g, spec in enumerate(specs)
        ]
        self._pool: Any = None
        self._requests: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()  # see _remember
        self._matched: dict[str, tuple[int, bool]] = {}  # request -> (local hit tokens, async load)
        self._loading: dict[str, _Load] = {}
        self.errors = 0

    # -- observed -----------------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        try:
            self._pool = kv_cache_manager.block_pool
            self._hash_block_size = int(getattr(self._pool, "hash_block_size", 0) or self._hash_block_size)
        except Exception:  # noqa: BLE001 - the engine must never see kvtrace fail
            self._failed("bind_kv_cache_manager")
        return self._inner.bind_kv_cache_manager(kv_cache_manager)

    def on_new_request(self, request: Any) -> Any:
        result = self._inner.on_new_request(request)
        self._remember(request)
        return result

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int, *args: Any,
                                   **kwargs: Any) -> Any:
        n, load_async = self._inner.get_num_new_matched_tokens(request, num_computed_tokens, *args, **kwargs)
        if n:  # asked again until admitted: the last answer counts
            try:
                self._matched[str(request.request_id)] = (int(num_computed_tokens), bool(load_async))
            except Exception:  # noqa: BLE001
                self._failed("get_num_new_matched_tokens")
        return n, load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> Any:
        result = self._inner.update_state_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens > 0:
            try:
                request._kvtrace_external = (int(num_external_tokens), self._tier)  # for the adopt event
                self._admitted(request, blocks, int(num_external_tokens))
            except Exception:  # noqa: BLE001
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
            self._scheduled(meta)
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

    def _remember(self, request: Any) -> None:
        """Keep a weak reference to the request: a store job names only its id, and the
        request's hash chain places each stored block. Weak, so kvtrace never keeps a request
        alive (vLLM's connector holds it while its jobs run)."""
        try:
            self._requests[str(request.request_id)] = request
        except Exception:  # noqa: BLE001
            self._failed("on_new_request")

    # -- block keys ---------------------------------------------------------------------------
    def _chain(self, request: Any, group: int) -> list[int]:
        """The group's block keys in order, as the cache-manager shim derives them: a group with
        blocks k times the hash block size is keyed by every k-th hash of the request's chain."""
        keys = request_keys(request)
        k = max(self._group_block_size[group] // self._hash_block_size, 1)
        return keys[k - 1 :: k] if k > 1 else keys

    def _run(self, group: int, found: Found, **fields: Any) -> Event:
        """One event naming the blocks found (in order): block_key + more_keys, and the tokens
        from the first block to the end of the last."""
        b = self._group_block_size[group]
        return replace(self._group_base[group], block_key=found[0][1], more_keys=[k for _, k in found[1:]],
                       token_start=found[0][0] * b, token_end=(found[-1][0] + 1) * b, **fields)

    def _spec_runs(self, spec: Any) -> Iterator[tuple[int, int, list[int]]]:
        """(group, index of its first block in the request, its device block ids) for each group
        an OffloadingConnector transfer spec moves blocks of (`group_sizes` splits the ids)."""
        ids = [int(b) for b in spec.block_ids]
        sizes = getattr(spec, "group_sizes", None)
        if sizes is None:  # a single group
            starts = getattr(spec, "block_indices", None)
            yield 0, int(starts[0]) if starts else 0, ids
            return
        if len(sizes) == len(self._spec_groups):
            groups: Sequence[int] = self._spec_groups
        elif len(sizes) <= len(self._group_base):
            groups = range(len(sizes))
        else:
            raise ValueError(f"a transfer spec lists {len(sizes)} groups; the KV-cache config has "
                             f"{len(self._group_base)}")
        at = 0
        for group, n, start in zip(groups, sizes, spec.block_indices, strict=False):
            if n:
                yield int(group), int(start), ids[at : at + int(n)]
            at += int(n)

    # -- loads --------------------------------------------------------------------------------
    def _admitted(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """A load was admitted: note its runs from the request's allocation (each group's
        non-null blocks that the external tokens fill); a connector that names its load job
        (OffloadingConnector, in this step's metadata) replaces them with what it moves."""
        rid = str(request.request_id)
        self._remember(request)
        local, in_flight = self._matched.pop(rid, (0, False))
        runs = []
        for group, group_blocks in enumerate(getattr(blocks, "blocks", ())[: len(self._group_base)]):
            b = self._group_block_size[group]
            chain = self._chain(request, group)
            stop = min((local + num_external_tokens) // b, len(group_blocks), len(chain))
            found = [(i, chain[i]) for i in range(local // b, stop)
                     if not getattr(group_blocks[i], "is_null", False)]
            if found:
                runs.append(self._load_run(request, group, found, in_flight))
        self._loading[rid] = _Load(runs, time.monotonic_ns(), in_flight)

    def _load_run(self, request: Any, group: int, found: Found, in_flight: bool) -> Event:
        return self._run(group, found, kind=EventKind.LOAD, src_tier=self._tier, dst_tier=Tier.DEVICE,
                         in_flight=in_flight, request_id=str(request.request_id),
                         tenant=getattr(request, "cache_salt", None) or "")

    def _load_job(self, job: Any) -> None:
        """OffloadingConnector's load job for an admitted request: per group, the contiguous
        device blocks it fills from `block_indices[g]` on (a sliding-window group only its window)."""
        load = self._loading.get(str(job.req_id))
        request = self._requests.get(str(job.req_id))
        if load is None or request is None:
            return
        runs = []
        for group, start, ids in self._spec_runs(job.dst_spec):
            chain = self._chain(request, group)
            found = [(i, chain[i]) for i in range(start, min(start + len(ids), len(chain)))]
            if found:
                runs.append(self._load_run(request, group, found, load.in_flight))
        load.runs = runs

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
        emitter = get_emitter()
        for rid, load in list(self._loading.items()):
            if rid in failed:
                del self._loading[rid]
            elif rid in done or not load.in_flight:
                del self._loading[rid]
                for run in load.runs:
                    emitter.emit(replace(run, duration_ns=now - load.admitted_ns))

    # -- offloads -----------------------------------------------------------------------------
    def _scheduled(self, meta: Any) -> None:
        if hasattr(meta, "load_jobs") and self._loading:
            for job in meta.load_jobs.values():
                self._load_job(job)
        if self._pool is None:
            return
        if hasattr(meta, "store_jobs"):  # OffloadingConnector: device blocks -> tier chunks, per group
            for job in meta.store_jobs.values():
                request = self._requests.get(str(job.req_id))
                for group, start, ids in self._spec_runs(job.src_spec):
                    self._stored(group, request, start, ids)
        elif hasattr(meta, "requests"):  # ExampleConnector: slot mappings of whole prompts to save
            for rm in meta.requests:
                if rm.is_store:  # its blocks in token order, from the first
                    b = self._group_block_size[0]
                    blocks = dict.fromkeys(int(s) // b for s in rm.slot_mapping.tolist())
                    self._stored(0, None, 0, list(blocks))

    def _stored(self, group: int, request: Any, start: int, block_ids: list[int]) -> None:
        """One offload run for a group's device blocks, keyed as the pool holds them. Blocks are
        in order but a job may skip some (a sliding window stores only what a hit can use), so
        each block is placed by finding its key in the request's chain from `start` on; without
        the request, the blocks are taken to follow each other from `start`. A block without a
        key (a partial block) holds nothing reusable and is left out."""
        chain = self._chain(request, group) if request is not None else None
        blocks = self._pool.blocks
        found: Found = []
        at = start
        for j, block_id in enumerate(block_ids):
            pool_key = blocks[block_id]._block_hash
            if pool_key is None:
                continue
            key = key_of_pool_key(pool_key)
            if chain is None:
                found.append((start + j, key))
                continue
            try:
                at = chain.index(key, at)
            except ValueError:
                continue  # not this request's block at or after `at`: the pool reused it already
            found.append((at, key))
            at += 1
        if found:
            get_emitter().emit(self._run(group, found, kind=EventKind.OFFLOAD, src_tier=Tier.DEVICE,
                                         dst_tier=self._tier))

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

    return method


def _forward_property(name: str) -> property:
    return property(lambda self: getattr(self._inner, name))


# Forward every base-class method and property the wrapper does not observe itself; every method
# (forwarded or observed) wears the base method's face, as vLLM's own connectors do.
_SKIP = {"role", "_get_connector_metadata", "build_kv_connector_stats"}
for _name, _value in list(vars(KVConnectorBase_V1).items()):
    if _name.startswith("__") or _name in _SKIP:
        continue
    if _name in vars(_Observing):
        if inspect.isfunction(_value) and inspect.isfunction(vars(_Observing)[_name]):
            transparent(_value, vars(_Observing)[_name])
    elif isinstance(_value, property):
        setattr(_Observing, _name, _forward_property(_name))
    elif callable(_value) and not isinstance(_value, (classmethod, staticmethod)):
        setattr(_Observing, _name, transparent(_value, _forward(_name)))


class KvtraceConnector(_Observing):
    """For connectors without hybrid-model (HMA) support, such as the example disk connector."""


class KvtraceConnectorHMA(_Observing, SupportsHMA):
    """For connectors with HMA support (vLLM decides from the configured class)."""

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> Any:
        return self._inner.request_finished_all_groups(request, block_ids)


if inspect.isfunction(getattr(SupportsHMA, "request_finished_all_groups", None)):
    transparent(SupportsHMA.request_finished_all_groups, KvtraceConnectorHMA.request_finished_all_groups)
