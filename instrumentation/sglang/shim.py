"""The SGLang radix-cache shim: lookups, adopts, commits, evictions, tier moves and resets.

It wraps methods of one `UnifiedRadixCache` instance (never the class: the scheduler's
simulated waiting-queue tree must stay untouched), calls the original first and then records
what happened. Every hook is fenced: an error in kvtrace is counted and logged once, and the
cache goes on as if kvtrace were not there.

Which tree core runs (SGLang's Rust core by default, or the Python one) does not matter: the
shim never reads tree nodes. It keeps a ledger per component and tier, pool slot -> page key,
filled from the values the cache hands around and emptied by the frees it performs:
- commit: `insert` (the scheduler's `checkpoint` ends there): pages [prefix_len, len) take the
  slots of `params.value`; a sliding-window rebuild (`SWARebuild`) names the slots whose window
  state was (re)written; a Mamba state `params.mamba_value` is committed at the key's end when
  the tree kept it (`not result.mamba_exist`);
- evict: every slot the cache frees goes through `_apply_cache_action` (`FreeDeviceKV`,
  `FreeDeviceKVFullOnly`, `FreeComponentDeviceSlot`) or a component's `free_host_values`; the
  ledger names the page that slot held. Frees and re-installs inside one call are netted, so a
  rebuild that moves a page to new slots is not reported as an eviction;
- lookup: `match_prefix`, once per request (repeats with the same result are dropped), with
  the request's key chain and SGLang's hits: full-attention KV on device or host, and the
  boundary every component agrees on;
- adopt: `record_admission`, called where the engine settles what it reused per tier;
- invalidate: `reset`;
- attach: once, when installed (`emit_attach`): the engine's release, its recipe (the cache's
  components, `recipe.recipe_from_cache`), its context length where the plugin knows it, and
  the tiers in the process's memory invalidated: device, and HiCache's host tier (a new process
  holds nothing there; the storage tier outlives it);
- streaming sessions: a session keeps a finished turn's KV row outside the tree for its next
  turn (`claim_kv_row` returns True), so its full pages are committed where it keeps them,
  and the frees of a session's row (`free_kv_row`: a rewound tail, `release_session`) evict
  them. A session's window and Mamba state are not followed.

Keys are kvtrace's prefix-chained page keys (see `keys`), made once per request from its
tokens and namespace; HiCache's storage names are translated to them.
"""

from __future__ import annotations

import logging
import sys
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from msgspec.structs import replace

from kvtrace.instrumentation.api import Emitter, request_key
from kvtrace.instrumentation.attach import attach_events, distribution_version
from kvtrace.instrumentation.hooks import HookSet, patch_class
from kvtrace.instrumentation.identity import Identity
from kvtrace.instrumentation.sglang.hicache import HiCacheHooks
from kvtrace.instrumentation.sglang.keys import Chain, new_chain
from kvtrace.instrumentation.sglang.ledger import SlotBook, as_slots, gather, slot_step, unique
from kvtrace.instrumentation.sglang.recipe import component_name, component_of, component_types, recipe_from_cache
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import EventKind, Reason, Tier
from kvtrace.schema.recipes import Recipe

log = logging.getLogger("kvtrace.sglang")
_retractions_watched = False


def watch_retractions() -> None:
    """Note on each SGLang request what it had computed when it is retracted (SGLang's
    `reset_for_retract` sets that to 0): its re-admission's lookup carries it. Once per process,
    and only where SGLang's scheduler module is loaded already: never in the resolver process,
    which imports nothing of the engine's."""
    global _retractions_watched
    module = sys.modules.get("sglang.srt.managers.schedule_batch")
    if _retractions_watched or module is None or not hasattr(module, "Req"):
        return
    _retractions_watched = patch_class(module.Req, "reset_for_retract", _noting_committed)


def _noting_committed(original: Callable[..., Any]) -> Callable[..., Any]:
    def reset_for_retract(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            self._kvtrace_computed = int(self.kv.kv_committed_len)
        except Exception:  # noqa: BLE001 - another SGLang release: the retraction is the engine's business
            pass
        return original(self, *args, **kwargs)

    return reset_for_retract

@dataclass(slots=True)
class _Scope:
    """What one top-level cache call did to the ledgers, reported when it returns."""

    freed: dict[tuple[int, Tier], list[np.ndarray]] = field(default_factory=dict)  # (group, tier) -> keys
    installed: dict[tuple[int, Tier], list[np.ndarray]] = field(default_factory=dict)
    # a lone install's keys as ints
    installed_ints: dict[tuple[int, Tier], tuple[int, ...]] = field(default_factory=dict)
    reason: Reason = Reason.CAPACITY
    insert_slots: np.ndarray | None = None  # ledger slots of the insert in progress, by page
    insert_pos: np.ndarray | None = None  # ledger slot -> page position, built when a rebuild needs it
    insert_keys: np.ndarray | None = None
    tenant: str = ""  # namespace and adapter of the insert in progress: what its commits carry
    adapter: str = ""


class RadixCacheShim:
    """Instruments one SGLang `UnifiedRadixCache`; `install()` once, `uninstall()` to restore.

    Besides installing itself, it offers what the modules built on it use (none of them reaches
    into its private members):
    - extending it (`hicache.HiCacheHooks`, which follows HiCache's tiers): `hooks` (the methods
      wrapped, to wrap more), `wrap_scoped`, the ledgers (`ledger`, `install_slots`,
      `page_slots`, `full`, `group_of`, `group_named`) and the events that are not a ledger's
      (`emit_transfer`, `emit_invalidate`, `emit_attach`);
    - replaying calls recorded elsewhere (the out-of-process mode's `resolver`): each wrapped
      call in steps (`begin_call`, `end_call`, `abort_call`), the hooks the wrapped calls run
      (`after_lookup`, `before_checkpoint`, `after_checkpoint`, `before_insert`, `after_insert`,
      `after_reset`, `before_release_session`, `before_action`, `after_action`, `session_kept`),
      the lookups it has reported (`reported_lookup`), when usage is sampled next
      (`usage_due_ns`), and a fresh start after lost records (`start_afresh`, `drop_ledger`).

    `engine_version` defaults to the installed sglang distribution's; `max_model_len` is the
    longest request the engine serves (SGLang's context length), 0 where the caller cannot tell.
    """

    def __init__(self, cache: Any, emitter: Emitter, identity: Identity = Identity(), sample_rate: float = 1.0,
                 usage_interval_s: float = 1.0, engine_version: str | None = None, max_model_len: int = 0) -> None:
        self.cache = cache
        self.emitter = emitter
        self.identity = identity
        self.sample_rate = sample_rate
        self.errors = 0
        self.engine_version = distribution_version("sglang") if engine_version is None else engine_version
        self.max_model_len = int(max_model_len)
        self.page = int(cache.page_size)
        self.component_types = component_types(cache)
        self.group_of = {ct: g for g, ct in enumerate(self.component_types)}
        self.components = [component_of(ct) for ct in self.component_types]
        self.full = self.group_named("FULL", 0)  # the group whose slots name KV pages
        self._swa = self.group_named("SWA") if len(self.component_types) > 1 else None
        self._mamba = self.group_named("MAMBA")
        # page keys by slot, per (group, tier): one entry per page of a token pool, per state of Mamba's
        self.ledger: dict[tuple[int, Tier], SlotBook] = {}
        self.hooks = HookSet("SGLang", log, self._failed)  # what `install` (and HiCache's hooks) wrap
        self._depth = 0
        self._scope: _Scope | None = None
        self._current_req: Any = None
        self.hicache: HiCacheHooks | None = None  # HiCache's tiers, once the cache has them
        self._recent: OrderedDict[int, tuple[Any, Chain]] = OrderedDict()  # chains of recent lookups
        self._looked_up: OrderedDict[str, tuple[int, int]] = OrderedDict()  # rid -> (device, host) reported
        self._session_rows = False  # whether frees of streaming sessions' rows are followed
        self._session_keys: set[int] = set()  # pages a session committed: they may be held twice
        self._session_sorted = np.zeros(0, dtype=np.uint64)  # the same, sorted, for vectorized checks
        self._session_row_ids: set[int] = set()  # request-pool rows a session kept
        self.page_bytes = self._page_bytes()
        self.usage_interval_ns = int(usage_interval_s * 1e9)
        self.usage_due_ns = 0  # when the next usage sample is taken (monotonic ns), at a lookup reported
        self._base = Event(kind=EventKind.LOOKUP, engine="sglang", engine_version=self.engine_version,
                           instance=identity.instance, model=identity.model, model_revision=identity.model_revision,
                           kv_dtype=identity.kv_dtype, tenant=identity.default_tenant, block_size=self.page,
                           group_block_keys=(), group_hit_tokens=(), reused_tiers=(), reused_tokens=(),  # type: ignore[arg-type]
                           more_keys=())  # type: ignore[arg-type]

    def group_named(self, name: str, default: int | None = None) -> int | None:
        """The group of the component SGLang calls `name` (its ComponentType's name)."""
        for group, ct in enumerate(self.component_types):
            if component_name(ct) == name:
                return group
        return default

    def _page_bytes(self) -> list[int]:
        """Bytes of one page of each group's state on device: the KV pool's for the group whose
        slots name KV pages (0 for the others, where SGLang gives no per-page size)."""
        out = [0] * len(self.component_types)
        try:
            allocator = getattr(self.cache, "token_to_kv_pool_allocator", None)
            pool = allocator.get_kvcache() if allocator is not None else None
            if pool is not None and out:
                sizes = pool.get_kv_size_bytes()
                total = sum(sizes) if isinstance(sizes, tuple) else int(sizes)
                out[self.full] = int(total // max(int(getattr(pool, "size", 0)) + self.page, 1) * self.page)
        except Exception:  # noqa: BLE001 - a size is a nicety, never a reason to fail
            pass
        return out

    # -- install -----------------------------------------------------------------------------------
    def install(self) -> RadixCacheShim:
        c = self.cache
        watch_retractions()
        self.wrap_scoped(c, "match_prefix", self.after_lookup)
        self.wrap_scoped(c, "checkpoint", self.after_checkpoint, before=self.before_checkpoint, optional=True)
        self.wrap_scoped(c, "insert", self.after_insert, before=self.before_insert)
        self.wrap_scoped(c, "evict", None)
        self.wrap_scoped(c, "evict_for_alloc", None, optional=True)
        self.wrap_scoped(c, "evict_host", None, optional=True)
        self.wrap_scoped(c, "reset", self.after_reset)
        self._wrap_action(c)
        if getattr(c, "session", None) is not None:  # the unified tree's streaming sessions
            self.hooks.wrap_after(c, "claim_kv_row", self._after_claim)
            self.wrap_scoped(c, "release_session", self._after_release_session, before=self.before_release_session,
                             optional=True)
        for ct, comp in (getattr(c, "components", None) or {}).items():
            self._wrap_host_free(comp, ct)
        if getattr(c, "cache_controller", None) is not None:
            self._install_hicache()
        elif hasattr(c, "init_hicache"):  # tiers added later: follow them once they exist
            self.hooks.wrap_after(c, "init_hicache", lambda *a, **k: self._install_hicache())
        self.emit_attach()
        return self

    def _install_hicache(self) -> None:
        self.hicache = HiCacheHooks(self).install()

    def uninstall(self) -> None:
        self.hooks.restore()

    def _failed(self, hook: str) -> None:
        self.errors += 1
        if self.errors == 1:
            log.exception("kvtrace: the SGLang %s hook failed; counting further failures silently", hook)

    def wrap_scoped(self, obj: Any, name: str, after: Callable[..., None] | None,
                    before: Callable[..., Any] | None = None, optional: bool = False) -> None:
        """Wrap a cache entry point: frees it performs are collected and reported (netted) when
        the outermost wrapped call returns. `optional`: a tree without it is fine (the older
        trees have no host tier and no separate checkpoint step)."""
        original = getattr(obj, name, None)
        if original is None:
            if optional:
                return
            log.warning("kvtrace: SGLang's %s has no %s; that hook is off", type(obj).__name__, name)
            return
        shim = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            top, token = shim.begin_call(name, before, args, kwargs)
            try:
                result = original(*args, **kwargs)
            except BaseException:
                shim.abort_call(top)
                raise
            shim.end_call(name, top, after, result, token, args, kwargs)
            return result

        self.hooks.replace(obj, name, wrapper)

    # A wrapped call in three steps, so that a call recorded elsewhere (see `capture`) replays
    # through the same code as one wrapped here.
    def begin_call(self, name: str, before: Callable[..., Any] | None, args: Any, kwargs: Any) -> tuple[bool, Any]:
        top = self._depth == 0
        if top:
            self._scope = _Scope()
        self._depth += 1
        token = None
        if before is not None:
            try:
                token = before(*args, **kwargs)
            except Exception:  # noqa: BLE001 - the engine must never see kvtrace fail
                self._failed(name)
        return top, token

    def abort_call(self, top: bool) -> None:
        """The engine's call failed: what it half did is not reported, nothing lingers."""
        self._depth -= 1
        if top:
            self._scope = None
            self._current_req = None

    def end_call(self, name: str, top: bool, after: Callable[..., None] | None, result: Any, token: Any,
                 args: Any, kwargs: Any) -> None:
        self._depth -= 1
        try:
            if after is not None:
                after(result, token, *args, **kwargs)
            if top:
                self._flush()
        except Exception:  # noqa: BLE001
            self._failed(name)
        finally:
            if top:
                self._scope = None

    def _wrap_action(self, cache: Any) -> None:
        original = getattr(cache, "_apply_cache_action", None)
        if original is None:
            self._wrap_node_removals(cache)
            return
        shim = self

        def _apply_cache_action(action: Any) -> Any:
            name = type(action).__name__
            shim.before_action(name, action)
            result = original(action)
            shim.after_action(name, action)
            return result

        self.hooks.replace(cache, "_apply_cache_action", _apply_cache_action)

    def before_action(self, name: str, action: Any) -> None:
        """A cache action about to run (by its class name): frees name the pages they drop."""
        try:
            if name in ("FreeDeviceKV", "FreeDeviceKVFullOnly", "FreeComponentDeviceSlot"):
                self._on_device_free(name, action)
            elif name == "FreeComponentHostSlot":
                group = self.group_of.get(action.component_type)
                if group is not None:
                    self._free(group, Tier.HOST, self.page_slots(group, action.host_indices))
        except Exception:  # noqa: BLE001
            self._failed(name)

    def after_action(self, name: str, action: Any) -> None:
        """A cache action that ran: window state rebuilt or recovered."""
        try:
            if name == "SWARebuild":
                self._on_swa_rebuild(action)
            elif name in ("RecoverSWAWithLockedFull", "RecoverEvictedSWA"):
                self._on_swa_recovered(action)
        except Exception:  # noqa: BLE001
            self._failed(name)

    def _wrap_node_removals(self, cache: Any) -> None:
        """The older trees free a node's slots in `evict` and tell their event recorder (called
        whether or not events are on): the removed node's value names the freed slots."""
        recorder = getattr(cache, "kv_events", None)
        if getattr(recorder, "record_remove", None) is None:
            log.warning("kvtrace: SGLang's cache has no _apply_cache_action nor an event recorder; evictions are off")
            return

        def removed(result: Any, node: Any, *args: Any, **kwargs: Any) -> None:
            self._free(self.full, Tier.DEVICE, self.page_slots(self.full, getattr(node, "value", None)))

        self.hooks.wrap_after(recorder, "record_remove", removed)

    def _wrap_host_free(self, component: Any, component_type: Any) -> None:
        original = getattr(component, "free_host_values", None)
        group = self.group_of.get(component_type)
        if original is None or group is None:
            return
        shim = self

        def free_host_values(*args: Any, **kwargs: Any) -> Any:  # the values however they are passed
            try:
                shim._free(group, Tier.HOST, shim.page_slots(group, host_values(args, kwargs)))
            except Exception:  # noqa: BLE001
                shim._failed("free_host_values")
            return original(*args, **kwargs)

        self.hooks.replace(component, "free_host_values", free_host_values)

    # -- ledger ------------------------------------------------------------------------------------
    def page_slots(self, group: int, values: Any) -> np.ndarray:
        """Ledger slots of slot indices SGLang hands over (see `ledger.as_slots`)."""
        return as_slots(values, slot_step(self.page, group == self._mamba))

    def _free(self, group: int, tier: Tier, slots: np.ndarray) -> None:
        book = self.ledger.get((group, tier))
        if book is None:
            return
        keys = book.take(slots)
        if not len(keys):
            return
        if self._session_keys and group == self.full and tier is Tier.DEVICE:
            keys = self._gone_everywhere(book, keys)
            if not len(keys):
                return
        if self._scope is None:  # a free outside every wrapped call: reported at once
            self._emit_run(EventKind.EVICT, group, tier, keys, reason=Reason.CAPACITY)
        else:
            self._record(self._scope.freed, (group, tier), keys)

    def install_slots(self, group: int, tier: Tier, slots: np.ndarray, keys: np.ndarray,
                      report: bool = True, ints: tuple[int, ...] | None = None) -> None:
        """Record that `slots` of a group's pool on a tier now hold the pages `keys`; reported
        as commits unless a transfer reports them (`report=False`). `ints`: the same keys as
        Python ints where the caller has them already (a request's chain)."""
        book = self.ledger.get((group, tier))
        if book is None:
            book = self.ledger[(group, tier)] = SlotBook()
        book.put(slots, keys)
        if not report or not len(keys):
            return
        if self._scope is None:
            self._emit_run(EventKind.COMMIT, group, tier, keys if ints is None else ints)
        else:
            self._record(self._scope.installed, (group, tier), keys)
            if ints is not None:
                self._scope.installed_ints[(group, tier)] = ints

    @staticmethod
    def _record(into: dict[tuple[int, Tier], list[np.ndarray]], where: tuple[int, Tier], keys: np.ndarray) -> None:
        got = into.get(where)
        if got is None:
            into[where] = [keys]
        else:
            got.append(keys)

    def _on_device_free(self, name: str, action: Any) -> None:
        if name == "FreeComponentDeviceSlot":
            group = self.group_of.get(action.component_type)
            if group is not None:
                slots = self.page_slots(group, action.indices)
                self._free(group, Tier.DEVICE, self._swa_slots(slots) if group == self._swa else slots)
        else:  # a KV segment: full attention, and the window's copy unless FullOnly
            self._free(self.full, Tier.DEVICE, self.page_slots(self.full, action.indices))
            if name == "FreeDeviceKV" and self._swa is not None:
                self._free(self._swa, Tier.DEVICE, self._swa_slots(self.page_slots(self.full, action.indices)))

    def _swa_slots(self, full_slots: np.ndarray) -> np.ndarray:
        """Window-pool ledger slots of full-attention ledger slots. A window's state lives in its
        own pool; the tree names it by the full-attention slot and the allocator translates, so
        the window ledger is kept in the window pool's numbering, the one HiCache copies use."""
        mapping = getattr(getattr(self.cache, "token_to_kv_pool_allocator", None), "full_to_swa_index_mapping", None)
        if mapping is None or not len(full_slots):
            return full_slots
        out = gather(mapping, full_slots * self.page)
        return out // self.page if self.page > 1 else out

    def _on_swa_recovered(self, action: Any) -> None:
        """A window dropped from a node whose full-attention KV stayed (locked, or kept) gets its
        state back at those full-attention slots: the same pages, named by the full ledger."""
        if self._swa is None:
            return
        full = self.ledger.get((self.full, Tier.DEVICE))
        if full is None:
            return
        slots = self.page_slots(self.full, action.kept_full)
        keys = full.peek(slots)
        held = keys != 0
        if held.any():
            self.install_slots(self._swa, Tier.DEVICE, self._swa_slots(slots[held]), keys[held])

    def _on_swa_rebuild(self, action: Any) -> None:
        """A rebuild writes window state for a node's pages (and gives its full-attention KV
        those slots): names come from the insert in progress."""
        scope = self._scope
        if scope is None or scope.insert_slots is None or scope.insert_keys is None or not len(scope.insert_slots):
            return
        slots = self.page_slots(-1, action.source_value)
        if scope.insert_pos is None:  # built on the first rebuild of this insert only
            ins = scope.insert_slots
            scope.insert_pos = np.full(int(ins.max()) + 1, -1, dtype=np.int64)
            scope.insert_pos[ins] = np.arange(len(ins))
        pos = scope.insert_pos
        slots = slots[slots < len(pos)]
        at = pos[slots]
        ok = (at >= 0) & (at < len(scope.insert_keys))
        where, keys = slots[ok], scope.insert_keys[at[ok]]
        if not len(keys):
            return
        if self._swa is not None:
            self.install_slots(self._swa, Tier.DEVICE, self._swa_slots(where), keys)
        # A rebuild over a node whose full-attention slots were just freed moves that KV to the
        # rebuilt slots: the page stays resident under new slots.
        moved = scope.freed.get((self.full, Tier.DEVICE))
        if moved:
            back = np.isin(keys, np.concatenate(moved))
            if back.any():
                self.install_slots(self.full, Tier.DEVICE, where[back], keys[back])

    def _flush(self) -> None:
        """Report one call's net effect: keys freed and not re-installed are evicted, keys
        installed that were not resident before are committed (or loaded, see hicache)."""
        scope = self._scope
        self._scope = None
        if scope is None:
            return
        installed, freed = scope.installed, scope.freed
        for where, parts in freed.items():
            gone = parts[0] if len(parts) == 1 else unique(np.concatenate(parts))
            back = installed.get(where)
            if back:
                gone = gone[~np.isin(gone, np.concatenate(back))]
            if len(gone):
                self._emit_run(EventKind.EVICT, where[0], where[1], gone, reason=scope.reason)
        for where, parts in installed.items():
            new: Any = parts[0] if len(parts) == 1 else unique(np.concatenate(parts))
            dropped = freed.get(where)
            if dropped:
                new = new[~np.isin(new, np.concatenate(dropped))]
            elif len(parts) == 1:  # one install, nothing netted: its keys as ints, if made already
                new = scope.installed_ints.get(where, new)
            if len(new):
                self._emit_run(EventKind.COMMIT, where[0], where[1], new, tenant=scope.tenant or
                               self.identity.default_tenant, adapter=scope.adapter)

    def emit_transfer(self, kind: EventKind, group: int, src: Tier, dst: Tier, keys: Any,
                      duration_ns: int, **fields: Any) -> None:
        """Pages of a group moved between tiers (an offload or a load), as one run of keys; the
        ledgers are the caller's to update (`install_slots(..., report=False)`)."""
        keys = keys.tolist() if isinstance(keys, np.ndarray) else keys
        self.emitter.emit(replace(self._base, kind=kind, component=self.components[group], group_id=group,
                                  src_tier=src, dst_tier=dst, nbytes=self.page_bytes[group], block_key=keys[0],
                                  more_keys=tuple(keys[1:]), duration_ns=max(int(duration_ns), 0), **fields))

    def emit_attach(self, recipe: Recipe | None = None) -> None:
        """The engine, its recipe and its empty memory, once (see `kvtrace.instrumentation.attach`):
        the first thing `install` says. The recipe is the cache's own, unless given: the resolver
        gives the one the engine side derived, as its cache is a stand-in."""
        try:
            if not self.emitter.enabled:
                return
            events = attach_events(self._base, recipe or recipe_from_cache(self.cache),
                                   engine_version=self.engine_version, max_model_len=self.max_model_len,
                                   block_size=self.page)
            for event in events:
                self.emitter.emit(event)
        except Exception:  # noqa: BLE001 - the engine must never see kvtrace fail
            self._failed("attach")

    def emit_invalidate(self, tier: Tier, reason: Reason) -> None:
        """A whole tier, for every tenant and adapter (empty is the analysis's wildcard)."""
        self.emitter.emit(replace(self._base, kind=EventKind.INVALIDATE, reason=reason, tier=tier, block_size=0,
                                  tenant="", adapter=""))

    def _emit_run(self, kind: EventKind, group: int, tier: Tier, keys: Any, reason: Reason = Reason.NONE,
                  **fields: Any) -> None:
        keys = keys.tolist() if isinstance(keys, np.ndarray) else keys
        self.emitter.emit(replace(self._base, kind=kind, component=self.components[group], group_id=group, tier=tier,
                                  nbytes=self.page_bytes[group] if tier is Tier.DEVICE else 0, block_key=keys[0],
                                  more_keys=tuple(keys[1:]), reason=reason, **fields))

    # -- key chains --------------------------------------------------------------------------------
    def _chain_of(self, key: Any, req: Any) -> Chain:
        """The request's chain (kept on the request), else one of a recent lookup whose tokens
        this key extends, else a new one."""
        extra, salt = getattr(key, "extra_key", None), getattr(key, "cache_salt", None)
        tokens = key.token_ids
        if req is not None:
            chain = getattr(req, "_kvtrace_chain", None)
            if chain is None:
                chain = new_chain(extra, salt)
                try:
                    req._kvtrace_chain = chain
                except AttributeError:
                    pass
            return chain
        n = len(tokens) // self.page * self.page
        fresh = new_chain(extra, salt)
        for recent_tokens, chain in reversed(self._recent.values()):
            if chain.seed != fresh.seed or type(recent_tokens) is not type(tokens):
                continue
            m = min(n, len(recent_tokens) // self.page * self.page)
            if m and _same_prefix(tokens, recent_tokens, m):
                if m < n:  # this key goes further: the shared part, extended
                    return chain.prefix(m // self.page)
                return chain
        return fresh

    def _remember(self, tokens: Any, chain: Chain) -> None:
        self._recent[id(chain)] = (tokens, chain)
        self._recent.move_to_end(id(chain))
        while len(self._recent) > 8:
            self._recent.popitem(last=False)

    # -- lookups and adopts ------------------------------------------------------------------------
    def _sampled(self, rid: str) -> bool:
        return self.sample_rate >= 1.0 or self.emitter.sampled(request_key(rid), self.sample_rate)

    def _request_tokens(self, key: Any, req: Any) -> Any:
        """The request's tokens so far (prompt, then output), which its chain covers."""
        if req is None:
            return key.token_ids
        ids = getattr(req, "origin_input_ids", None)
        if ids is None:
            return key.token_ids
        out = getattr(req, "output_ids", None)
        if not out:
            return ids
        return ids + out if type(ids) is type(out) else list(ids) + list(out)

    def reported_lookup(self, request_id: str) -> tuple[int, int] | None:
        """The hits (device, host) of the request's last lookup reported, until its admission;
        a lookup with the same answer is not reported again."""
        return self._looked_up.get(request_id)

    def after_lookup(self, result: Any, _token: Any, params: Any, *args: Any, **kwargs: Any) -> None:
        req = getattr(params, "req", None)
        key = params.key
        rid = str(getattr(req, "rid", "")) if req is not None else ""
        device, host = int(result.device_prefix_len), int(result.host_hit_length)
        if rid and self._looked_up.get(rid) == (device, host):
            return  # the scheduler asks again each round; one lookup per answer
        tokens = self._request_tokens(key, req)
        chain = self._chain_of(key, req)
        chain.extend(tokens, self.page)  # extended for every request: its inserts name pages by it
        self._remember(tokens, chain)
        if not rid:
            rid = f"anon-{id(key):x}"
        self._looked_up[rid] = (device, host)
        while len(self._looked_up) > 65536:
            self._looked_up.popitem(last=False)
        if not self._sampled(rid):
            return
        # Python ints only for a lookup that is emitted. A tuple, not a list: Python's garbage
        # collector stops tracking a tuple of ints, while a queue of lookups holding lists of
        # hundreds of keys is walked by every full collection.
        keys = chain.ints(0, len(tokens) // self.page)
        full = int(getattr(result, "full_kv_hit_length", 0) or 0) or device + host
        hits = [full if g == self.full else device + host for g in range(len(self.components))]
        prompt = len(tokens) + (1 if req is None else 0)  # a bare key is the prompt less its last token
        # A request retracted under memory pressure is matched again when it is admitted again
        preemptions = int(getattr(req, "retraction_count", 0) or 0) if req is not None else 0
        self.emitter.emit(replace(
            self._base, kind=EventKind.LOOKUP, request_id=rid, prompt_tokens=prompt,
            tenant=getattr(key, "cache_salt", None) or self.identity.default_tenant,
            adapter=str(getattr(key, "extra_key", None) or ""), block_size=0,
            group_block_keys=tuple([keys] * len(self.components)), group_hit_tokens=tuple(hits),
            reported_hit_tokens=device + host, preemptions=preemptions,
            computed_before_preemption=int(getattr(req, "_kvtrace_computed", 0) or 0) if preemptions else 0))
        if self.usage_interval_ns:
            self.sample_usage()

    def record_admission(self, request_id: str, prompt_tokens: int, device: int, host: int = 0, storage: int = 0,
                         tenant: str | None = None) -> None:
        """What the engine reused for one admitted request, per tier (SGLang's own split:
        `cached_tokens_device`, `_host`, `_storage`); the rest was recomputed."""
        try:
            rid = str(request_id)
            self._looked_up.pop(rid, None)
            if not self._sampled(rid):
                return
            tiers, tokens = [], []
            for tier, n in ((Tier.DEVICE, device), (Tier.HOST, host), (Tier.DISK, storage)):
                if n:
                    tiers.append(tier)
                    tokens.append(int(n))
            self.emitter.emit(replace(
                self._base, kind=EventKind.ADOPT, request_id=rid, block_size=0,
                tenant=tenant or self.identity.default_tenant, reused_tiers=tuple(tiers), reused_tokens=tuple(tokens),
                recomputed_tokens=max(int(prompt_tokens) - sum(tokens), 0)))
        except Exception:  # noqa: BLE001
            self._failed("record_admission")

    # -- commits -----------------------------------------------------------------------------------
    def before_checkpoint(self, req: Any, *args: Any, **kwargs: Any) -> Any:
        self._current_req = req  # the insert inside names its pages with this request's chain
        return None

    def after_checkpoint(self, result: Any, _token: Any, *args: Any, **kwargs: Any) -> None:
        self._current_req = None

    def before_insert(self, params: Any, *args: Any, **kwargs: Any) -> Any:
        key, value = params.key, params.value
        if key is None or value is None:
            return None
        pages = len(key) // self.page
        chain = self._chain_of(key, self._current_req)
        keys = chain.extend(key.token_ids, self.page)
        slots = self.page_slots(-1, value[: pages * self.page])
        scope = self._scope
        if scope is not None:
            scope.insert_slots, scope.insert_pos, scope.insert_keys = slots, None, keys
            scope.tenant = getattr(key, "cache_salt", None) or self.identity.default_tenant
            scope.adapter = str(getattr(key, "extra_key", None) or "")
        return keys, slots, pages, chain

    def after_insert(self, result: Any, token: Any, params: Any, *args: Any, **kwargs: Any) -> None:
        if token is None:
            return
        keys, slots, pages, chain = token
        start = int(result.prefix_len) // self.page
        if start < pages:
            self.install_slots(self.full, Tier.DEVICE, slots[start:pages], keys[start:pages],
                               ints=chain.ints(start, pages))
        mamba_value = getattr(params, "mamba_value", None)
        if self._mamba is not None and mamba_value is not None and pages and not result.mamba_exist:
            self.install_slots(self._mamba, Tier.DEVICE, self.page_slots(self._mamba, mamba_value)[:1],
                               keys[pages - 1 : pages])

    # -- streaming sessions ------------------------------------------------------------------------
    def _after_claim(self, kept: Any, req: Any, *args: Any, **kwargs: Any) -> None:
        """`claim_kv_row(req)`: True when the request's streaming session took its KV row."""
        if kept is not True:
            return
        tokens = self._request_tokens(None, req)
        kept = kept_row(self.cache, req, len(tokens), self.page)
        if kept is None:
            return
        row_id, row = kept
        self._session_row_ids.add(row_id)
        chain = getattr(req, "_kvtrace_chain", None) or new_chain(getattr(req, "extra_key", None),
                                                                  getattr(req, "cache_salt", None))
        top, _ = self.begin_call("claim_kv_row", None, (), {})
        try:
            self.session_kept(chain, tokens, self.page_slots(self.full, row), getattr(req, "cache_salt", None),
                              getattr(req, "extra_key", None))
        finally:
            self.end_call("claim_kv_row", top, None, None, None, (), {})

    def session_kept(self, chain: Chain, tokens: Any, slots: np.ndarray, tenant: str | None, adapter: Any) -> None:
        """A streaming session keeps the request's pages in `slots` (its row, by page): the ones
        not held there already are committed, in the request's namespace. From the first one on,
        the frees of session rows are followed (`_before_free_row`)."""
        if not len(slots):
            return
        keys = chain.extend(tokens, self.page)[: len(slots)]
        slots = slots[: len(keys)]
        book = self.ledger.get((self.full, Tier.DEVICE))
        new = (book.peek(slots) != keys) if book is not None else np.ones(len(keys), dtype=bool)
        if self._scope is not None and not self._scope.tenant:  # its own scope (`_after_claim`)
            self._scope.tenant = tenant or self.identity.default_tenant
            self._scope.adapter = str(adapter or "")
        if new.any():
            self.install_slots(self.full, Tier.DEVICE, slots[new], keys[new])
            self._session_keys.update(keys[new].tolist())
            self._session_sorted = np.sort(np.fromiter(self._session_keys, dtype=np.uint64))
        if not self._session_rows:
            self._session_rows = True
            self.wrap_scoped(self.cache, "free_kv_row", None, before=self._before_free_row, optional=True)

    def _before_free_row(self, kv: Any, ranges: Any, *args: Any, **kwargs: Any) -> None:
        """`free_kv_row(kv, ranges)` gives back the whole pages of a row's position ranges: a
        session's (a rewound tail, a closed session, an aborted turn's), or a request's own,
        where nothing was committed and the ledger finds nothing to take."""
        if kv.req_pool_idx not in self._session_row_ids:
            return  # a request's own row: nothing there was committed
        pages = row_pages(self.cache.req_to_token_pool.req_to_token[kv.req_pool_idx], ranges, self.page)
        if len(pages):
            self._free(self.full, Tier.DEVICE, self.page_slots(self.full, pages))

    def _gone_everywhere(self, book: SlotBook, keys: np.ndarray) -> np.ndarray:
        """Of freed keys, those no slot holds any more. A page a streaming session kept can also
        be in the tree (a request outside the session with the same tokens): freeing one copy
        leaves the page resident."""
        known = self._session_sorted
        at = np.minimum(np.searchsorted(known, keys), len(known) - 1)
        candidates = keys[known[at] == keys]
        if not len(candidates):
            return keys
        held = candidates[np.isin(candidates, book.resident())]
        gone = candidates[~np.isin(candidates, held)]
        if len(gone):
            self._session_keys.difference_update(gone.tolist())
            self._session_sorted = np.sort(np.fromiter(self._session_keys, dtype=np.uint64))
        return keys[~np.isin(keys, held)] if len(held) else keys

    def before_release_session(self, *args: Any, **kwargs: Any) -> Any:
        """A session closing: what it kept goes by request. Returns its row, whose frees are
        followed until then."""
        if self._scope is not None:
            self._scope.reason = Reason.EXPLICIT
        slot = self.cache.session.slots.get(args[0]) if args and hasattr(self.cache, "session") else None
        return None if slot is None else slot.kv.req_pool_idx

    def _after_release_session(self, _result: Any, row: Any, *args: Any, **kwargs: Any) -> None:
        self._session_row_ids.discard(row)

    def start_afresh(self) -> None:
        """Records of this cache's calls were lost (see `capture`): what the shim knows can no
        longer be trusted. Calls in progress, lookups reported and HiCache's copies under way are
        forgotten, and every tier the ledger holds is reported invalidated and emptied; commits
        fill it again."""
        self._looked_up.clear()
        self._depth, self._scope, self._current_req = 0, None, None
        if self.hicache is not None:  # copies under way name pages of the ledger about to be dropped
            self.hicache.after_reset()
        self.drop_ledger(Reason.EXPLICIT)
        self.forget_sessions()

    def drop_ledger(self, reason: Reason) -> None:
        """Report every tier the ledger holds invalidated (the analysis then counts nothing
        there as held) and empty it: for when what it says can no longer be trusted."""
        tiers = {tier for (_, tier) in self.ledger} or {Tier.DEVICE}
        self.ledger.clear()
        for tier in sorted(tiers):
            self.emit_invalidate(tier, reason)

    def forget_sessions(self) -> None:
        """After a reset or a loss: no page is held twice any more."""
        self._session_keys.clear()
        self._session_sorted = np.zeros(0, dtype=np.uint64)

    # -- reset and usage ---------------------------------------------------------------------------
    def after_reset(self, result: Any, _token: Any, *args: Any, **kwargs: Any) -> None:
        tiers = {tier for (_, tier) in self.ledger} or {Tier.DEVICE}
        self.ledger.clear()
        self.forget_sessions()
        if self._scope is not None:
            self._scope.freed.clear()
            self._scope.installed.clear()
        self._recent.clear()
        for tier in sorted(tiers):
            self.emit_invalidate(tier, Reason.RESET)

    def sample_usage(self, force: bool = False) -> None:
        """The device KV pool split into slots locked by running requests, evictable cached
        pages and free slots (SGLang's own O(1) counters), at most once per interval."""
        now = time.monotonic_ns()
        if not force and now < self.usage_due_ns:
            return
        self.usage_due_ns = now + self.usage_interval_ns
        self.emit_usage(*usage_counters(self.cache))

    def emit_usage(self, locked: int, evictable: int, free: int) -> None:
        """One usage sample from SGLang's counters (tokens locked, evictable, free)."""
        per_token = self.page_bytes[self.full] // self.page if self.page_bytes else 0
        self.emitter.emit(replace(self._base, kind=EventKind.USAGE, tier=Tier.DEVICE, block_size=0,
                                  component=self.components[self.full], locked_bytes=locked * per_token,
                                  evictable_bytes=evictable * per_token, free_bytes=free * per_token))


def kept_row(cache: Any, req: Any, tokens: int, page: int) -> tuple[int, Any] | None:
    """The KV row a streaming session keeps for `req`: its request-pool row number and the slots
    of its committed whole pages, as far as `tokens` reach; None when no session keeps one."""
    slot = cache.session.slots.get(getattr(getattr(req, "session", None), "session_id", None))
    if slot is None:
        return None
    kv = slot.kv
    pages = min(int(kv.kv_committed_len), tokens) // page
    return int(kv.req_pool_idx), cache.req_to_token_pool.req_to_token[kv.req_pool_idx, : pages * page]


def row_pages(row: Any, ranges: Any, page: int) -> Any:
    """The slots of the whole pages inside a request-pool row's position ranges, in order. A page
    a range covers only in part is not among them: SGLang's paged free keeps it."""
    parts = []
    for start, end in ranges:
        start = -(-int(start) // page) * page
        end = int(end) // page * page
        if end > start:
            parts.append(row[start:end])
    if len(parts) == 1:
        return parts[0]
    return parts


def host_values(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The slots of a component's `free_host_values(host_values)` call, positional or not."""
    return args[0] if args else kwargs.get("host_values")


def usage_counters(cache: Any) -> tuple[int, int, int]:
    """SGLang's O(1) counters of its device KV pool, in tokens: (locked, evictable, free)."""
    unified = hasattr(cache, "tree_components")  # the older trees count their one pool as a whole
    locked = int((cache.full_protected_size if unified else cache.protected_size)())
    evictable = int((cache.full_evictable_size if unified else cache.evictable_size)())
    allocator = getattr(cache, "token_to_kv_pool_allocator", None)
    free = int(allocator.available_size()) if allocator is not None else 0
    return locked, evictable, free


def _same_prefix(a: Any, b: Any, m: int) -> bool:
    """Whether two token sequences of one type agree on their first `m` tokens; SGLang's
    `array("q")` keys are compared as numpy views, without copying either."""
    if isinstance(a, array) and a.typecode == b.typecode:
        return bool(np.array_equal(np.frombuffer(a, dtype=a.typecode)[:m], np.frombuffer(b, dtype=b.typecode)[:m]))
    return a[:m] == b[:m]


def resident_keys(shim: RadixCacheShim, group: int = 0, tier: Tier = Tier.DEVICE) -> set[int]:
    """The pages the shim believes a group holds on a tier (for tests and debugging)."""
    book = shim.ledger.get((group, tier))
    return set(book.resident().tolist()) if book is not None else set()


def all_keys(events: Iterable[Event]) -> list[int]:
    out: list[int] = []
    for e in events:
        if e.block_key:
            out.append(e.block_key)
            out.extend(e.more_keys)
    return out
