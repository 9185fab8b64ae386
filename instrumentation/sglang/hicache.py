"""HiCache's tiers in the SGLang shim: host (L2) backups and load-backs, storage (L3) writes
and prefetches.

Each copy is read where SGLang pairs source and destination slots, so the shim's ledgers
follow pages between tiers without SGLang's KV events (which carry no slots, and are silent
about storage):
- offload device -> host: `cache_controller.write(device_indices, node_id=...)` returns host
  slots aligned with the device slots; reported at the acknowledgement
  (`_finish_write_through_ack(node_id)`), when the copy is there, with the time it took. Under
  write-through the write is submitted inside `insert`, before the pages have keys, so keys are
  read at the acknowledgement;
- load host -> device: `cache_controller.load(host_indices, node_id=...)` returns the device
  slots; reported when `loading_check` retires the load;
- offload host -> disk: `cache_controller.write_storage(host_indices, token_ids, hash_value)`:
  the host ledger names the pages, and SGLang's storage names for them are remembered
  (`StorageNames`); reported when the controller's storage acknowledgement queue hands back the
  operation, for the pages it completed;
- load disk -> host: a finished prefetch lands through `tree_core.insert_host(...)` under
  SGLang's storage names, translated back; a page another process stored is keyed from its
  tokens, continuing the chain from the node it hangs under when that node is the root or a
  page this process stored (else it is counted in `unnamed_pages`, not reported). The load
  names the request the prefetch was for, and its duration is the time since SGLang started
  the prefetch (`PrefetchOperation.start_time`, read as `_handle_prefetch_result` begins): the
  storage query, the queues and the copy, a fetch's whole cost as the engine sees it. It is
  `in_flight` (the request waited on it) unless the cache's prefetch policy is `best_effort`,
  under which SGLang admits a request without waiting and keeps what has landed by then. The
  states that come with the pages name the request too, but carry no second duration. Prefetches
  started and revoked (only those in flight) are counted (`prefetches`, a `PrefetchWatch`);
- a sliding window's or Mamba's state travels with its pages both ways: a storage write carries
  it (`extra_pools`, the trailing pages' state, reported once the whole write is acknowledged),
  and a landed prefetch's `tree_core.commit_hicache_transfers(..., PREFETCH, ...)` stages it on
  host under the keys of the trailing pages it landed, less the slots that commit frees again;
- invalidate: `clear_storage_backend()` empties the disk tier.
Evictions from host come through the shim's component `free_host_values` hooks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from kvtrace.instrumentation.hooks import HookSet
from kvtrace.instrumentation.sglang.keys import Chain, StorageNames, continue_from, new_chain
from kvtrace.instrumentation.sglang.ledger import SlotBook
from kvtrace.schema.kinds import EventKind, Reason, Tier

log = logging.getLogger("kvtrace.sglang")


def pool_name(transfer: Any, load: bool = False) -> str | None:
    """The component an extra pool of a HiCache copy belongs to ("SWA", "MAMBA"), or None for
    one kvtrace does not follow: sidecars, and on a load-back (`load`) a transfer that restores
    no tree node (no `nodes_to_load`). That is Mamba's copy-on-write: the node's state is loaded
    once for the tree and once more into the request's own state slot, which the request then
    advances; that second copy is the request using the state, not the cache holding it."""
    name = str(getattr(getattr(transfer, "name", None), "name", getattr(transfer, "name", ""))).upper()
    if name not in ("SWA", "MAMBA") or (load and not getattr(transfer, "nodes_to_load", None)):
        return None
    return name


def hung_under(cache: Any, node_id: Any) -> tuple[bool, str | None]:
    """Where pages a prefetch landed hang in the tree: under the root (True, None), or under a
    node, named by SGLang's storage name for its last page (False, that name or None)."""
    tree = getattr(cache, "tree_core", None)
    if tree is not None and tree.is_root(node_id):
        return True, None
    return False, cache.get_last_hash_value(node_id) or None


def in_flight(cache: Any, request: Any) -> int:
    """1 when the request has a storage prefetch in flight (SGLang calls its revoke, to be
    sure, for requests that have none, and returns early from many a start)."""
    return int(request in (getattr(cache, "ongoing_prefetch", None) or {}))


class PrefetchWatch:
    """SGLang's storage prefetches as the calls around them show them, on the scheduler thread:
    how many started, and how many were revoked in flight, and which one SGLang is handling the
    result of (its request and start), which the landing after it belongs to. Both modes keep
    one; none of it changes what the cache holds, so the out-of-process mode records none of it."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.started = 0
        self.revoked = 0
        self.handling: tuple[str, int] = ("", 0)  # request id, start (monotonic ns); see `prefetch_of`
        self._asked_in_flight = 0

    def install(self, hooks: HookSet) -> None:
        """Wrap the cache's prefetch calls, into the hooks of the shim (either mode's) that keeps it."""
        c = self.cache
        hooks.wrap_before(c, "_handle_prefetch_result", self._handling)
        hooks.wrap_after(c, "prefetch_from_storage", self._asked)
        hooks.wrap_before(c, "prefetch_from_storage", self._asking)
        hooks.wrap_before(c, "revoke_pending_prefetch", self._revoking)

    def _asking(self, request: Any, *args: Any, **kwargs: Any) -> None:
        self._asked_in_flight = in_flight(self.cache, request)

    def _asked(self, _result: Any, request: Any, *args: Any, **kwargs: Any) -> None:
        # SGLang returns early for many reasons (no storage, one already running, too little
        # to fetch, a decision already made): only a prefetch that is now in flight counts.
        self.started += int(in_flight(self.cache, request) and not self._asked_in_flight)

    def _revoking(self, request: Any, *args: Any, **kwargs: Any) -> None:
        self.revoked += in_flight(self.cache, request)

    def _handling(self, operation: Any, *args: Any, **kwargs: Any) -> None:
        self.handling = prefetch_of(operation)

    def landing(self, now_ns: int) -> tuple[str, int, bool]:
        """What a landing now under way belongs to: the request fetched for, the time since
        its prefetch started, and whether the request waits for it (`holds_requests`)."""
        rid, started = self.handling
        return rid, now_ns - started if started else 0, holds_requests(self.cache)


def holds_requests(cache: Any) -> bool:
    """Whether SGLang keeps a request waiting while its prefetch runs: every prefetch policy
    but `best_effort`, which admits it at once with what has landed."""
    return getattr(cache, "prefetch_stop_policy", "") != "best_effort"


def prefetch_of(operation: Any) -> tuple[str, int]:
    """A prefetch operation's request and when SGLang started it (its `time.monotonic()`, as
    nanoseconds on the same clock as `time.monotonic_ns()`)."""
    started = getattr(operation, "start_time", None)
    return str(getattr(operation, "request_id", "") or ""), int(started * 1e9) if started else 0


def prefetch_states(comp_xfers: Any, cache_actions: Any) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:
    """What a landed prefetch's commit (`commit_hicache_transfers(..., PREFETCH, ...)`) stages on
    host: (component type, host indices) of each component's transfer, and of each host slot
    the commit frees again (`FreeComponentHostSlot`)."""
    staged = [(ct, xfers[0].host_indices) for ct, xfers in (comp_xfers or {}).items()
              if xfers and xfers[0].host_indices is not None]
    released = [(action.component_type, action.host_indices) for action in cache_actions or ()
                if type(action).__name__ == "FreeComponentHostSlot"]
    return staged, released


class Ledgers(Protocol):
    """The radix-cache shim as HiCache's hooks extend it (`shim.RadixCacheShim` is one): its cache
    and page size, its ledgers and how slots and pages enter them, its events, and its wrappers."""

    cache: Any
    page: int
    full: int  # the group whose slots name KV pages
    group_of: dict[Any, int]  # SGLang's component types -> groups
    ledger: dict[tuple[int, Tier], SlotBook]
    hooks: HookSet

    def group_named(self, name: str, default: int | None = None) -> int | None: ...

    def page_slots(self, group: int, values: Any) -> np.ndarray: ...

    def install_slots(self, group: int, tier: Tier, slots: np.ndarray, keys: np.ndarray, report: bool = True,
                      ints: tuple[int, ...] | None = None) -> None: ...

    def emit_transfer(self, kind: EventKind, group: int, src: Tier, dst: Tier, keys: Any, duration_ns: int,
                      **fields: Any) -> None: ...

    def emit_invalidate(self, tier: Tier, reason: Reason) -> None: ...

    def wrap_scoped(self, obj: Any, name: str, after: Callable[..., None] | None,
                    before: Callable[..., Any] | None = None, optional: bool = False) -> None: ...


class HiCacheHooks:
    """Follows one HiCache-enabled cache's copies between tiers; `install()` after `init_hicache`.

    The out-of-process mode's resolver replays recorded calls through the same hooks the
    wrapped calls run here (`after_write`, `after_write_ack`, `after_load`, `after_loading_check`,
    `after_write_storage`, `after_storage_ack`, `landed`, `prefetched`, `after_clear_storage`,
    `after_reset`), on the clock it sets (`clock`)."""

    def __init__(self, shim: Ledgers) -> None:
        self.shim = shim
        self.cache = shim.cache
        self.controller = getattr(self.cache, "cache_controller", None)
        self.page = shim.page
        self.full = shim.full
        # ack id -> [(group, device slots, host slots, t0)]; ack id -> ([(group, keys)], t0)
        self._writes: dict[int, list[tuple[int, np.ndarray, np.ndarray, int]]] = {}
        self._loads: dict[int, tuple[list[tuple[int, np.ndarray]], int]] = {}
        # op id -> (names, host slots, t0, [(group, host slots)] of the states written with them)
        self._storage: dict[int, tuple[list[str], np.ndarray, int, list[tuple[int, np.ndarray]]]] = {}
        self._landed = np.zeros(0, dtype=np.uint64)  # keys of the pages the last prefetch landed
        self._landed_for: tuple[str, int, bool] = ("", 0, False)  # the last landing's (`landed`), for its states
        self.names = StorageNames()
        self.unnamed_pages = 0
        self.prefetches = PrefetchWatch(self.cache)
        self._acks: Any = None  # the storage acknowledgement queue wrapped
        # When a copy started and ended; the out-of-process resolver reads it off the records
        # instead, the times the capture took on the scheduler thread.
        self.clock: Callable[[], int] = time.monotonic_ns

    def install(self) -> HiCacheHooks:
        c, cc = self.cache, self.controller
        if cc is None:
            log.warning("kvtrace: this SGLang cache has no HiCache controller; host and storage tiers are off")
            return self
        s, hooks = self.shim, self.shim.hooks
        hooks.wrap_after(cc, "write", self.after_write)
        hooks.wrap_after(c, "_finish_write_through_ack", self.after_write_ack)
        hooks.wrap_after(cc, "load", self.after_load)
        s.wrap_scoped(c, "loading_check", self.after_loading_check, before=self._before_loading_check)
        s.wrap_scoped(c, "check_hicache_events", None)
        s.wrap_scoped(c, "init_load_back", None)
        hooks.wrap_after(cc, "write_storage", self.after_write_storage)
        self._wrap_storage_acks()
        hooks.wrap_after(cc, "attach_storage_backend", self._after_attach_storage)
        tree = getattr(c, "tree_core", None)
        hooks.wrap_after(tree, "insert_host", self._after_insert_host)
        hooks.wrap_after(tree, "commit_hicache_transfers", self._after_commit_transfers)
        self.prefetches.install(hooks)
        hooks.wrap_after(c, "clear_storage_backend", self.after_clear_storage)
        hooks.wrap_after(c, "reset", self.after_reset)
        return self

    def _wrap_storage_acks(self) -> None:
        """The storage tier's acknowledgement queue: there from the start when the tier was, made
        anew when one is attached at run time (`attach_storage_backend`)."""
        queue = getattr(self.controller, "ack_backup_queue", None)
        if queue is not None and queue is not self._acks:
            self._acks = queue
            self.shim.hooks.wrap_after(queue, "get", self.after_storage_ack)

    def _after_attach_storage(self, *args: Any, **kwargs: Any) -> None:
        self._wrap_storage_acks()

    def _extra(self, pools: Any, load: bool = False) -> list[tuple[int, Any, Any]]:
        """(group, device indices, host indices) of the component transfers that travel with a
        copy (`extra_pools`: a sliding window's or Mamba's state) that kvtrace follows (`pool_name`)."""
        out = []
        for transfer in pools or ():
            name = pool_name(transfer, load)
            group = self.shim.group_named(name) if name is not None else None
            if group is not None:
                out.append((group, getattr(transfer, "device_indices", None), getattr(transfer, "host_indices", None)))
        return out

    # -- device -> host ----------------------------------------------------------------------------
    def after_write(self, host: Any, device_indices: Any, *args: Any, node_id: int = -1, extra_pools: Any = None,
                     **kwargs: Any) -> None:
        if host is None:
            return  # the host was full: no backup
        now, page = self.clock(), self.shim.page_slots
        pending = self._writes.setdefault(int(node_id), [])
        pending.append((self.full, page(self.full, device_indices), page(self.full, host), now))
        for group, dev, hst in self._extra(extra_pools):  # host slots are filled in by the write
            if dev is not None and hst is not None:
                pending.append((group, page(group, dev), page(group, hst), now))

    def after_write_ack(self, _result: Any, ack_id: int, *args: Any, **kwargs: Any) -> None:
        pending = self._writes.pop(int(ack_id), None)
        if not pending:
            return
        now = self.clock()
        for group, dev, host, t0 in pending:
            book = self.shim.ledger.get((group, Tier.DEVICE))
            if book is None:
                continue
            n = min(len(dev), len(host))
            keys = book.peek(dev[:n])
            held = keys != 0
            if held.any():
                self.shim.install_slots(group, Tier.HOST, host[:n][held], keys[held], report=False)
                self.shim.emit_transfer(EventKind.OFFLOAD, group, Tier.DEVICE, Tier.HOST, keys[held], now - t0)

    # -- host -> device ----------------------------------------------------------------------------
    def after_load(self, device: Any, host_indices: Any, *args: Any, node_id: int = -1, extra_pools: Any = None,
                    **kwargs: Any) -> None:
        if device is None:
            return
        moves = [(self.full, host_indices, device)]
        # device side now resolved
        moves += [(group, hst, dev) for group, dev, hst in self._extra(extra_pools, load=True)]
        now, loads = self.clock(), []
        for group, hst, dev in moves:
            book = self.shim.ledger.get((group, Tier.HOST))
            if book is None or hst is None or dev is None:
                continue
            host, slots = self.shim.page_slots(group, hst), self.shim.page_slots(group, dev)
            n = min(len(host), len(slots))
            keys = book.peek(host[:n])
            held = keys != 0
            if held.any():  # the device slots hold these pages from now on (SGLang publishes them at once)
                self.shim.install_slots(group, Tier.DEVICE, slots[:n][held], keys[held], report=False)
                loads.append((group, keys[held]))
        if loads:
            self._loads[int(node_id)] = (loads, now)

    def _before_loading_check(self, *args: Any, **kwargs: Any) -> Any:
        return set(getattr(self.cache, "ongoing_load_back", {}) or {})

    def after_loading_check(self, _result: Any, before: Any, *args: Any, **kwargs: Any) -> None:
        if before is None:
            return
        still = set(getattr(self.cache, "ongoing_load_back", {}) or {})
        now = self.clock()
        done = [a for a in before - still if isinstance(a, int)]
        if not still:  # anything left was retired without an id we saw: report it done now
            done += [a for a in self._loads if a in before and a not in done]
        for ack_id in done:
            load = self._loads.pop(int(ack_id), None)
            if load is not None:
                moved, t0 = load
                for group, keys in moved:
                    self.shim.emit_transfer(EventKind.LOAD, group, Tier.HOST, Tier.DEVICE, keys, now - t0)

    # -- host -> disk ------------------------------------------------------------------------------
    def after_write_storage(self, op_id: Any, host_indices: Any, token_ids: Any, hash_value: Any = None,
                             *args: Any, extra_pools: Any = None, **kwargs: Any) -> None:
        if op_id is None or not hash_value:
            return
        # Named at the acknowledgement: the write is submitted inside the host backup's own
        # acknowledgement, before the host ledger holds the pages.
        names = list(hash_value)
        states = [(group, self.shim.page_slots(group, hst)) for group, _, hst in self._extra(extra_pools)
                  if hst is not None]
        self._storage[int(op_id)] = (names, self.shim.page_slots(self.full, host_indices)[: len(names)],
                                     self.clock(), states)

    def after_storage_ack(self, op: Any, *args: Any, **kwargs: Any) -> None:
        pending = self._storage.pop(int(getattr(op, "id", -1)), None)
        if pending is None:
            return
        names, slots, t0, states = pending
        done = int(getattr(op, "completed_tokens", len(slots) * self.page)) // self.page
        whole = done >= len(slots)
        names, slots = names[:done], slots[:done]  # a batch stops at its first failed page
        now = self.clock()
        self._offload_to_disk(self.full, slots, now - t0, names)
        if whole:  # a window's or Mamba's state: the trailing pages, written with the last of the KV
            for group, host in states:
                self._offload_to_disk(group, host, now - t0)

    def _offload_to_disk(self, group: int, slots: np.ndarray, duration_ns: int, names: list[str] | None = None) -> None:
        book = self.shim.ledger.get((group, Tier.HOST))
        keys = book.peek(slots) if book is not None else np.zeros(0, dtype=np.uint64)
        if names is not None:
            self.names.learn(names, keys)
        keys = keys[keys != 0]
        if len(keys):
            self.shim.emit_transfer(EventKind.OFFLOAD, group, Tier.HOST, Tier.DISK, keys, duration_ns)

    # -- disk -> host ------------------------------------------------------------------------------
    def _after_insert_host(self, result: Any, node_id: Any, key: Any, host_value: Any, hash_value: Any,
                           *args: Any, **kwargs: Any) -> None:
        if result is None or getattr(result, "host_insert_dropped", False) or not hash_value:
            return
        root, parent = hung_under(self.cache, node_id)
        self.landed(int(result.prefix_len), list(hash_value), key, host_value, root, parent,
                    *self.prefetches.landing(self.clock()))

    def landed(self, prefix_len: int, names: list[str], key: Any, host_value: Any, root: bool,
               parent: str | None, request_id: str = "", took_ns: int = 0, held: bool = False) -> None:
        """A prefetch landed on host: `names` (SGLang's storage names) for the key's pages in
        `host_value`, the first `prefix_len` tokens already on host, under the root or under
        the node whose last page SGLang names `parent`; fetched for `request_id` in `took_ns`
        since it started, the request `held` back for it (`holds_requests`)."""
        start = prefix_len // self.page
        keys = np.array([self.names.get(n) for n in names], dtype=np.uint64)
        if not keys.all():
            chain = self._chain_under(root, parent, key)
            if chain is not None:
                made = chain.extend(key.token_ids, self.page)[: len(keys)]
                keys[: len(made)] = np.where(keys[: len(made)] == 0, made, keys[: len(made)])
        self._landed = keys  # the states that came with them end with these pages (`prefetched`)
        self._landed_for = (request_id, took_ns, held)
        slots = self.shim.page_slots(self.full, host_value)[start:]
        keys = keys[start:]
        n = min(len(slots), len(keys))
        slots, keys = slots[:n], keys[:n]
        known = keys != 0
        self.unnamed_pages += int(n - known.sum())
        if known.any():
            self.shim.install_slots(self.full, Tier.HOST, slots[known], keys[known], report=False)
            self._emit_landed(self.full, keys[known])

    def _emit_landed(self, group: int, keys: np.ndarray) -> None:
        """Disk to host, for the request it was fetched for. The fetch's time goes with the KV
        pages only: counted once per prefetch, not again for each state that came with them."""
        rid, took, held = self._landed_for
        pages = group == self.full
        self.shim.emit_transfer(EventKind.LOAD, group, Tier.DISK, Tier.HOST, keys, took if pages else 0,
                                 request_id=rid, in_flight=pages and bool(rid) and held)

    def _after_commit_transfers(self, _result: Any, node_id: Any, phase: Any, comp_xfers: Any, *args: Any,
                                cache_actions: Any = (), **kwargs: Any) -> None:
        """A landed prefetch's component transfers committed onto the tree: the window's or
        Mamba's state staged on host with the pages, less what the commit gives back."""
        if getattr(phase, "name", phase) != "PREFETCH":
            return
        staged, released = prefetch_states(comp_xfers, cache_actions)
        group_of, page = self.shim.group_of, self.shim.page_slots
        self.prefetched([(group_of[ct], page(group_of[ct], host)) for ct, host in staged
                         if group_of.get(ct, self.full) != self.full],
                        [(group_of[ct], page(group_of[ct], host)) for ct, host in released if ct in group_of])

    def prefetched(self, staged: list[tuple[int, np.ndarray]], released: list[tuple[int, np.ndarray]]) -> None:
        """States a prefetch staged on host (`staged`: group, its slots) for the trailing pages
        of the pages it landed; `released`: slots the commit frees again (a state the tree
        already had, or a window that did not arrive whole), which never held a page."""
        keys, self._landed = self._landed, np.zeros(0, dtype=np.uint64)
        for group, slots in staged:
            n = len(slots)
            if not n:
                continue
            # The trailing pages, aligned from the end: a window reaching back past the landed
            # pages covers pages the host already had there, which the commit frees again.
            named = np.zeros(n, dtype=np.uint64)
            m = min(n, len(keys))
            named[n - m :] = keys[len(keys) - m :]
            keep = named != 0
            gone = [s for g, s in released if g == group]
            if gone:
                keep &= ~np.isin(slots, np.concatenate(gone))
            if keep.any():
                self.shim.install_slots(group, Tier.HOST, slots[keep], named[keep], report=False)
                self._emit_landed(group, named[keep])

    def _chain_under(self, root: bool, parent: str | None, key: Any) -> Chain | None:
        """The chain of pages that hang under a tree node: from the namespace's seed under the
        root, else after the node's last page when this process knows its kvtrace key."""
        if root:
            return new_chain(getattr(key, "extra_key", None), getattr(key, "cache_salt", None))
        known = self.names.get(parent)
        return continue_from(known) if known else None

    def after_clear_storage(self, cleared: Any, *args: Any, **kwargs: Any) -> None:
        if cleared:
            self.names.clear()
            self.shim.emit_invalidate(Tier.DISK, Reason.RESET)

    def after_reset(self, *args: Any, **kwargs: Any) -> None:
        self._writes.clear()
        self._loads.clear()
        self._storage.clear()
