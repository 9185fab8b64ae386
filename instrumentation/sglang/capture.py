"""The SGLang shim split in two: the engine thread records raw facts, another process names them.

`RadixCacheShim` does all its work on SGLang's scheduler thread: it hashes every prompt into
page keys, keeps the slot ledger and builds the events. On a cache-only replay that is ~0.45 ms
a request, as much as the cache's own work. In this mode the scheduler thread only copies what
the shim would read (a lookup's tokens and hit lengths, an insert's slots, the slots a free
drops, and an insert's tokens unless it is inside a request's checkpoint, whose tokens that
request's lookup sent, and the window slots the allocator maps full-attention pages to, where
the shim would read that live table) into a shared-memory ring (`kvtrace.instrumentation.ring`),
as the typed records of `records`.
A resolver process (`resolver`) replays those facts through an unchanged `RadixCacheShim`, so
both modes emit the same events, and its emitter sends them to the configured sink.

The scheduler thread never waits: a full ring drops the record and counts it, and the
resolver, told of the loss, starts its ledger afresh and reports the device tier invalidated
(an honest "unknown" instead of evictions it can no longer name). Covered: full attention,
sliding-window and Mamba components, in any mix, on the unified tree, and HiCache's host and
storage tiers (their copies are recorded where `HiCacheHooks` reads them, with the scheduler
thread's times), and streaming sessions (the rows they keep and give back). The older
single-component trees stay in-process (`unsupported` says why).
HiCache's counters (`HiCacheHooks.prefetches`, `unnamed_pages`) are not
events: in this mode `ProcessShim.stats()` has them (the first two counted here, the last by
the resolver).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np

from kvtrace.instrumentation.api import key_sampled, request_key
from kvtrace.instrumentation.hooks import HookSet
from kvtrace.instrumentation.identity import Identity
from kvtrace.instrumentation.ring import Ring
from kvtrace.instrumentation.sglang.hicache import PrefetchWatch, hung_under, pool_name, prefetch_states
from kvtrace.instrumentation.sglang.ledger import gather, page_starts, slot_step
from kvtrace.instrumentation.sglang.recipe import component_name, component_types, recipe_from_cache
from kvtrace.instrumentation.sglang.records import (
    CALLS,
    CHECKPOINT_RETURNED,
    MAMBA_EXISTED,
    REQUESTS_KEPT,
    Acted,
    Action,
    Admit,
    Backed,
    Backup,
    Checkpoint,
    Fetched,
    Insert,
    Kept,
    Lookup,
    Rec,
    ResolverSpec,
    Restore,
    Restored,
    Staged,
    Store,
    Stored,
    encode,
)
from kvtrace.instrumentation.sglang.shim import (
    RadixCacheShim,
    host_values,
    kept_row,
    row_pages,
    usage_counters,
    watch_retractions,
)

log = logging.getLogger("kvtrace.sglang")


FREES = ("FreeDeviceKV", "FreeDeviceKVFullOnly", "FreeComponentDeviceSlot", "FreeComponentHostSlot")
WINDOW_ACTIONS = {"SWARebuild": "source_value", "RecoverSWAWithLockedFull": "kept_full",
                  "RecoverEvictedSWA": "kept_full"}  # the shim's `after_action`: the field each names slots in
_NO_TOKENS = b""


def _words(blob: Any) -> np.ndarray:
    return blob if type(blob) is np.ndarray else np.frombuffer(blob, dtype=np.int64)


def _text(value: Any) -> str | None:
    return value if value is None or type(value) is str else str(value)


def tokens_blob(tokens: Any) -> Any:
    """Token ids as raw int64 bytes: SGLang's `array("q")` as it is, anything else converted."""
    if isinstance(tokens, array) and tokens.typecode == "q":
        return tokens
    if tokens is None or len(tokens) == 0:
        return _NO_TOKENS
    if hasattr(tokens, "cpu") and hasattr(tokens, "numpy"):
        tokens = tokens.cpu().numpy()
    return np.asarray(tokens, dtype=np.int64).reshape(-1)


def _mark(req: Any) -> None:
    """Mark a request object as seen. The in-process shim keeps a request's page chain on the
    object, so a new object under a known id starts a new chain; the resolver mirrors that when
    told (flag 8). An object that takes no attribute gets a new chain at every call in-process,
    and is reported as new every time here."""
    try:
        req._kvtrace_seen = True
    except AttributeError:
        pass


def unsupported(cache: Any) -> str | None:
    """Why this cache cannot be traced out of process, or None."""
    if getattr(cache, "_apply_cache_action", None) is None:
        return f"{type(cache).__name__} (an older tree: frees are read from tree nodes)"
    return None


@dataclass(slots=True)
class CaptureStats:
    records: int = 0
    dropped: int = 0  # records the full ring refused
    errors: int = 0  # captures that failed (the cache call went on)
    resolved: int = 0  # records the resolver has handled
    events: int = 0  # events the resolver's emitter took
    resolver_errors: int = 0
    lost_resets: int = 0  # times the resolver started afresh after drops
    skipped: int = 0  # repeated asks of a request the resolver no longer knew: no lookup for them
    # HiCache's storage prefetches, as `HiCacheHooks` counts them in-process
    prefetches_started: int = 0
    prefetches_revoked: int = 0
    unnamed_pages: int = 0  # landed pages another process stored that could not be keyed (the resolver's)


class CaptureShim:
    """Wraps one cache's methods like `RadixCacheShim`, recording instead of resolving."""

    def __init__(self, cache: Any, ring: Ring, usage_interval_s: float = 1.0, sample_rate: float = 1.0) -> None:
        self.cache, self.ring = cache, ring
        self.page = int(cache.page_size)
        names = [component_name(ct) for ct in component_types(cache)]
        self.group_names = names
        self._mamba = names.index("MAMBA") if "MAMBA" in names else None
        self._full = names.index("FULL") if "FULL" in names else 0  # the shim's rule (`full`)
        self._swa = names.index("SWA") if "SWA" in names and len(names) > 1 else None  # the shim's rule
        self._windowed = "SWA" in names  # window actions are recorded (the shim reads each one it sees)
        self.hooks = HookSet("SGLang", log, self._failed)  # what `install` wraps
        self._calls: list[list[Any]] = []  # calls in progress: [CALLS index, opening recorded]
        self._unopened = 0
        self.errors = 0
        self._asked: OrderedDict[str, tuple[int, int]] = OrderedDict()  # rid -> hits last sent
        # The resolver's request stand-ins, mirrored: rid -> how many tokens (prompt, then output)
        # its stand-in holds, updated at the same records in the same order, with the same bound
        # (`_stand_in`). The insert inside a request's checkpoint names that many of its tokens.
        self._sent: OrderedDict[str, int] = OrderedDict()
        self.sample_rate = sample_rate
        # The checkpoint under way: (its request's id, the request object, the number of its
        # tokens the resolver holds once the checkpoint is opened there).
        self._checkpointing: tuple[str, Any, int] = ("", None, 0)
        self._checkpoint_call = CALLS.index("checkpoint")
        self._held = -1  # an INSERTED held back until the next record (its END may fold in)
        self.alive: Callable[[], bool] | None = None  # whether the resolver still runs
        self.stopped = False  # unwrapped: records nothing more
        self._check_due_ns = 0
        self._usage_ns = int(usage_interval_s * 1e9)  # 0: usage is never sampled
        self._usage_due_ns = 0
        self._frees: dict[tuple[str, Any], tuple[int, bytes, bool]] = {}  # (action, component) -> step, meta, window
        self._loads_before: list[int] = []  # HiCache's loads in progress when `loading_check` began
        self._acks: Any = None  # the storage acknowledgement queue wrapped
        self.prefetches = PrefetchWatch(cache)
        self._session_rows = False  # frees of request-pool rows recorded (`_wrap_row_frees`)
        self._session_row_ids: set[int] = set()  # request-pool rows a session kept, as the shim's
        self._closing: Any = None  # the row of the session `release_session` is closing
        self._loading_call = CALLS.index("loading_check")

    # -- the ring ----------------------------------------------------------------------------------
    def _put(self, kind: Rec, value: int = 0, blobs: Any = ()) -> bool:
        """Write one record at once, while what it copies is still in the CPU's caches (a
        slot tensor gathered at the end of the call that handed it over costs several times
        more than at its start). The ring reports earlier drops ahead of it. After a drop the
        resolver starts afresh, so every request's next ask carries its tokens again.

        Records cost more for their number than their size (a small one ~5-10 us with the caches
        as SGLang's work leaves them), so an insert's INSERTED waits for the next record: the
        END of the checkpoint around it folds into it."""
        if self._held >= 0 and kind is Rec.END and value == self._checkpoint_call:
            kind, value, self._held = Rec.INSERTED, self._held | CHECKPOINT_RETURNED, -1
        self._settle()
        if self.ring.offer(kind, value, blobs):
            return True
        self._forget()
        return False

    def _settle(self) -> None:
        """Write what must precede a new record: a held INSERTED (its insert returned before any
        call now open and unrecorded began, so it goes first, straight to the ring), then the
        openings of those calls."""
        if self._held >= 0:
            held, self._held = self._held, -1
            if not self.ring.offer(Rec.INSERTED, held):
                self._forget()
        if self._unopened:
            self._open_calls()

    def _forget(self) -> None:
        """After a loss the resolver starts afresh: nothing sent before it is named again."""
        self._asked.clear()
        self._sent.clear()
        rid, req, _ = self._checkpointing  # a checkpoint under way stays; what its request holds there does not
        self._checkpointing = (rid, req, 0)
        self._held = -1

    def _open_calls(self) -> None:
        """Record the opening of every call in progress not recorded yet. A call is recorded
        only once something inside it is: a lookup that frees nothing, or an `evict` that finds
        nothing to evict, costs one record or none."""
        self._unopened = 0
        for frame in self._calls:
            if not frame[1]:
                frame[1] = True
                if frame[0] == self._checkpoint_call:
                    self._open_checkpoint(False)
                else:
                    self._put(Rec.BEGIN, frame[0])

    def _failed(self, what: str) -> None:
        self.errors += 1
        self.ring.note_loss()  # the resolver cannot trust a half-recorded call
        self._forget()
        if self.errors == 1:
            log.exception("kvtrace: recording SGLang's %s failed; counting further failures silently", what)

    def _step(self, group: int | None) -> int:
        return slot_step(self.page, group == self._mamba)  # the shim's rule (`page_slots`)

    # -- install -----------------------------------------------------------------------------------
    def install(self) -> CaptureShim:
        c = self.cache
        watch_retractions()
        self._wrap(c, "match_prefix", None, self._lookup)
        self._wrap(c, "checkpoint", self._checkpoint, self._checkpointed, optional=True, opens=False)
        self._wrap(c, "insert", self._insert, self._inserted)
        for name in ("evict", "evict_for_alloc", "evict_host"):
            self._wrap(c, name, None, None, optional=name != "evict")
        # A reset frees nothing through actions, yet the resolver must see it: opened at once.
        self._wrap(c, "reset", lambda *a, **k: self._put(Rec.BEGIN, CALLS.index("reset")), None)
        original = c._apply_cache_action
        capture = self

        def _apply_cache_action(action: Any) -> Any:
            name = type(action).__name__
            if name in FREES:
                try:
                    capture._action(name, action)
                except Exception:  # noqa: BLE001 - the engine must never see kvtrace fail
                    capture._failed(name)
            result = original(action)
            if name in WINDOW_ACTIONS and capture._windowed:
                try:
                    capture._acted(name, action)
                except Exception:  # noqa: BLE001
                    capture._failed(name)
            return result

        self.hooks.replace(c, "_apply_cache_action", _apply_cache_action)
        if getattr(c, "session", None) is not None:  # streaming sessions, as the shim follows them
            self.hooks.wrap_after(c, "claim_kv_row", self._kept)
            self._wrap(c, "release_session", self._releasing, self._released, optional=True, opens=False)
        for component_type, component in (getattr(c, "components", None) or {}).items():
            self._wrap_host_free(component, component_type)
        if getattr(c, "cache_controller", None) is not None:
            self._install_hicache()
        elif hasattr(c, "init_hicache"):  # tiers added later: followed once they exist
            self.hooks.wrap_after(c, "init_hicache", lambda *args, **kwargs: self._install_hicache())
        return self

    def _install_hicache(self) -> None:
        """HiCache's host and storage tiers: their copies and acknowledgements, as
        `HiCacheHooks` reads them in-process."""
        c, hooks = self.cache, self.hooks
        cc = c.cache_controller
        hooks.wrap_after(cc, "write", self._backup)
        hooks.wrap_after(c, "_finish_write_through_ack", self._backed)
        hooks.wrap_after(cc, "load", self._restore)
        self._wrap(c, "loading_check", self._loading, self._restored, optional=True, opens=False)
        self._wrap(c, "check_hicache_events", None, None, optional=True)
        self._wrap(c, "init_load_back", None, None, optional=True)
        hooks.wrap_after(cc, "write_storage", self._store)
        self._wrap_storage_acks()
        hooks.wrap_after(cc, "attach_storage_backend", lambda *args, **kwargs: self._wrap_storage_acks())
        self.prefetches.install(hooks)
        hooks.wrap_after(getattr(c, "tree_core", None), "insert_host", self._fetched)
        hooks.wrap_after(getattr(c, "tree_core", None), "commit_hicache_transfers", self._staged)
        hooks.wrap_after(c, "clear_storage_backend", self._cleared)

    def _wrap_storage_acks(self) -> None:
        """The storage tier's acknowledgement queue, made anew when one is attached at run time."""
        queue = getattr(self.cache.cache_controller, "ack_backup_queue", None)
        if queue is not None and queue is not self._acks:
            self._acks = queue
            self.hooks.wrap_after(queue, "get", self._stored)

    def _wrap_host_free(self, component: Any, component_type: Any) -> None:
        """A component freeing host slots (`free_host_values`): recorded as the host free it is,
        which the shim reads the same way (`_wrap_host_free` there)."""
        original = getattr(component, "free_host_values", None)
        if original is None or component_name(component_type) not in self.group_names:
            return
        capture = self

        def free_host_values(*args: Any, **kwargs: Any) -> Any:
            try:
                capture._action("FreeComponentHostSlot", SimpleNamespace(component_type=component_type,
                                                                        host_indices=host_values(args, kwargs)))
            except Exception:  # noqa: BLE001
                capture._failed("free_host_values")
            return original(*args, **kwargs)

        self.hooks.replace(component, "free_host_values", free_host_values)

    def uninstall(self) -> None:
        """Unwrap the cache; nothing more is recorded (admissions included)."""
        self.stopped = True
        self.hooks.restore()

    def _wrap(self, obj: Any, name: str, begin: Callable[..., None] | None, end: Callable[..., None] | None,
              optional: bool = False, opens: bool = True) -> None:
        """`begin` runs before the call and, with `opens`, records its opening itself; otherwise
        the call is opened on the ring only once something inside it is recorded."""
        original = getattr(obj, name, None)
        if original is None:
            if not optional:
                log.warning("kvtrace: SGLang's %s has no %s; that hook is off", type(obj).__name__, name)
            return
        call = CALLS.index(name)
        capture = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            frame = [call, False]  # (call, its opening recorded)
            try:
                if begin is not None:
                    begin(*args, **kwargs)
                if begin is None or not opens:  # opened on the ring only if something inside is recorded
                    capture._calls.append(frame)
                    capture._unopened += 1
                else:  # its own record opens it
                    frame[1] = True
                    capture._calls.append(frame)
            except Exception:  # noqa: BLE001
                capture._failed(name)
            try:
                result = original(*args, **kwargs)
            except BaseException:
                try:
                    capture._close(frame, Rec.ABORT)
                except Exception:  # noqa: BLE001 - the engine's own exception goes on, untouched
                    capture._failed(name)
                raise
            try:
                capture._close(frame, None)
                if end is not None:
                    end(result, frame[1], *args, **kwargs)
                elif frame[1]:
                    capture._put(Rec.END, call)
            except Exception:  # noqa: BLE001
                capture._failed(name)
            return result

        self.hooks.replace(obj, name, wrapper)

    def _close(self, frame: list[Any], record: Rec | None) -> None:
        """Take a call off the stack (written `record`, ABORT, if it was opened on the ring)."""
        calls = self._calls
        if calls and calls[-1] is frame:
            calls.pop()
        else:  # never expected: a call left without its wrapper returning
            at = next((i for i, f in enumerate(calls) if f is frame), None)
            if at is not None:
                del calls[at:]
        if not frame[1]:
            self._unopened = sum(1 for f in calls if not f[1])
        if record is not None and frame[1]:
            self._put(record, frame[0])

    # -- what each call records ------------------------------------------------------------------
    def _lookup(self, result: Any, opened: bool, params: Any, *args: Any, **kwargs: Any) -> None:
        self._settle()  # an opening written now may mark the request seen: before `fresh` is read
        req, key = getattr(params, "req", None), params.key
        device, host = int(result.device_prefix_len), int(result.host_hit_length)
        full = int(getattr(result, "full_kv_hit_length", 0) or 0)
        rid = str(getattr(req, "rid", "")) if req is not None else ""
        repeat = bool(rid) and self._asked.get(rid) == (device, host)
        if repeat:  # the scheduler asks again each round: the resolver needs no tokens for that
            ids, out, counters = _NO_TOKENS, _NO_TOKENS, None
        else:
            if req is not None and getattr(req, "origin_input_ids", None) is not None:
                ids, out = tokens_blob(req.origin_input_ids), tokens_blob(getattr(req, "output_ids", None))
            else:
                ids, out = tokens_blob(key.token_ids), _NO_TOKENS
            counters = self._usage_due(rid)
        fresh = req is not None and not getattr(req, "_kvtrace_seen", False)
        retracted = int(getattr(req, "retraction_count", 0) or 0) if req is not None else 0
        fields = encode(Lookup(device, host, full, rid, _text(getattr(key, "extra_key", None)),
                               _text(getattr(key, "cache_salt", None)), counters, req is not None, repeat,
                               opened, fresh, retracted,
                               int(getattr(req, "_kvtrace_computed", 0) or 0) if retracted else 0))
        if not self._put(Rec.LOOKUP, 0, (fields, ids, out) if len(out) else (fields, ids)):
            if counters is not None:
                self._usage_due_ns = 0  # the sample did not get through: the next lookup takes it
        else:
            if req is not None:
                self._stand_in(rid, fresh, None if repeat else len(ids) + len(out))  # an empty blob is b""
            if rid and not repeat:
                self._asked[rid] = (device, host)
                self._asked.move_to_end(rid)
                while len(self._asked) > 65536:
                    self._asked.popitem(last=False)
            if fresh:
                _mark(req)
        self._check_resolver()

    def _usage_due(self, rid: str) -> tuple[int, int, int] | None:
        """The pool's counters as this lookup left them, once an interval has passed since the
        last ones sent and if the shim reports this request's lookup (it samples usage after a
        lookup it reports; a lookup without a request is named differently in each process, so
        it counts as reported): the resolver's shim samples usage at that lookup, where the
        in-process shim's clock would have it sample."""
        if not self._usage_ns:
            return None
        now = time.monotonic_ns()
        if now < self._usage_due_ns or (rid and not key_sampled(request_key(rid), self.sample_rate)):
            return None
        self._usage_due_ns = now + self._usage_ns
        return usage_counters(self.cache)

    def _stand_in(self, rid: str, fresh: bool, tokens: int | None) -> None:
        """Mirror the resolver's `_request` for a record it will read: a new (empty) stand-in for
        a new request object or an id it does not hold, else the held one made most recent;
        `tokens`: how many the record carried for it."""
        sent = self._sent
        if fresh or rid not in sent:
            sent.pop(rid, None)
            sent[rid] = 0
            while len(sent) > REQUESTS_KEPT:
                sent.popitem(last=False)
        else:
            sent.move_to_end(rid)
        if tokens is not None:
            sent[rid] = tokens

    def _checkpoint(self, req: Any, *args: Any, **kwargs: Any) -> None:
        """Nothing is recorded yet: the checkpoint is opened by its insert's record (or, if
        something else inside comes first, by a CHECKPOINT ahead of it), and one with nothing
        inside costs no record."""
        self._checkpointing = (str(getattr(req, "rid", "")), req, 0)

    def _checkpointed(self, result: Any, opened: bool, *args: Any, **kwargs: Any) -> None:
        self._checkpointing = ("", None, 0)  # the request object is not kept past its checkpoint
        if opened:
            self._put(Rec.END, self._checkpoint_call)

    def _open_checkpoint(self, by_insert: bool) -> bool:
        """Open the checkpoint under way on the ring: with a CHECKPOINT record, or (`by_insert`)
        inside its insert's record. Returns whether its request object is new to the resolver
        (what the INSERT then says), and sets how many of the request's tokens the resolver then
        holds."""
        rid, req, _ = self._checkpointing
        fresh = not getattr(req, "_kvtrace_seen", False)
        if not by_insert and not self._put(Rec.CHECKPOINT, 0, (encode(Checkpoint(rid, fresh)),)):
            return False
        self._stand_in(rid, fresh, None)  # the resolver's `_request`, when it opens the checkpoint
        self._checkpointing = (rid, req, self._sent[rid])
        if fresh:
            _mark(req)
        return fresh

    def _check_resolver(self) -> None:
        """At most once a second: if the resolver has exited, say so once and stop recording
        (the cache is unwrapped; nothing more is copied for nobody)."""
        if self.alive is None:
            return
        now = time.monotonic_ns()
        if now < self._check_due_ns:
            return
        self._check_due_ns = now + 1_000_000_000
        if not self.alive():
            log.error("kvtrace: the SGLang resolver process has exited; tracing of this cache stops")
            self.uninstall()

    def _insert(self, params: Any, *args: Any, **kwargs: Any) -> None:
        key, value = params.key, params.value
        if key is None or value is None:
            self._put(Rec.INSERT, 0)
            return
        pages = len(key) // self.page
        # The first slot of every page as SGLang holds it (the resolver turns them into ledger
        # indices): a strided view of the tensor, copied once, into the ring.
        slots = page_starts(value, self._step(-1))[:pages]
        mamba = getattr(params, "mamba_value", None)
        mamba_slots = page_starts(mamba, 1) if mamba is not None else None
        tokens = tokens_blob(key.token_ids)
        known, rid, fresh = 0, None, False
        calls = self._calls  # this insert's own frame is not on it yet
        if calls and calls[-1][0] == self._checkpoint_call:
            if not calls[-1][1]:  # the checkpoint is opened here, by this record
                calls[-1][1] = True
                self._unopened -= 1
                fresh = self._open_checkpoint(True)
                rid = self._checkpointing[0]
            # SGLang's checkpoint inserts the request's own tokens (its prompt, then output), which
            # its lookup sent: only what came after them travels. The in-process shim trusts the
            # same thing (it names these pages with the request's own chain).
            known = min(len(tokens), self._checkpointing[2])
            if known:
                tokens = _words(tokens)[known:]
        fields = encode(Insert(len(key), known, _text(getattr(key, "extra_key", None)),
                               _text(getattr(key, "cache_salt", None)), rid, fresh))
        self._put(Rec.INSERT, 0, (fields, tokens, slots) if mamba_slots is None else
                  (fields, tokens, slots, mamba_slots))

    def _inserted(self, result: Any, opened: bool, *args: Any, **kwargs: Any) -> None:
        mamba = MAMBA_EXISTED if getattr(result, "mamba_exist", False) else 0
        inserted = int(result.prefix_len) << 2 | mamba
        if self._calls and self._calls[-1][0] == self._checkpoint_call:
            self._held = inserted  # written with the next record, which may be the checkpoint's END
        else:
            self._put(Rec.INSERTED, inserted)

    def _action(self, name: str, action: Any) -> None:
        component = getattr(action, "component_type", None)
        known = self._frees.get((name, component))
        if known is None:
            group = self.group_names.index(component_name(component)) if component is not None else self._full
            # The shim translates a KV free's pages, and the window's own, into window slots.
            window = self._swa is not None and (name == "FreeDeviceKV" or
                                                 (name == "FreeComponentDeviceSlot" and group == self._swa))
            step = self._step(group)
            fields = encode(Action(name, self.group_names[group], step))
            known = self._frees[(name, component)] = (step, fields, window)
        step, fields, window = known
        values = action.host_indices if name == "FreeComponentHostSlot" else action.indices
        starts = page_starts(values, step)
        mapped = self._window_of(starts) if window else None
        self._put(Rec.ACTION, 0, (fields, starts) if mapped is None else (fields, starts, mapped))

    def _acted(self, name: str, action: Any) -> None:
        """A window action that ran: the full-attention pages it names and their window slots
        as the allocator maps them now, which is when the shim reads them."""
        step = self._step(-1)
        starts = page_starts(getattr(action, WINDOW_ACTIONS[name]), step)
        mapped = self._window_of(starts)
        fields = encode(Acted(name, step))
        self._put(Rec.ACTED, 0, (fields, starts) if mapped is None else (fields, starts, mapped))

    def _window_of(self, starts: np.ndarray) -> np.ndarray | None:
        """The window slots the allocator's live table maps full-attention page starts to (what
        the shim's `_swa_slots` reads), or None where there is no table (the shim then keeps the
        full numbering). Negative starts (pads) map to nothing the resolver reads."""
        allocator = getattr(self.cache, "token_to_kv_pool_allocator", None)
        mapping = getattr(allocator, "full_to_swa_index_mapping", None)
        if mapping is None:
            return None
        return gather(mapping, starts) if len(starts) else starts

    # -- HiCache's host tier --------------------------------------------------------------------
    def _pools(self, extra_pools: Any, sides: tuple[str, ...], load: bool = False) -> tuple[list[str], list[Any]]:
        """The component transfers that travel with a copy (a window's or Mamba's state), as
        `HiCacheHooks._extra` takes them (`load`: a load-back's): their names, and the page starts
        of each one's `sides`, in that order."""
        names, blobs = [], []
        for transfer in extra_pools or ():
            name = pool_name(transfer, load)
            values = [getattr(transfer, side, None) for side in sides]
            if name in self.group_names and all(v is not None for v in values):
                step = self._step(self.group_names.index(name))
                names.append(name)
                blobs += [page_starts(v, step) for v in values]
        return names, blobs

    def _backup(self, host: Any, device_indices: Any, *args: Any, node_id: int = -1, extra_pools: Any = None,
                **kwargs: Any) -> None:
        self._copied(Rec.BACKUP, device_indices, host, node_id, extra_pools, ("device_indices", "host_indices"))

    def _restore(self, device: Any, host_indices: Any, *args: Any, node_id: int = -1, extra_pools: Any = None,
                 **kwargs: Any) -> None:
        self._copied(Rec.RESTORE, host_indices, device, node_id, extra_pools, ("host_indices", "device_indices"))

    def _copied(self, kind: Rec, source: Any, target: Any, node_id: int, extra_pools: Any,
                sides: tuple[str, str]) -> None:
        """A copy between tiers the controller queued: its source's and target's page starts (the
        target is what the call returned; None: no room, no copy) and its extra pools', alike."""
        if target is None:
            return
        now, step = time.monotonic_ns(), self._step(-1)
        load = kind == Rec.RESTORE
        names, extra = self._pools(extra_pools, sides, load=load)
        fields = (Restore if load else Backup)(int(node_id), now, names)
        self._put(kind, 0, (encode(fields), page_starts(source, step), page_starts(target, step), *extra))

    def _backed(self, _result: Any, ack_id: int, *args: Any, **kwargs: Any) -> None:
        self._put(Rec.BACKED, 0, (encode(Backed(int(ack_id), time.monotonic_ns())),))

    def _loading(self, *args: Any, **kwargs: Any) -> None:
        self._loads_before = [a for a in (getattr(self.cache, "ongoing_load_back", None) or {}) if type(a) is int]

    def _restored(self, _result: Any, opened: bool, *args: Any, **kwargs: Any) -> None:
        """With no load in progress when it began (most steps), the call retires nothing: the
        in-process hook reads nothing then, and the call costs a plain END if it was opened."""
        if not self._loads_before:
            if opened:
                self._put(Rec.END, self._loading_call)
            return
        still = getattr(self.cache, "ongoing_load_back", None) or {}
        fields = Restored(self._loads_before, [a for a in still if type(a) is int], len(still),
                          time.monotonic_ns(), bool(opened))
        self._put(Rec.RESTORED, 0, (encode(fields),))

    def _store(self, op_id: Any, host_indices: Any, token_ids: Any, hash_value: Any = None, *args: Any,
               extra_pools: Any = None, **kwargs: Any) -> None:
        if op_id is None or not hash_value:
            return
        names, states = self._pools(extra_pools, ("host_indices",))
        self._put(Rec.STORE, 0, (encode(Store(int(op_id), time.monotonic_ns(), list(hash_value), names)),
                                 page_starts(host_indices, self._step(-1)), *states))

    def _stored(self, op: Any, *args: Any, **kwargs: Any) -> None:
        done = getattr(op, "completed_tokens", None)
        self._put(Rec.STORED, 0, (encode(Stored(int(getattr(op, "id", -1)), None if done is None else int(done),
                                                time.monotonic_ns())),))

    def _fetched(self, result: Any, node_id: Any, key: Any, host_value: Any, hash_value: Any, *args: Any,
                 **kwargs: Any) -> None:
        if result is None or getattr(result, "host_insert_dropped", False) or not hash_value:
            return
        root, parent = hung_under(self.cache, node_id)
        rid, took_ns, held = self.prefetches.landing(time.monotonic_ns())
        fields = Fetched(int(result.prefix_len), list(hash_value), bool(root), parent,
                         _text(getattr(key, "extra_key", None)), _text(getattr(key, "cache_salt", None)), rid,
                         int(took_ns), bool(held))
        self._put(Rec.FETCHED, 0, (encode(fields), tokens_blob(key.token_ids),
                                   page_starts(host_value, self._step(-1))))

    def _staged(self, _result: Any, node_id: Any, phase: Any, comp_xfers: Any, *args: Any,
                cache_actions: Any = (), **kwargs: Any) -> None:
        """What `HiCacheHooks._after_commit_transfers` reads: the states a landed prefetch staged
        on host, and the host slots the commit frees again."""
        if getattr(phase, "name", phase) != "PREFETCH":
            return
        states, frees = prefetch_states(comp_xfers, cache_actions)
        staged, released, blobs = [], [], []
        for ct, host in states:
            name = component_name(ct)
            if name in self.group_names and self.group_names.index(name) != self._full:
                staged.append(name)
                blobs.append(page_starts(host, self._step(self.group_names.index(name))))
        for ct, host in frees:
            name = component_name(ct)
            if name in staged:  # what the hook reads of them
                released.append(name)
                blobs.append(page_starts(host, self._step(self.group_names.index(name))))
        if staged:
            self._put(Rec.STAGED, 0, (encode(Staged(staged, released)), *blobs))

    # -- streaming sessions -------------------------------------------------------------------
    def _kept(self, kept: Any, req: Any, *args: Any, **kwargs: Any) -> None:
        if kept is not True:
            return
        ids, out = req.origin_input_ids, getattr(req, "output_ids", None)
        tokens = _words(tokens_blob(ids)) if not out else np.concatenate([_words(tokens_blob(ids)),
                                                                          _words(tokens_blob(out))])
        kept = kept_row(self.cache, req, len(tokens), self.page)
        if kept is None:
            return
        row_id, row = kept
        self._session_row_ids.add(row_id)
        fields = encode(Kept(_text(getattr(req, "cache_salt", None)), _text(getattr(req, "extra_key", None))))
        self._put(Rec.KEPT, 0, (fields, tokens[: len(row)], page_starts(row, self._step(-1))))
        if not self._session_rows:  # from now on a row's frees may drop pages a session kept
            self._session_rows = True
            self._wrap_row_frees()

    def _releasing(self, session_id: Any = None, *args: Any, **kwargs: Any) -> None:
        slot = self.cache.session.slots.get(session_id)
        self._closing = None if slot is None else slot.kv.req_pool_idx

    def _released(self, _result: Any, opened: bool, *args: Any, **kwargs: Any) -> None:
        self._session_row_ids.discard(self._closing)
        if opened:
            self._put(Rec.END, CALLS.index("release_session"))

    def _wrap_row_frees(self) -> None:
        """`free_kv_row(kv, ranges)`: recorded as the full-attention free the shim reads it as
        (`RadixCacheShim._before_free_row`), before it runs."""
        self.hooks.wrap_before(self.cache, "free_kv_row", self._row_freeing)

    def _row_freeing(self, kv: Any, ranges: Any, *args: Any, **kwargs: Any) -> None:
        if kv.req_pool_idx in self._session_row_ids:  # else a request's own row: nothing to name
            pages = row_pages(self.cache.req_to_token_pool.req_to_token[kv.req_pool_idx], ranges, self.page)
            if len(pages):
                self._action("FreeDeviceKVFullOnly", SimpleNamespace(component_type=None, indices=pages))

    def _cleared(self, cleared: Any, *args: Any, **kwargs: Any) -> None:
        if cleared:
            self._put(Rec.CLEARED)

    def record_admission(self, request_id: str, prompt_tokens: int, device: int, host: int = 0, storage: int = 0,
                         tenant: str | None = None) -> None:
        if self.stopped:  # its lookup was not recorded either
            return
        try:
            self._asked.pop(str(request_id), None)  # as the shim forgets it: its next lookup is reported
            self._put(Rec.ADMIT, 0, (encode(Admit(int(prompt_tokens), int(device), int(host), int(storage),
                                                  str(request_id), _text(tenant))),))
        except Exception:  # noqa: BLE001
            self._failed("record_admission")


class ProcessShim:
    """The engine side of the out-of-process mode: the capture wrappers, the ring and the
    resolver process. `flush` waits until the resolver's sink has everything recorded so far.

    What the in-process shim's attach reads off the engine (its release, the cache's recipe, the
    context length it is given) is read here and sent in the spec: the resolver attaches with it,
    before any record, so each engine attaches once in either mode, with the same content."""

    def __init__(self, cache: Any, identity: Identity = Identity(), sample_rate: float = 1.0,
                 sink: str = "", ring_bytes: int = 64 << 20, usage_interval_s: float = 1.0,
                 engine_version: str | None = None, max_model_len: int = 0) -> None:
        why = unsupported(cache)
        if why is not None:
            raise ValueError(f"kvtrace's out-of-process SGLang mode does not cover {why}; use RadixCacheShim")
        # The sizes and the release are read here, from the live pools, with the shim's own rules.
        reader = RadixCacheShim(cache, _NullEmitter(), identity, engine_version=engine_version)
        page_bytes, engine_version = reader.page_bytes, reader.engine_version
        try:
            recipe = recipe_from_cache(cache)
        except Exception:  # noqa: BLE001 - never stop the engine; it runs traced, without an attach
            log.exception("kvtrace: no recipe for this SGLang cache; the resolver will not attach")
            recipe = None
        self.ring = Ring.create(ring_bytes, loss_kind=Rec.LOST)
        self.capture = CaptureShim(cache, self.ring, usage_interval_s, sample_rate)
        self.capture.alive = self.alive
        self.spec = ResolverSpec(ring=self.ring.name, page_size=int(cache.page_size),
                                 components=tuple(self.capture.group_names), page_bytes=tuple(page_bytes),
                                 identity=identity, sample_rate=sample_rate, engine_version=engine_version,
                                 max_model_len=int(max_model_len), recipe=recipe, usage_interval_s=usage_interval_s,
                                 engine_pid=os.getpid(), sink=sink,
                                 sys_path=tuple(p for p in sys.path if p) if sink else ())
        self._flushes = 0
        self._closed = False
        self.process: Any = None

    def start(self) -> ProcessShim:
        """Start the resolver (a fresh interpreter: nothing of the engine's is imported there)
        and wrap the cache."""
        try:
            self.process = subprocess.Popen([sys.executable, "-m", "kvtrace.instrumentation.sglang.resolver",
                                             msgspec.json.encode(self.spec).decode()])
            self.capture.install()
        except BaseException:
            self.close()
            raise
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def record_admission(self, *args: Any, **kwargs: Any) -> None:
        self.capture.record_admission(*args, **kwargs)

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait (off the hot path) until the resolver has handled and exported every record."""
        self._flushes += 1
        deadline = time.monotonic() + timeout_s
        while not self.ring.offer(Rec.FLUSH, self._flushes):  # a loss not reported yet goes first
            if time.monotonic() > deadline or not self.alive():
                return False
            time.sleep(0.001)
        while self.ring.acknowledged() < self._flushes:
            if time.monotonic() > deadline or not self.alive():
                return False
            time.sleep(0.0005)
        return True

    def stats(self) -> CaptureStats:
        r = self.ring
        return CaptureStats(records=r.written, dropped=r.dropped, errors=self.capture.errors,
                            resolved=r.consumer_counter(0), events=r.consumer_counter(1),
                            resolver_errors=r.consumer_counter(2), lost_resets=r.consumer_counter(3),
                            skipped=r.consumer_counter(4), prefetches_started=self.capture.prefetches.started,
                            prefetches_revoked=self.capture.prefetches.revoked, unnamed_pages=r.consumer_counter(5))

    def close(self, timeout_s: float = 30.0) -> None:
        """Unwrap the cache, let the resolver finish what is on the ring, and free the ring.
        Safe to call again (the plugin also registers it to run at exit)."""
        if self._closed:
            return
        self._closed = True
        self.capture.uninstall()
        if self.process is not None:
            deadline = time.monotonic() + timeout_s
            while not self.ring.offer(Rec.STOP) and time.monotonic() < deadline and self.alive():
                time.sleep(0.001)
            try:
                self.process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.ring.close()


class _NullEmitter:
    """For reading the pool sizes only: emits nothing."""

    def emit(self, event: Any) -> None:
        pass

    def sampled(self, key: int, rate: float) -> bool:
        return False
