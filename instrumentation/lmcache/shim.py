"""The LMCache shim: stores, lookups, retrieves, tier writes, evictions and clears of one engine.

It wraps methods of one `LMCacheEngine`, its storage manager and its local CPU and local disk
backends (never their classes: two engines in a process keep their own hooks). The original
runs first and its result is returned unchanged; every hook is fenced, so an error in kvtrace
is counted and logged once and LMCache goes on as if kvtrace were not there.

What is recorded, per chunk of `chunk_size` tokens (the chunk is the object; its key is LMCache's
prefix-chained chunk hash with the chunk's tags folded in, see `keys`):
- commit (host): a store's chunks entering the CPU backend's hot cache (`batched_submit_put_task`), as
  one run per store;
- offload (host -> disk): the disk backend's write completing (`insert_key`, on LMCache's disk
  worker thread), with its bytes and the write's duration; when the host cache no longer holds
  the chunk (evicted meanwhile, a disk-only store location, the hot cache off) the disk write is
  its only copy and commits it (disk);
- load: a retrieve delivering chunks to the serving engine (src = the backend each came from,
  dst = device), with bytes and duration; and a disk chunk written back into the CPU cache on
  the way (disk -> host). The device copy is the engine's, not LMCache's: the same retrieve
  hands it over (evict on device, reason request_finished), so LMCache's own picture never
  counts engine memory as its cache;
- evict: a backend's cache policy making room (`remove(force=False)`: reason capacity, with
  the tier), or a removal through the API (reason explicit);
- invalidate: `clear()` (reason reset, scoped to the tiers of the backends that actually
  clear: LMCache's disk backend has no clear, so its copies stay valid; chunks the CPU clear
  keeps because they are in use are published again), a prefix clear `clear(tokens)` over
  every backend (reason explicit, per chunk), and a disk chunk whose file cannot be read
  (reason corruption, then evicted: LMCache drops the key);
- lookup: `lookup`, with the request's chunk chain and LMCache's hit (repeats of a request
  with the same answer are dropped, as the engine's scheduler polls while a request waits);
- adopt: `retrieve`: tokens the engine already held (the masked prefix, from device) and the
  tokens each backend delivered;
- attach: once, when installed: the release, the model, the chunk size and the recipe it makes
  (`recipe.recipe_from_chunk_size`), then the tiers this process holds nothing on invalidated
  (`restart_tiers`). LMCache does not know the serving engine's longest request: the attach
  says 0, and the engine in front of it says its own.

The request id is the caller's: `lookup_id` at lookup, `req_id` at retrieve.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from msgspec.structs import replace

from kvtrace.instrumentation.api import Emitter
from kvtrace.instrumentation.attach import attach_events, distribution_version
from kvtrace.instrumentation.hooks import HookSet
from kvtrace.instrumentation.lmcache.keys import block_key, namespace, tags_of
from kvtrace.instrumentation.lmcache.recipe import recipe_from_chunk_size
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import ComponentKind, EventKind, Reason, Tier

log = logging.getLogger("kvtrace.lmcache")

BACKEND_TIER = {"LocalCPUBackend": Tier.HOST, "LocalDiskBackend": Tier.DISK, "GdsBackend": Tier.DISK,
                "PDBackend": Tier.REMOTE, "P2PBackend": Tier.REMOTE}
"""LMCache's backend names as tiers; any other backend (remote stores, plugins) is remote."""


def tier_of(backend_name: str) -> Tier:
    return BACKEND_TIER.get(backend_name, Tier.REMOTE)


class _Op(IntEnum):
    STORE = 1
    LOOKUP = 2
    RETRIEVE = 3
    CLEAR_ALL = 4
    CLEAR_PREFIX = 5


@dataclass(slots=True)
class _Scope:
    """One engine call in progress on this thread: what its hooks saw, reported when it returns."""

    op: _Op
    chain: list[tuple[int, int, Any]] | None = None  # (start, end, key) from the token database
    fetch_tier: Tier = Tier.NONE  # set while a backend's get runs: CPU puts then are write-backs
    fetch_t0: int = 0
    got: dict[Any, tuple[Tier, int]] = field(default_factory=dict)  # key -> (tier, nbytes) a get returned
    removed: set[Any] = field(default_factory=set)  # keys a prefix clear invalidated
    all_locations: bool = True


_RUN_CAP = 4096  # keys per event at most: a run is one fact about many chunks, not an unbounded list


class LMCacheShim:
    """Instruments one `LMCacheEngine`; `install()` once after `post_init`, `uninstall()` to restore."""

    def __init__(self, engine: Any, emitter: Emitter, instance: str = "", engine_version: str | None = None,
                 default_tenant: str = "") -> None:
        """`engine_version` defaults to the installed lmcache distribution's."""
        self.engine = engine
        self.emitter = emitter
        self.errors = 0
        self._failed_names: set[str] = set()
        self.hooks = HookSet("LMCache", log, self._failed)  # what `install` wraps
        self._tl = threading.local()
        self._cpu: Any = None
        self._disk: Any = None
        meta = engine.metadata
        self.chunk_size = int(getattr(meta, "chunk_size", 0) or getattr(engine.config, "chunk_size", 256))
        self.worker_id = int(getattr(meta, "worker_id", 0) or 0)
        world = int(getattr(meta, "world_size", 1) or 1)
        base = instance or "lmcache"
        self.instance = f"{base}/lmcache" if world == 1 else f"{base}/lmcache/{self.worker_id}"
        self.default_tenant = default_tenant
        self._lookups = 0
        self._looked_up: OrderedDict[str, int] = OrderedDict()  # request -> hit last reported
        if engine_version is None:
            engine_version = distribution_version("lmcache")
        self.engine_version = engine_version
        self._base = Event(kind=EventKind.LOOKUP, engine="lmcache", engine_version=engine_version,
                           instance=self.instance, model=str(getattr(meta, "model_name", "") or ""),
                           kv_dtype=_dtype_name(getattr(meta, "kv_dtype", "")), block_size=self.chunk_size,
                           tp_rank=self.worker_id, component=ComponentKind.FULL_ATTENTION,
                           group_block_keys=(), group_hit_tokens=(), reused_tiers=(), reused_tokens=(),  # type: ignore[arg-type]
                           more_keys=())  # type: ignore[arg-type]

    # -- install ---------------------------------------------------------------------------------
    def install(self) -> LMCacheShim:
        engine = self.engine
        if getattr(engine, "use_layerwise", False):
            log.warning("kvtrace: LMCache's layerwise mode is not traced (per-layer keys); this engine runs untraced")
            return self
        if getattr(engine.config, "save_unfull_chunk", False):
            log.warning("kvtrace: LMCache stores partial last chunks here (save_unfull_chunk); kvtrace aligns "
                        "boundaries to whole chunks, so a partial chunk LMCache delivers reads as reuse beyond "
                        "what is recoverable")
        self._around(engine.token_database, "process_tokens", self._process_tokens)
        self._around(engine, "store", self._store)
        self._around(engine, "lookup", self._lookup)
        self._around(engine, "retrieve", self._retrieve)
        self._around(engine, "clear", self._clear)
        manager = engine.storage_manager
        self._around(manager, "batched_get", self._batched_get)
        backends = getattr(manager, "storage_backends", {}) or {}
        cpu = backends.get("LocalCPUBackend")
        if cpu is not None:
            self._around(cpu, "batched_submit_put_task", self._cpu_batched_put)
            self._around(cpu, "submit_put_task", self._cpu_put)
            self._around(cpu, "remove", self._remover(Tier.HOST, lambda: cpu.hot_cache))
        disk = backends.get("LocalDiskBackend")
        if disk is not None:
            self._around(disk, "async_save_bytes_to_disk", self._disk_write)
            self._around(disk, "insert_key", self._disk_insert)
            self._around(disk, "remove", self._remover(Tier.DISK, lambda: disk.dict))
        self._cpu, self._disk = cpu, disk
        self._attached()
        return self

    def _attached(self) -> None:
        """The engine, its recipe and its empty memory, once (see `kvtrace.instrumentation.attach`)."""
        if not self.emitter.enabled:
            return
        try:
            events = attach_events(self._base, recipe_from_chunk_size(self.chunk_size),
                                   engine_version=self.engine_version, block_size=self.chunk_size,
                                   tiers=restart_tiers(self._disk))
            for event in events:
                self.emitter.emit(event)
        except Exception:  # noqa: BLE001 - the engine must never see kvtrace fail
            self._failed("attach")

    def uninstall(self) -> None:
        self.hooks.restore()

    def _around(self, obj: Any, name: str, hook: Callable[..., Any]) -> None:
        """Replace `obj.name` by `hook(original, *args, **kwargs)`; a missing method leaves it off."""
        original = getattr(obj, name, None) if obj is not None else None
        if original is None:
            log.warning("kvtrace: LMCache's %s has no %s; that hook is off", type(obj).__name__, name)
            return

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return hook(original, *args, **kwargs)

        self.hooks.replace(obj, name, wrapper)

    def _failed(self, where: str) -> None:
        self.errors += 1
        if where not in self._failed_names:
            self._failed_names.add(where)
            log.exception("kvtrace: the LMCache %s hook failed; LMCache goes on untraced there", where)

    def _scope(self) -> _Scope | None:
        return getattr(self._tl, "scope", None)

    def _run(self, op: _Op, original: Callable[..., Any], args: tuple, kwargs: dict,
             report: Callable[[_Scope, Any, int], None], scope: _Scope | None = None) -> Any:
        """Run one engine call with a scope its inner hooks fill; report it when it returns."""
        outer = self._scope()
        if outer is not None or not self.emitter.enabled:  # nested (retrieve inside lookup...) or off
            return original(*args, **kwargs)
        scope = scope or _Scope(op)
        self._tl.scope = scope
        t0 = time.perf_counter_ns()
        try:
            result = original(*args, **kwargs)
        finally:
            self._tl.scope = None
        try:
            report(scope, result, time.perf_counter_ns() - t0)
        except Exception:  # noqa: BLE001 - the engine must never see kvtrace fail
            self._failed(op.name.lower())
        return result

    # -- events --------------------------------------------------------------------------------
    def _event(self, kind: EventKind, key: Any, **fields: Any) -> Event:
        tenant, adapter = namespace(getattr(key, "tags", None)) if key is not None else ("", "")
        return replace(self._base, kind=kind, tenant=tenant or self.default_tenant, adapter=adapter, **fields)

    def _for_request(self, kind: EventKind, kwargs: dict, **fields: Any) -> Event:
        """A request's event (lookup, adopt), in the namespace its request configs' tags name."""
        tenant, adapter = namespace(tags_of(kwargs.get("request_configs")))
        return replace(self._base, kind=kind, tenant=tenant or self.default_tenant, adapter=adapter,
                       component=ComponentKind.NONE, block_size=0, **fields)

    def _emit_runs(self, kind: EventKind, items: Iterable[tuple[Any, int]], where: dict[Any, tuple[int, int]] | None,
                   **fields: Any) -> None:
        """One event per run of chunks with the same namespace and size: key + more_keys."""
        run: list[int] = []
        head: Any = None
        nbytes = 0
        start = end = 0
        for key, size in items:
            tags = getattr(key, "tags", None)
            pos = where.get(key) if where else None
            if run and (tags != getattr(head, "tags", None) or size != nbytes or len(run) >= _RUN_CAP
                        or (pos is not None and pos[0] != end)):
                self._emit_run(kind, head, run, nbytes, start, end, fields)
                run = []
            if not run:
                head, nbytes = key, size
                start = pos[0] if pos is not None else 0
            run.append(block_key(key))
            end = pos[1] if pos is not None else 0
        if run:
            self._emit_run(kind, head, run, nbytes, start, end, fields)

    def _emit_run(self, kind: EventKind, head: Any, run: list[int], nbytes: int, start: int, end: int,
                  fields: dict[str, Any]) -> None:
        self.emitter.emit(self._event(kind, head, block_key=run[0], more_keys=run[1:], nbytes=nbytes,
                                      token_start=start, token_end=end, **fields))

    @staticmethod
    def _where(scope: _Scope) -> dict[Any, tuple[int, int]]:
        return {key: (s, e) for s, e, key in scope.chain or ()}

    # -- hooks: the engine -----------------------------------------------------------------------
    def _process_tokens(self, original: Callable[..., Iterator[Any]], *args: Any, **kwargs: Any) -> Iterator[Any]:
        scope = self._scope()
        if scope is None or scope.chain is not None or not kwargs.get("make_key", True):
            return original(*args, **kwargs)
        scope.chain = []
        return self._recording(original(*args, **kwargs), scope.chain)

    @staticmethod
    def _recording(items: Iterator[Any], into: list[Any]) -> Iterator[Any]:
        for item in items:
            into.append(item)
            yield item

    def _store(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        # nothing to report after: the scope only lends its chain's positions to the commits
        return self._run(_Op.STORE, original, args, kwargs, lambda scope, result, ns: None)

    def _lookup(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self._run(_Op.LOOKUP, original, args, kwargs,
                         lambda scope, hit, _ns: self._report_lookup(scope, hit, args, kwargs))

    def _report_lookup(self, scope: _Scope, hit: Any, args: tuple, kwargs: dict) -> None:
        chain = scope.chain or []
        tokens = kwargs.get("tokens", args[0] if args else None)
        offsets = kwargs.get("offsets")
        prompt = len(tokens) if tokens is not None else sum(offsets or ())
        request_id = kwargs.get("lookup_id")
        if request_id is None:
            self._lookups += 1
            request_id = f"lmcache-lookup-{self._lookups}"
        request_id, hit = str(request_id), int(hit)
        if self._looked_up.get(request_id) == hit:
            return  # the scheduler polling a waiting request: same question, same answer
        self._looked_up[request_id] = hit
        if len(self._looked_up) > 65536:
            self._looked_up.popitem(last=False)
        self.emitter.emit(self._for_request(EventKind.LOOKUP, kwargs, request_id=request_id, prompt_tokens=prompt,
                                            group_block_keys=[[block_key(k) for _, _, k in chain]],
                                            group_hit_tokens=[hit], reported_hit_tokens=hit))

    def _retrieve(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self._run(_Op.RETRIEVE, original, args, kwargs,
                         lambda scope, mask, ns: self._report_retrieve(scope, mask, ns, args, kwargs))

    def _report_retrieve(self, scope: _Scope, ret_mask: Any, elapsed_ns: int, args: tuple, kwargs: dict) -> None:
        tokens = kwargs.get("tokens", args[0] if args else None)
        mask = kwargs.get("mask", args[1] if len(args) > 1 else None)
        total = len(tokens) if tokens is not None else 0
        held = total - int(mask.sum()) if mask is not None else 0  # the prefix the engine already had
        # LMCache delivers a run of chunks from the first one asked for, stopping at the first it
        # cannot read: the chunks inside [held, held + retrieved) are the ones delivered.
        upto = held + int(ret_mask.sum())
        delivered: dict[Tier, list[tuple[Any, int]]] = {}
        tokens_from: dict[Tier, int] = {}
        where = self._where(scope)
        got = scope.got
        for start, end, key in scope.chain or ():
            if held <= start < end <= upto:
                tier, nbytes = got.get(key, (Tier.HOST, 0))
                delivered.setdefault(tier, []).append((key, nbytes))
                tokens_from[tier] = tokens_from.get(tier, 0) + end - start
        total_bytes = sum(n for chunks in delivered.values() for _, n in chunks) or 1
        for tier, chunks in delivered.items():
            share = sum(n for _, n in chunks) / total_bytes
            self._emit_runs(EventKind.LOAD, chunks, where, src_tier=tier, dst_tier=Tier.DEVICE,
                            duration_ns=int(elapsed_ns * share), request_id=_rid(kwargs))
            self._emit_runs(EventKind.EVICT, chunks, where, tier=Tier.DEVICE, reason=Reason.REQUEST_FINISHED)
        reused = {Tier.DEVICE: held, **tokens_from} if held else tokens_from
        self.emitter.emit(self._for_request(EventKind.ADOPT, kwargs, request_id=_rid(kwargs),
                                            reused_tiers=list(reused), reused_tokens=list(reused.values()),
                                            recomputed_tokens=max(total - sum(reused.values()), 0),
                                            duration_ns=elapsed_ns))

    def _clear(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        tokens = kwargs.get("tokens", args[0] if args else None)
        locations = kwargs.get("locations", args[1] if len(args) > 1 else None)
        whole = tokens is None or len(tokens) == 0
        scope = _Scope(_Op.CLEAR_ALL if whole else _Op.CLEAR_PREFIX, all_locations=locations is None)
        cleared: list[str] = []
        if whole and self.emitter.enabled and self._scope() is None:
            try:  # announced before LMCache drops anything: a reset of each tier that can clear
                backends = getattr(self.engine.storage_manager, "storage_backends", {}) or {}
                cleared = [name for name, backend in backends.items()
                           if (locations is None or name in locations) and hasattr(backend, "clear")]
                for name in cleared:
                    self.emitter.emit(replace(self._base, kind=EventKind.INVALIDATE, tier=tier_of(name),
                                              reason=Reason.RESET, component=ComponentKind.NONE))
            except Exception:  # noqa: BLE001
                self._failed("clear")
        return self._run(scope.op, original, args, kwargs, lambda s, n, _ns: self._report_clear(s, cleared),
                         scope=scope)

    def _report_clear(self, scope: _Scope, cleared: list[str]) -> None:
        """LMCache's CPU clear keeps chunks still in use (pinned by a lookup, read by a retrieve,
        being written to disk): they are valid and stay, so they are published again."""
        if scope.op is not _Op.CLEAR_ALL or "LocalCPUBackend" not in cleared or self._cpu is None:
            return
        kept = [(k, int(o.get_size())) for k, o in list(self._cpu.hot_cache.items())]
        if kept:
            self._emit_runs(EventKind.COMMIT, kept, None, tier=Tier.HOST)

    # -- hooks: the storage manager and backends ---------------------------------------------------
    def _batched_get(self, original: Callable[..., Any], keys: Any, *args: Any, **kwargs: Any) -> Any:
        scope = self._scope()
        if scope is None:
            return original(keys, *args, **kwargs)
        location = kwargs.get("location", args[0] if args else None)
        tier = tier_of(str(location)) if location else Tier.HOST
        previous, scope.fetch_tier = scope.fetch_tier, tier
        scope.fetch_t0 = time.perf_counter_ns()
        try:
            objs = original(keys, *args, **kwargs)
        finally:
            scope.fetch_tier = previous
        try:
            disk = self._disk
            for key, obj in zip(keys, objs or (), strict=False):
                if obj is not None:
                    scope.got[key] = (tier, int(obj.get_size()))
                elif tier is Tier.DISK and disk is not None and key not in disk.dict:
                    # the file could not be read and LMCache dropped the key (no `remove` call):
                    # why (corruption), then the copy is gone like any other removal
                    k = block_key(key)
                    self.emitter.emit(self._event(EventKind.INVALIDATE, key, block_key=k, reason=Reason.CORRUPTION))
                    self.emitter.emit(self._event(EventKind.EVICT, key, block_key=k, tier=Tier.DISK,
                                                  reason=Reason.EXPLICIT))
        except Exception:  # noqa: BLE001
            self._failed("batched_get")
        return objs

    # Each change is reported before LMCache makes it visible (and, for a policy eviction, under
    # the lock the backend holds), so an event never trails a lookup that already saw its effect.
    def _cpu_batched_put(self, original: Callable[..., Any], keys: Any, memory_objs: Any, *args: Any,
                         **kwargs: Any) -> Any:
        if self.emitter.enabled and getattr(self._cpu, "use_hot", True):
            try:
                hot = self._cpu.hot_cache
                self._on_cpu_put([(k, int(o.get_size())) for k, o in zip(keys, memory_objs, strict=False)
                                  if k not in hot])
            except Exception:  # noqa: BLE001 - the engine must never see kvtrace fail
                self._failed("batched_submit_put_task")
        self._tl.in_batch = True
        try:
            return original(keys, memory_objs, *args, **kwargs)
        finally:
            self._tl.in_batch = False

    def _cpu_put(self, original: Callable[..., Any], key: Any, memory_obj: Any, *args: Any, **kwargs: Any) -> Any:
        if self.emitter.enabled and not getattr(self._tl, "in_batch", False):
            try:
                if key not in self._cpu.hot_cache:
                    self._on_cpu_put([(key, int(memory_obj.get_size()))])
            except Exception:  # noqa: BLE001
                self._failed("submit_put_task")
        return original(key, memory_obj, *args, **kwargs)

    def _on_cpu_put(self, fresh: list[tuple[Any, int]]) -> None:
        if not fresh:
            return
        scope = self._scope()
        if scope is not None and scope.fetch_tier is not Tier.NONE and scope.fetch_tier is not Tier.HOST:
            # a chunk read from disk (or a remote store) kept in the CPU cache on its way out
            spent = time.perf_counter_ns() - scope.fetch_t0
            self._emit_runs(EventKind.LOAD, fresh, self._where(scope), src_tier=scope.fetch_tier,
                            dst_tier=Tier.HOST, duration_ns=spent)
        else:  # a store's chunks, or a put from elsewhere (a controller move, a peer): published
            self._emit_runs(EventKind.COMMIT, fresh, self._where(scope) if scope is not None else None, tier=Tier.HOST)

    def _disk_write(self, original: Callable[..., Any], key: Any, memory_obj: Any, *args: Any, **kwargs: Any) -> Any:
        """Runs on LMCache's disk worker thread: note when the write began and its size."""
        try:
            self._tl.disk_write = (time.perf_counter_ns(), int(memory_obj.get_size()))
        except Exception:  # noqa: BLE001
            self._failed("async_save_bytes_to_disk")
        try:
            return original(key, memory_obj, *args, **kwargs)
        finally:
            self._tl.disk_write = None

    def _disk_insert(self, original: Callable[..., Any], key: Any, size: Any, *args: Any, **kwargs: Any) -> Any:
        """The write is on disk; LMCache publishes the key next."""
        if self.emitter.enabled:
            try:
                if key not in self._disk.dict:
                    began, nbytes = getattr(self._tl, "disk_write", None) or (0, int(size))
                    # a copy of a chunk the host cache holds (and published); otherwise the disk
                    # write is its only copy: the CPU evicted it meanwhile, or it never went there
                    # (disk-only store location, hot cache off)
                    if self._cpu is not None and key in self._cpu.hot_cache:
                        spent = time.perf_counter_ns() - began if began else 0
                        self._emit_runs(EventKind.OFFLOAD, [(key, nbytes)], None, src_tier=Tier.HOST,
                                        dst_tier=Tier.DISK, duration_ns=spent)
                    else:
                        self._emit_runs(EventKind.COMMIT, [(key, nbytes)], None, tier=Tier.DISK)
            except Exception:  # noqa: BLE001
                self._failed("insert_key")
        return original(key, size, *args, **kwargs)

    def _remover(self, tier: Tier, held: Callable[[], Any]) -> Callable[..., Any]:
        def remove(original: Callable[..., Any], key: Any, *args: Any, **kwargs: Any) -> Any:
            if self.emitter.enabled:
                try:
                    if key in held():
                        force = kwargs.get("force", args[0] if args else True)
                        self._on_remove(tier, key, bool(force))
                except Exception:  # noqa: BLE001
                    self._failed(f"{tier.value} remove")
            return original(key, *args, **kwargs)

        return remove

    def _on_remove(self, tier: Tier, key: Any, force: bool) -> None:
        scope = self._scope()
        if scope is not None and scope.op is _Op.CLEAR_ALL:
            return  # the clear reports itself, once per tier
        if scope is not None and scope.op is _Op.CLEAR_PREFIX and scope.all_locations:
            if key not in scope.removed:  # once per chunk, whichever backend drops it first
                scope.removed.add(key)
                self.emitter.emit(self._event(EventKind.INVALIDATE, key, block_key=block_key(key),
                                              reason=Reason.EXPLICIT, component=ComponentKind.NONE))
            return
        self.emitter.emit(self._event(EventKind.EVICT, key, block_key=block_key(key), tier=tier,
                                      reason=Reason.EXPLICIT if force else Reason.CAPACITY))


def restart_tiers(disk: Any) -> tuple[Tier, ...]:
    """The tiers on which a newly started LMCache engine holds nothing, whatever an earlier one
    under the same name left: its CPU backend's (host) and, `disk` being its local disk backend,
    the disk. That backend writes chunks to files that outlive the process, but keeps their index
    in process memory and never reads back what an earlier process wrote: a new engine finds none
    of them (LMCache 0.5.6: its lookups miss them all). A disk backend that knows chunks when the
    shim attaches has read some back, and its tier is left as it is."""
    index = getattr(disk, "dict", None) if disk is not None else None
    return (Tier.HOST,) if index else (Tier.HOST, Tier.DISK)


def _rid(kwargs: dict) -> str:
    return str(kwargs.get("req_id") or kwargs.get("lookup_id") or "")


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.") if dtype else ""
