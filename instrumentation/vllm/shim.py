"""The vLLM v1 KV-cache manager shim: lookups, adopts, commits, evictions and resets.

It wraps methods of one `KVCacheManager` instance and of its `BlockPool` (never the classes,
so two managers in one process keep their own identity), calls the original first and then
records what happened. Every hook is fenced: an error in kvtrace is counted and logged once,
and the engine goes on as if kvtrace were not there.

Where each fact comes from (vLLM 0.32):
- lookup: `get_computed_blocks(request)`, with the request's block-key chain per group and the
  reconciled hit it returned; emitted before the allocation that follows can change the cache;
- adopt: `record_prefix_cache_stats(request, num_hits)`, which the scheduler calls once when a
  request is admitted, exactly where vLLM counts its own prefix-cache hits;
- commit: `BlockPool.cache_full_blocks`, when full blocks are published in the hash map
  (vLLM publishes blocks when their chunk is scheduled, before the forward pass).

- usage: at a lookup, at most once per `usage_interval_s`, the device pool split into blocks
  held by running requests, evictable cached blocks and free blocks (vLLM's own counts).

Commits and evictions are reported as runs, one event per call and group naming every block
(`block_key` + `more_keys`): per block the shim then only reads a key and appends it.
- evict: `BlockPool.get_new_blocks` (and `evict_blocks`), when reusing a block takes its key
  out of the hash map and no other physical block holds that key (vLLM does not de-duplicate,
  so a key can live in several blocks); Mamba's transient tail checkpoints are not reported;
- invalidate (reset): `reset_prefix_cache()` when it succeeds.

Block keys are the low 64 bits of vLLM's block hash, as vLLM's own KV events carry them, so the
shim and the KV-event bridge name the same blocks with the same keys.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import struct
import sys
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from itertools import compress, filterfalse
from operator import attrgetter, not_
from typing import Any

from msgspec.structs import replace

from kvtrace.instrumentation.api import Emitter, request_key
from kvtrace.instrumentation.attach import attach_events, distribution_version
from kvtrace.instrumentation.hooks import HookSet, patch_class
from kvtrace.instrumentation.identity import Identity
from kvtrace.instrumentation.vllm.recipe import component_of, recipe_from_kv_cache_config
from kvtrace.instrumentation.vllm.weights import adapter_label
from kvtrace.schema.events import PROBE_PREFIX, Event
from kvtrace.schema.kinds import EventKind, Reason, Tier

log = logging.getLogger("kvtrace.vllm")
_U64 = struct.Struct(">Q").unpack_from  # big-endian uint64 at an offset: no slice copied
_HASH_OF = attrgetter("_block_hash")  # a block's hash (None when it has none), read in C by map()
_REF_CNT = attrgetter("ref_cnt")


def _hash_keys(joined: bytes) -> list[int]:
    """The keys of sha256 hashes (32 bytes each) joined: every fourth big-endian uint64, read
    by `array` in C, never a Python step per key."""
    words = array("Q")
    words.frombytes(joined)
    if sys.byteorder == "little":
        words.byteswap()
    keys = words[3::4].tolist()
    return [k or 1 for k in keys] if 0 in keys else keys


@functools.cache
def _group_mask(group: int) -> bytes:
    """A `bytes.translate` table: group's byte -> 1, every other -> 0 (the mask `compress` takes)."""
    return bytes(int(i == group) for i in range(256))


_PAD = b"\0\0\0\0"


def _map_size(pool: Any) -> int:
    """The size of the pool's hash map, or -1 where a change in it cannot be read as one key per
    block: a block's partial-prefix keys (a second kind of key) would blur the count, and
    another vLLM may keep it elsewhere (then the caller reads every block)."""
    try:
        cache = pool.cached_block_hash_to_block._cache  # read anew: a reset replaces the map
        return -1 if getattr(pool, "cached_block_hashes_by_block", None) else len(cache)
    except Exception:  # noqa: BLE001
        return -1


def _pool_key_runs(keys: list[bytes]) -> dict[int, list[int]] | None:
    """Pool keys (a 32-byte sha256 hash and a 4-byte group id each, vLLM's default) as one run
    of keys per group, in order, all in C. Joined with 4 padding bytes each, a key is five
    aligned big-endian words (its key the fourth), so `array` reads them without a format
    string per length (a `struct` format of n keys is compiled anew for every new n, and its
    cache holds 100); each key's group is one byte, split by `compress` on a mask. None for
    other keys (another hash, a group id of 256 or more): the caller reads those one by one.
    A pool's keys all have one length (one hash function per process), so the total length
    tells 36-byte keys apart."""
    n = len(keys)
    joined = _PAD.join(keys) + _PAD
    if len(joined) != 40 * n or not (joined[32::40].count(0) == joined[33::40].count(0)
                                     == joined[34::40].count(0) == n):
        return None
    words = array("Q")
    words.frombytes(joined)
    if sys.byteorder == "little":
        words.byteswap()
    values = words[3::5].tolist()
    if 0 in values:
        values = [k or 1 for k in values]
    low = joined[35::40]
    if low.count(low[0]) == n:
        return {low[0]: values}
    return {g: list(compress(values, low.translate(_group_mask(g)))) for g in sorted(set(low))}


_PROBES = threading.local()  # per-group hits seen during the lookup in progress on this thread
_probes_installed = False


def _install_probe_hooks() -> None:
    """Record each group's own hit as vLLM's coordinator probes it, before it reconciles them.

    The per-type managers' `find_longest_cache_hit` are classmethods shared by every manager,
    so this patches the classes once per process; the record is kept only while a shim's
    lookup is running on this thread, so other callers pay one attribute read.
    """
    global _probes_installed
    if _probes_installed:
        return
    _probes_installed = True
    try:
        from vllm.v1.core import single_type_kv_cache_manager as stm
    except ImportError:
        return
    for cls in vars(stm).values():
        if isinstance(cls, type) and isinstance(vars(cls).get("find_longest_cache_hit"), classmethod):
            patch_class(cls, "find_longest_cache_hit", _probing)


def _probing(original: Any) -> Any:
    """`find_longest_cache_hit` (a classmethod's function), telling `_PROBES` each group's first
    answer."""

    def probe(klass: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(klass, *args, **kwargs)
        hits = getattr(_PROBES, "hits", None)
        if hits is not None:
            groups = kwargs.get("kv_cache_group_ids", args[2] if len(args) > 2 else ())
            for g in groups:
                hits.setdefault(g, int(result[1]))  # the first probe: before reconciliation
        return result

    return probe


def _note_computed(request: Any, *args: Any, **kwargs: Any) -> None:
    request._kvtrace_computed = int(request.num_computed_tokens)


def key_of(block_hash: bytes) -> int:
    """kvtrace block key of a vLLM block hash (bytes): its low 64 bits, never 0."""
    return _U64(block_hash, len(block_hash) - 8)[0] or 1


def key_of_pool_key(key: bytes) -> int:
    """The same for a pool key (hash + 4-byte group id), without splitting it first."""
    return _U64(key, len(key) - 12)[0] or 1


def bytes_per_block(group: Any) -> int:
    """One block of a KV-cache group across all its layers: what a copy of it occupies and what
    moving it costs. vLLM's scheduler flattens a `UniformTypeKVCacheSpecs` group to one
    per-layer spec while a worker keeps the wrapper (whose page already covers every layer);
    the answer is the same either way."""
    spec = group.kv_cache_spec
    layers = 1 if type(spec).__name__ == "UniformTypeKVCacheSpecs" else len(getattr(group, "layer_names", ()) or (1,))
    return int(getattr(spec, "page_size_bytes", 0)) * layers


class CacheManagerShim:
    """Instruments one vLLM `KVCacheManager`; `install()` once, `uninstall()` to restore."""

    def __init__(self, manager: Any, emitter: Emitter, identity: Identity = Identity(),
                 sample_rate: float = 1.0, usage_interval_s: float = 1.0) -> None:
        self.manager = manager
        self.emitter = emitter
        self.identity = identity
        self.sample_rate = sample_rate  # requests whose lookup and adopt are traced; state always is
        self.errors = 0
        self.hooks = HookSet("vLLM", log, self._failed)  # what `install` wraps
        config = manager.kv_cache_config
        self.hash_block_size = int(getattr(manager.block_pool, "hash_block_size", 0) or
                                   config.kv_cache_groups[0].kv_cache_spec.block_size)
        self.groups = [
            (g.kv_cache_spec.block_size, component_of(g.kv_cache_spec), bytes_per_block(g))
            for g in config.kv_cache_groups
        ]
        # Events are copies of one template (msgspec.structs.replace: ~3x cheaper than building
        # an Event, and with tuples in the list fields a copy allocates nothing the garbage
        # collector has to track), so a block costs one small copy and one emit.
        self._base = Event(kind=EventKind.LOOKUP, engine="vllm", instance=identity.instance, model=identity.model,
                           model_revision=identity.model_revision, kv_dtype=identity.kv_dtype,
                           group_block_keys=(), group_hit_tokens=(), reused_tiers=(), reused_tokens=())  # type: ignore[arg-type]
        self._evict_base = [
            replace(self._base, kind=EventKind.EVICT, component=component, group_id=gid, tier=Tier.DEVICE,
                    reason=Reason.CAPACITY)
            for gid, (_, component, _) in enumerate(self.groups)
        ]
        self._same_chain = all(size == self.hash_block_size for size, _, _ in self.groups)
        # Usage samples: at most one per interval, taken at a lookup (0 turns them off). A pool
        # block's bytes are the KV tensors' total over the blocks, whatever groups share them.
        self.usage_interval_ns = int(usage_interval_s * 1e9)
        self._usage_due_ns = 0
        tensors = getattr(config, "kv_cache_tensors", None) or []
        total = sum(int(getattr(t, "size", 0)) for t in tensors)
        self.pool_block_bytes = total // max(int(getattr(config, "num_blocks", 0) or 0), 1) if total else \
            sum(b for _, _, b in self.groups)

    def set_model_revision(self, revision: str) -> None:
        """The weights changed (a reload, an RL step): everything committed or looked up from
        now on carries the new revision, so reuse of blocks computed with the old weights is an
        identity mismatch in the analysis, whether or not the engine resets its cache."""
        self.identity = dataclasses.replace(self.identity, model_revision=revision)
        self._base = replace(self._base, model_revision=revision)
        self._evict_base = [replace(e, model_revision=revision) for e in self._evict_base]

    # -- install -----------------------------------------------------------------------------------
    def install(self) -> CacheManagerShim:
        m, pool = self.manager, self.manager.block_pool
        _install_probe_hooks()
        self._wrap_lookup(m)
        self.hooks.wrap_after(m, "record_prefix_cache_stats", self._after_adopt)
        self.hooks.wrap_after(m, "reset_prefix_cache", self._after_reset)
        self._wrap_cache_full_blocks(pool)
        self._wrap_evict(pool)
        self._attached()
        return self

    def _attached(self) -> None:
        """The engine, its recipe and its empty memory, once (see `kvtrace.instrumentation.attach`)."""
        try:
            if not self.emitter.enabled:
                return
            recipe = recipe_from_kv_cache_config(self.manager.kv_cache_config)
            events = attach_events(self._base, recipe, engine_version=distribution_version("vllm"),
                                   max_model_len=int(getattr(self.manager, "max_model_len", 0) or 0),
                                   block_size=self.hash_block_size)
            for event in events:
                self.emitter.emit(event)
        except Exception:  # noqa: BLE001 - the engine must never see kvtrace fail
            self._failed("attach")

    def uninstall(self) -> None:
        self.hooks.restore()

    def watch_preemptions(self, scheduler: Any) -> None:
        """Keep on each request what it had computed when the scheduler preempts it (vLLM sets it
        to 0 there): its re-admission's lookup says so, and what it then computes again is that
        less what it reuses on resume."""
        self.hooks.wrap_before(scheduler, "_preempt_request", _note_computed)

    def _wrap_lookup(self, manager: Any) -> None:
        original = getattr(manager, "get_computed_blocks", None)
        if original is None:
            log.warning("kvtrace: vLLM's KVCacheManager has no get_computed_blocks; lookups are off")
            return

        def get_computed_blocks(request: Any, *args: Any, **kwargs: Any) -> Any:
            _PROBES.hits = hits = {}
            try:
                result = original(request, *args, **kwargs)
            finally:
                _PROBES.hits = None
            try:
                self._after_lookup(result, request, hits)
            except Exception:  # noqa: BLE001
                self._failed("get_computed_blocks")
            return result

        self.hooks.replace(manager, "get_computed_blocks", get_computed_blocks)

    def _sampled(self, request: Any) -> bool:
        # A canary's re-runs are always traced: their verdicts are what the canary's probes judge.
        rid = request.request_id
        return (self.sample_rate >= 1.0 or str(rid).startswith(PROBE_PREFIX)
                or self.emitter.sampled(request_key(rid), self.sample_rate))

    def _failed(self, hook: str) -> None:
        self.errors += 1
        if self.errors == 1:
            log.exception("kvtrace: the %s hook failed; counting further failures silently", hook)

    # -- events ------------------------------------------------------------------------------------
    def _event(self, kind: EventKind, request: Any = None) -> Event:
        if request is None:
            return replace(self._base, kind=kind)
        lora = getattr(request, "lora_request", None)
        return replace(self._base, kind=kind, adapter=adapter_label(lora) if lora is not None else "",
                       tenant=getattr(request, "cache_salt", None) or self.identity.default_tenant,
                       request_id=str(request.request_id))

    def _request_keys(self, request: Any) -> list[int]:
        """Keys of the request's hash chain, computed once per block and kept on the request
        (its chain only grows), so lookups and commits share the work."""
        keys: list[int] | None = getattr(request, "_kvtrace_keys", None)
        hashes = request.block_hashes
        if keys is None:
            keys = request._kvtrace_keys = []
        if len(keys) < len(hashes):
            new = hashes[len(keys):]
            joined = b"".join(new)
            if len(joined) == 32 * len(new):  # sha256 hashes, vLLM's default
                keys.extend(_hash_keys(joined))
            else:
                keys.extend(_U64(h, len(h) - 8)[0] or 1 for h in new)
        return keys

    def chains(self, request: Any) -> list[list[int]]:
        """The request's block keys per group, from vLLM's own hash chain."""
        keys = self._request_keys(request)
        if self._same_chain:
            return [keys[:]] * len(self.groups)  # one list, shared: the groups hash the same blocks
        out = []
        for block_size, _, _ in self.groups:
            k = max(block_size // self.hash_block_size, 1)
            out.append(keys[k - 1 :: k] if k > 1 else keys[:])
        return out

    def _after_lookup(self, result: Any, request: Any, hits: dict[int, int]) -> None:
        if not self._sampled(request):
            return
        _, hit, _ = result
        event = self._event(EventKind.LOOKUP, request)
        event.prompt_tokens = int(request.num_tokens)
        event.group_block_keys = self.chains(request)
        event.group_hit_tokens = tuple(hits.get(g, 0) for g in range(len(self.groups)))  # type: ignore[assignment]
        event.reported_hit_tokens = int(hit)
        # A re-admission after a preemption looks up again (its prompt now with its outputs);
        # vLLM keeps those out of its prefix-cache counters (PrefixCacheStats.preempted_*).
        event.preemptions = preemptions = int(getattr(request, "num_preemptions", 0) or 0)
        if preemptions:
            event.computed_before_preemption = int(getattr(request, "_kvtrace_computed", 0))
        self.emitter.emit(event)
        if self.usage_interval_ns:
            self.sample_usage()

    def sample_usage(self, force: bool = False) -> None:
        """Emit the device pool's split (held by running requests, evictable cached blocks,
        free) when the interval has passed. Counting cached blocks walks the pool: O(blocks),
        once per interval."""
        now = time.monotonic_ns()
        if not force and now < self._usage_due_ns:
            return
        self._usage_due_ns = now + self.usage_interval_ns
        pool = self.manager.block_pool
        blocks = pool.blocks
        free = int(pool.get_num_free_blocks())
        # Evictable: free (no reference) and hashed; counted in C (the null block is never hashed).
        evictable = sum(compress(map(not_, map(_REF_CNT, blocks)), map(_HASH_OF, blocks)))
        usable = int(pool.num_gpu_blocks) - 1  # the null block is never handed out
        size = self.pool_block_bytes
        self.emitter.emit(replace(self._base, kind=EventKind.USAGE, tier=Tier.DEVICE,
                                  locked_bytes=max(usable - free, 0) * size, evictable_bytes=evictable * size,
                                  free_bytes=max(free - evictable, 0) * size))

    def _after_adopt(self, result: Any, request: Any, num_hits: int, *args: Any, **kwargs: Any) -> None:
        if not self._sampled(request):
            return
        # The connector shim leaves (tokens, tier) on the request when it admits a load; without
        # it, vLLM's own count (if this version keeps one) from an unknown tier.
        external, tier = getattr(request, "_kvtrace_external", None) or (
            int(getattr(request, "num_external_computed_tokens", 0) or 0), Tier.REMOTE)
        event = self._event(EventKind.ADOPT, request)
        tiers, tokens = [], []
        if num_hits:
            tiers.append(Tier.DEVICE)
            tokens.append(int(num_hits))
        if external:
            tiers.append(tier)
            tokens.append(external)
        event.reused_tiers, event.reused_tokens = tuple(tiers), tuple(tokens)  # type: ignore[assignment]
        event.recomputed_tokens = max(int(request.num_tokens) - int(num_hits) - external, 0)
        self.emitter.emit(event)

    def _after_reset(self, result: Any, *args: Any, **kwargs: Any) -> None:
        if result:  # vLLM's reset clears the device prefix cache; a connector's tier keeps its copies
            self.emitter.emit(replace(self._event(EventKind.INVALIDATE), reason=Reason.RESET, tier=Tier.DEVICE))

    def _wrap_cache_full_blocks(self, pool: Any) -> None:
        original = getattr(pool, "cache_full_blocks", None)
        if original is None:
            log.warning("kvtrace: vLLM's BlockPool has no cache_full_blocks; commits are off")
            return
        shim = self

        def cache_full_blocks(request: Any, blocks: Sequence[Any], num_cached_blocks: int, num_full_blocks: int,
                              block_size: int, kv_cache_group_id: int, *args: Any, **kwargs: Any) -> Any:
            size = _map_size(pool)
            result = original(request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id,
                              *args, **kwargs)
            try:  # blocks in [num_cached, num_full) are fresh: the ones that got a key now were published
                # `block_mask` (vLLM 0.32+): the window's blocks no lookup can reach are left out.
                mask = kwargs.get("block_mask", args[0] if args else None)
                grown = _map_size(pool) - size if size >= 0 else -1
                if grown >= 0 and (mask is None or type(mask) is list) and grown == (
                        num_full_blocks - num_cached_blocks if mask is None else mask.count(True)):
                    shim._committed_all(request, blocks, num_cached_blocks, num_full_blocks, block_size,
                                        kv_cache_group_id, mask)
                else:
                    shim._committed(request, blocks, num_cached_blocks, num_full_blocks, block_size,
                                    kv_cache_group_id)
            except Exception:  # noqa: BLE001
                shim._failed("cache_full_blocks")
            return result

        self.hooks.replace(pool, "cache_full_blocks", cache_full_blocks)

    def _committed_all(self, request: Any, blocks: Sequence[Any], start: int, stop: int, block_size: int,
                       group: int, mask: list[bool] | None) -> None:
        """`_committed` when the hash map grew by one key per block the call was to publish
        (all of [start, stop), or those its mask keeps): each got a key of its own (none was
        null, a duplicate's or a promoted partial one), so their keys are the request chain's,
        and no block needs reading."""
        if start >= stop:
            return
        chain = self._request_keys(request) if self._same_chain else None
        if chain is None or stop > len(chain) or (mask is not None and len(mask) != stop - start):
            self._committed(request, blocks, start, stop, block_size, group)
            return
        if mask is None:
            self._emit_commit(request, group, block_size, chain[start:stop], start, stop - 1)
        else:
            self._emit_flagged(request, group, block_size, chain, start, mask)

    def _committed(self, request: Any, blocks: Sequence[Any], start: int, stop: int, block_size: int,
                   group: int) -> None:
        """One event for the run of blocks this call published (block_key + more_keys)."""
        if start >= stop:
            return
        hashes = list(map(_HASH_OF, blocks[start:stop]))  # None: not published (a null block behind a window)
        chain = self._request_keys(request) if self._same_chain else None
        if chain is not None and stop <= len(chain):
            # The keys are a slice of the request's chain: every block published (a full-attention
            # group always), or those after a window's null blocks.
            if None not in hashes:
                self._emit_commit(request, group, block_size, chain[start:stop], start, stop - 1)
                return
            self._emit_flagged(request, group, block_size, chain, start, hashes)
            return
        keys = []
        first = last = -1
        for i, key in enumerate(hashes, start):
            if key is None or blocks[i].is_null:
                continue
            keys.append(chain[i] if chain is not None and i < len(chain) else key_of_pool_key(key))
            if first < 0:
                first = i
            last = i
        if keys:
            self._emit_commit(request, group, block_size, keys, first, last)

    def _emit_flagged(self, request: Any, group: int, block_size: int, chain: list[int], start: int,
                      flags: Sequence[Any]) -> None:
        """One commit of the chain's keys from `start` whose flag is set (a block's hash, or
        its `block_mask` entry): those published, after a window's null or masked blocks."""
        keys = list(compress(chain[start : start + len(flags)], flags))
        if keys:
            first = flags.index(next(filter(None, flags)))
            last = len(flags) - 1 - flags[::-1].index(next(filter(None, reversed(flags))))
            self._emit_commit(request, group, block_size, keys, start + first, start + last)

    def _emit_commit(self, request: Any, group: int, block_size: int, keys: list[int], first: int, last: int) -> None:
        _, component, page = self.groups[group]
        lora = getattr(request, "lora_request", None)
        self.emitter.emit(replace(  # one copy of the template (a commit names no request)
            self._base, kind=EventKind.COMMIT, adapter=adapter_label(lora) if lora is not None else "",
            tenant=getattr(request, "cache_salt", None) or self.identity.default_tenant,
            component=component, group_id=group, block_size=block_size, tier=Tier.DEVICE, nbytes=page,
            block_key=keys[0], more_keys=keys[1:], token_start=first * block_size, token_end=(last + 1) * block_size,
        ))

    def _wrap_evict(self, pool: Any) -> None:
        """Evictions happen block by block inside `get_new_blocks` (and `evict_blocks`, for
        connectors). Wrapping the per-block method would cost a call per allocated block, so the
        shim takes the keys of the blocks `get_new_blocks` pops off vLLM's free queue (its
        `popleft_n`, which hands them over as a list) or of the ids a connector names, before
        vLLM drops them, and reports those that lost their key, as one run per group."""
        allocate = getattr(pool, "get_new_blocks", None)
        queue = getattr(pool, "free_block_queue", None)
        popleft_n = getattr(queue, "popleft_n", None)
        if allocate is None or popleft_n is None:
            log.warning("kvtrace: vLLM's BlockPool has no get_new_blocks / free queue popleft_n; evictions are off")
            return
        shim = self
        popped: list[bytes] = []  # the keys of the blocks popleft_n handed get_new_blocks
        watching: list[bool] = []  # non-empty while get_new_blocks runs on this pool

        def take(n: int, *args: Any, **kwargs: Any) -> Any:
            blocks = popleft_n(n, *args, **kwargs)
            if watching:
                try:
                    popped.extend(filter(None, map(_HASH_OF, blocks)))  # the hashed ones
                except Exception:  # noqa: BLE001
                    shim._failed("get_new_blocks")
            return blocks

        def get_new_blocks(*args: Any, **kwargs: Any) -> Any:
            watching.append(True)
            # The hash map's size before and after tells whether every popped key left it: then
            # none needs looking up.
            size = _map_size(pool)
            try:
                result = allocate(*args, **kwargs)
            finally:
                watching.pop()
            if popped:
                keys = popped[:]
                popped.clear()
                after = _map_size(pool) if size >= 0 else -1
                shim._report_evictions(pool, keys, all_gone=after >= 0 and size - after == len(keys))
            return result

        self.hooks.replace(queue, "popleft_n", take)
        self.hooks.replace(pool, "get_new_blocks", get_new_blocks)

        def named_keys(block_ids: Any, *args: Any, **kwargs: Any) -> list[bytes]:
            return [k for i in block_ids if (k := pool.blocks[i]._block_hash) is not None]

        if getattr(pool, "evict_blocks", None) is not None:
            self._wrap_reuse(pool, "evict_blocks", named_keys)

    def _wrap_reuse(self, pool: Any, name: str, keys_before: Callable[..., list[bytes]]) -> None:
        """Wrap a pool method that takes keys out of the hash map: read the keys it is about to
        drop before the call, report those gone after it."""
        original = getattr(pool, name)
        shim = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            keys: list[bytes] = []
            try:
                keys = keys_before(*args, **kwargs)
            except Exception:  # noqa: BLE001
                shim._failed(name)
            result = original(*args, **kwargs)
            if keys:
                shim._report_evictions(pool, keys)
            return result

        self.hooks.replace(pool, name, wrapper)

    def _report_evictions(self, pool: Any, keys: list[bytes], all_gone: bool = False) -> None:
        try:
            index = pool.cached_block_hash_to_block
            cache = getattr(index, "_cache", None)  # vLLM's dict behind the map: a plain `in` is cheapest
            if all_gone:
                gone = keys
            elif cache is not None:  # another physical block may still hold a key
                gone = list(filterfalse(cache.__contains__, keys))
            else:
                gone = [k for k in keys if index.get_one_block(k) is None]
            if not gone:
                return
            by_group = _pool_key_runs(gone)
            if by_group is None:
                by_group = {}
                for k in gone:
                    by_group.setdefault(int.from_bytes(k[-4:], "big"), []).append(_U64(k, len(k) - 12)[0] or 1)
            for group, run in by_group.items():
                self.emitter.emit(replace(self._evict_base[group], block_key=run[0], more_keys=run[1:]))
        except Exception:  # noqa: BLE001
            self._failed("evictions")
