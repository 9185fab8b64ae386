"""The resolver process of the out-of-process SGLang mode (see `capture`): it reads the ring and
replays each recorded call through a `RadixCacheShim` of its own, through the same steps a
wrapped call takes in-process (`begin_call`, `end_call`, `before_action`), so both modes emit
the same events. The shim here sees stand-ins that carry just what it reads: a request's id and
tokens, a key's tokens and namespace, slot indices, hit lengths. Before the first record it
attaches, as the in-process shim does when installed, with the recipe and context length the
engine side put in the spec: so each engine attaches once, in either mode.

Records are those of `records`: each one with fields is decoded, typed, and replayed by the
method for its kind. Slots travel as SGLang held them, the first slot of each page (one per slot
for state pools); this side turns them into ledger indices (`ledger_of_starts`) and hands them
to the shim as `LedgerSlots`, which its slot reading takes as they are.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import time
from array import array
from collections import OrderedDict
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np

from kvtrace.instrumentation.ring import Ring, RingCorrupt
from kvtrace.instrumentation.sglang.hicache import HiCacheHooks
from kvtrace.instrumentation.sglang.keys import new_chain
from kvtrace.instrumentation.sglang.ledger import LedgerSlots, ledger_of_starts, scatter, slot_step
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
    Fields,
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
    decode,
)
from kvtrace.instrumentation.sglang.shim import RadixCacheShim
from kvtrace.schema.kinds import Reason

log = logging.getLogger("kvtrace.sglang")


class _Key:
    """A RadixKey stand-in: tokens, namespace and a length."""

    __slots__ = ("token_ids", "extra_key", "cache_salt", "length")

    def __init__(self, token_ids: array, extra_key: str | None, cache_salt: str | None, length: int) -> None:
        self.token_ids, self.extra_key, self.cache_salt, self.length = token_ids, extra_key, cache_salt, length

    def __len__(self) -> int:
        return self.length


_NEVER = 1 << 62  # a usage-sample due time that never comes


def _slots(raw: Any, step: int) -> LedgerSlots:
    """Recorded page starts (as SGLang held them) as the ledger slots the shim reads."""
    return LedgerSlots(ledger_of_starts(np.frombuffer(raw, dtype=np.int64).copy(), step), step)


def _tokens(raw: Any) -> array:
    out = array("q")
    out.frombytes(raw)
    return out




class _WindowTable:
    """The allocator's full-to-window slot table as the shim reads it (`_swa_slots`: a CPU
    tensor's numpy view), holding what records carried: every entry the shim reads is written
    by the record it replays, just before."""

    is_cpu = True

    def __init__(self) -> None:
        self.table = np.zeros(0, dtype=np.int64)

    def numpy(self) -> np.ndarray:
        return self.table

    def write(self, starts: np.ndarray, mapped: np.ndarray) -> None:
        keep = starts >= 0  # pads name no slot
        if keep.any():
            self.table = scatter(self.table, starts[keep], mapped[keep])


class _Cache:
    """The cache as the shim sees it here: its page size and components, the device pool's
    counters as the last lookup recorded them (for the shim's usage samples), and the window
    slot table as the last record that read it found it."""

    def __init__(self, page_size: int, components: list[str]) -> None:
        self.page_size, self.tree_components = page_size, components
        self.counters: tuple[int, int, int] = (0, 0, 0)  # tokens locked, evictable, free
        self.window = _WindowTable()
        self.ongoing_load_back: set[Any] = set()  # HiCache's loads in progress, as the last record saw them
        self.token_to_kv_pool_allocator = SimpleNamespace(available_size=lambda: self.counters[2],
                                                          full_to_swa_index_mapping=None)

    def map_window(self, blobs: list[Any]) -> None:
        """Set the window table from a record's page starts and window slots (its second and
        third blobs); a record without them saw no table, and the shim then reads none."""
        allocator = self.token_to_kv_pool_allocator
        if len(blobs) < 3:
            allocator.full_to_swa_index_mapping = None
            return
        self.window.write(np.frombuffer(blobs[1], dtype=np.int64), np.frombuffer(blobs[2], dtype=np.int64))
        allocator.full_to_swa_index_mapping = self.window

    def full_protected_size(self) -> int:
        return self.counters[0]

    def full_evictable_size(self) -> int:
        return self.counters[1]


class Replayer:
    """Turns records back into the shim's calls."""

    def __init__(self, spec: ResolverSpec, emitter: Any) -> None:
        self.cache = _Cache(spec.page_size, list(spec.components))
        self.shim = RadixCacheShim(self.cache, emitter, spec.identity, sample_rate=spec.sample_rate,
                                   usage_interval_s=spec.usage_interval_s, engine_version=spec.engine_version,
                                   max_model_len=spec.max_model_len)
        self.shim.page_bytes = list(spec.page_bytes)
        self.shim.usage_due_ns = _NEVER  # usage is sampled when the capture's clock says so
        self.page = spec.page_size
        self.frames: list[tuple[str, bool, Any, Any]] = []  # open calls: (name, top, token, args)
        self.requests: OrderedDict[str, SimpleNamespace] = OrderedDict()  # request stand-ins by id
        self.errors = 0
        self.lost = 0
        self.handled = 0
        self.skipped = 0  # repeated asks of a request this side no longer knows
        self.now = 0  # the capture's clock at the HiCache record being replayed
        self._replay: dict[type[Fields], Any] = {  # records with fields, by their type
            Lookup: self._lookup, Insert: self._insert, Checkpoint: self._checkpoint, Action: self._action,
            Acted: self._acted, Backup: self._copy, Restore: self._copy, Backed: self._backed,
            Restored: self._restored, Store: self._store, Stored: self._stored, Fetched: self._fetched,
            Staged: self._staged, Kept: self._kept, Admit: self._admit}
        if spec.recipe is not None:  # the engine says what it is before anything it recorded
            self.shim.emit_attach(spec.recipe)

    def _request(self, rid: str, fresh: bool = False) -> SimpleNamespace:
        """The stand-in of request `rid` (`fresh`: the engine handed a new object under that id,
        which in-process starts a new page chain)."""
        req = None if fresh else self.requests.get(rid)
        if req is None:  # the capture mirrors this (`CaptureShim._stand_in`): keep the two alike
            self.requests.pop(rid, None)
            req = self.requests[rid] = SimpleNamespace(rid=rid, origin_input_ids=array("q"), output_ids=array("q"))
            while len(self.requests) > REQUESTS_KEPT:
                self.requests.popitem(last=False)
        else:
            self.requests.move_to_end(rid)
        return req

    def _open(self, call: str, before: Any = None, args: tuple[Any, ...] = ()) -> None:
        top, token = self.shim.begin_call(call, before, args, {})
        self.frames.append((call, top, token, args))

    def _close(self, call: str, after: Any = None, result: Any = None, args: tuple[Any, ...] | None = None) -> None:
        """End the innermost open call; `args`: what `after` reads, when the opening had none."""
        if not self.frames or self.frames[-1][0] != call:
            return  # its opening was lost with dropped records
        _, top, token, opened = self.frames.pop()
        self.shim.end_call(call, top, after, result, token, opened if args is None else args, {})

    def handle(self, kind: int, value: int, blobs: list[memoryview]) -> None:
        """Replay one record: a bare one by its kind and value, one with fields by their type."""
        self.handled += 1
        if blobs:
            fields = decode(blobs[0])
            self._replay[type(fields)](fields, blobs)
        elif kind == Rec.BEGIN:
            call = CALLS[value]
            self._open(call, self.shim.before_release_session if call == "release_session" else None)
        elif kind == Rec.END:
            self._end(CALLS[value])
        elif kind == Rec.ABORT:
            if self.frames and self.frames[-1][0] == CALLS[value]:
                _, top, _, _ = self.frames.pop()
                self.shim.abort_call(top)
        elif kind == Rec.INSERT:  # an insert without a key or value
            params = SimpleNamespace(key=None, value=None, mamba_value=None)
            self._open("insert", self.shim.before_insert, (params,))
        elif kind == Rec.INSERTED:
            self._close("insert", self.shim.after_insert,
                        SimpleNamespace(prefix_len=value >> 2, mamba_exist=bool(value & MAMBA_EXISTED)))
            if value & CHECKPOINT_RETURNED:
                self._end("checkpoint")
        elif kind == Rec.CLEARED:
            self._hicache().after_clear_storage(True)
        elif kind == Rec.LOST:
            self.start_afresh()

    def _lookup(self, f: Lookup, blobs: list[memoryview]) -> None:
        shim = self.shim
        if not f.opened:  # nothing happened inside the call: its opening was not recorded
            self._open("match_prefix")
        req = None
        if f.request:
            req = self._request(f.request_id, fresh=f.fresh)
            req.retraction_count, req._kvtrace_computed = f.preemptions, f.computed
            if not f.repeat:
                req.origin_input_ids = _tokens(blobs[1])
                req.output_ids = _tokens(blobs[2]) if len(blobs) > 2 else array("q")
            elif shim.reported_lookup(f.request_id) != (f.device, f.host):
                # A repeat the shim would report (it forgot the request), without tokens to
                # report it with: ended without a lookup, and counted.
                self.skipped += 1
                self._close("match_prefix")
                return
            key = _Key(array("q"), f.extra_key, f.cache_salt, 0)
        else:
            tokens = _tokens(blobs[1])
            key = _Key(tokens, f.extra_key, f.cache_salt, len(tokens))
        if f.counters is not None:  # the capture's clock says a usage sample is due: at this lookup
            self.cache.counters = f.counters
            shim.usage_due_ns = 0
        result = SimpleNamespace(device_prefix_len=f.device, host_hit_length=f.host,
                                 full_kv_hit_length=f.full)
        self._close("match_prefix", shim.after_lookup, result, (SimpleNamespace(key=key, req=req),))
        if shim.usage_due_ns:  # sampled (or never due): the next one waits for the capture's word
            shim.usage_due_ns = _NEVER

    def _checkpoint(self, f: Checkpoint, blobs: list[memoryview]) -> None:
        self._open_checkpoint(f.request_id, f.fresh)

    def _insert(self, f: Insert, blobs: list[memoryview]) -> None:
        if f.checkpoint is not None:  # the checkpoint around it opens here
            self._open_checkpoint(f.checkpoint, f.fresh)
        tokens = _tokens(blobs[1])
        if f.known:  # they begin with the checkpointed request's tokens, as last sent
            try:
                tokens = self._request_tokens(f.known) + tokens
            except LookupError:  # never expected: the capture mirrors the stand-ins
                self.errors += 1
                log.warning("kvtrace: the SGLang resolver cannot name an insert's pages; "
                            "reporting the device tier invalidated")
                self.shim.drop_ledger(Reason.EXPLICIT)
                return
        key = _Key(tokens, f.extra_key, f.cache_salt, f.length)
        slots = _slots(blobs[2], self._step(None))
        mamba = _slots(blobs[3], 1) if len(blobs) > 3 else None
        params = SimpleNamespace(key=key, value=slots, mamba_value=mamba)
        self._open("insert", self.shim.before_insert, (params,))

    def _action(self, f: Action, blobs: list[memoryview]) -> None:
        slots = _slots(blobs[1], f.step)
        self.cache.map_window(blobs)
        action = SimpleNamespace(component_type=f.component, indices=slots, host_indices=slots)
        self.shim.before_action(f.name, action)

    def _acted(self, f: Acted, blobs: list[memoryview]) -> None:
        slots = _slots(blobs[1], f.step)
        self.cache.map_window(blobs)
        self.shim.after_action(f.name, SimpleNamespace(source_value=slots, kept_full=slots))

    def _copy(self, f: Backup | Restore, blobs: list[memoryview]) -> None:
        """A copy's record carries its source's slots, then its destination's (what the call
        returned, which the hook takes first), then each extra pool's, in the same order."""
        self.now = f.time_ns
        backup, step, hooks = type(f) is Backup, self._step(None), self._hicache()
        sides = ("device_indices", "host_indices") if backup else ("host_indices", "device_indices")
        (hooks.after_write if backup else hooks.after_load)(
            _slots(blobs[2], step), _slots(blobs[1], step), node_id=f.node_id,
            extra_pools=self._pools(f.pools, blobs[3:], sides, f.node_id))

    def _backed(self, f: Backed, blobs: list[memoryview]) -> None:
        self.now = f.time_ns
        self._hicache().after_write_ack(None, f.ack_id)

    def _restored(self, f: Restored, blobs: list[memoryview]) -> None:
        if not f.opened:  # nothing happened inside the call: its opening was not recorded
            self._open("loading_check")
        self.now = f.time_ns
        # What `after_loading_check` reads: the int ids still loading, and whether any is.
        self.cache.ongoing_load_back = set(f.still) | ({None} if f.loading > len(f.still) else set())
        if self.frames and self.frames[-1][0] == "loading_check":
            _, top, _, _ = self.frames.pop()
            self.shim.end_call("loading_check", top, self._hicache().after_loading_check, None, set(f.before),
                               (), {})

    def _store(self, f: Store, blobs: list[memoryview]) -> None:
        self.now = f.time_ns
        self._hicache().after_write_storage(f.op_id, _slots(blobs[1], self._step(None)), None, f.names,
                                            extra_pools=self._pools(f.states, blobs[2:], ("host_indices",)))

    def _stored(self, f: Stored, blobs: list[memoryview]) -> None:
        self.now = f.time_ns
        done = f.completed_tokens
        op = (SimpleNamespace(id=f.op_id) if done is None else
              SimpleNamespace(id=f.op_id, completed_tokens=done))
        self._hicache().after_storage_ack(op)

    def _fetched(self, f: Fetched, blobs: list[memoryview]) -> None:
        tokens = _tokens(blobs[1])
        key = _Key(tokens, f.extra_key, f.cache_salt, len(tokens))
        self._hicache().landed(f.prefix_len, f.names, key, _slots(blobs[2], self._step(None)), f.root, f.parent,
                               f.request_id, f.took_ns, f.held)

    def _staged(self, f: Staged, blobs: list[memoryview]) -> None:
        names = f.staged + f.released
        groups = [self.shim.group_named(name) for name in names]
        moved = [(g, self.shim.page_slots(g, _slots(raw, self._step(name))))
                 for g, name, raw in zip(groups, names, blobs[1:], strict=True)]
        self._hicache().prefetched(moved[: len(f.staged)], moved[len(f.staged):])

    def _kept(self, f: Kept, blobs: list[memoryview]) -> None:
        shim = self.shim
        top, _ = shim.begin_call("claim_kv_row", None, (), {})
        try:
            shim.session_kept(new_chain(f.extra_key, f.cache_salt), _tokens(blobs[1]),
                              _slots(blobs[2], self._step(None)).slots, f.cache_salt, f.extra_key)
        finally:
            shim.end_call("claim_kv_row", top, None, None, None, (), {})

    def _admit(self, f: Admit, blobs: list[memoryview]) -> None:
        self.shim.record_admission(f.request_id, f.prompt_tokens, device=f.device, host=f.host,
                                   storage=f.storage, tenant=f.tenant)

    def _end(self, call: str) -> None:
        shim = self.shim
        self._close(call, shim.after_reset if call == "reset" else
                    shim.after_checkpoint if call == "checkpoint" else None)
        if call == "reset" and shim.hicache is not None:
            shim.hicache.after_reset()

    def _hicache(self) -> HiCacheHooks:
        """The shim's HiCache hooks, made at the first record of HiCache's host tier (nothing is
        wrapped here: the records are the calls), on the capture's clock."""
        hicache = self.shim.hicache
        if hicache is None:
            hicache = self.shim.hicache = HiCacheHooks(self.shim)
            hicache.clock = lambda: self.now
        return hicache

    def _step(self, component: str | None) -> int:
        """Slots per ledger entry for a component's pool, by the shim's rule (`slot_step`)."""
        return slot_step(self.page, component == "MAMBA")

    def _pools(self, names: list[str], blobs: list[Any], sides: tuple[str, ...],
               node_id: int = -1) -> list[SimpleNamespace]:
        """The extra pools of a HiCache copy or storage write, as `HiCacheHooks._extra` reads
        them: each one's `sides`, from consecutive blobs. The capture sent only those it
        follows, so each is taken as restoring the copy's node."""
        n = len(sides)
        return [SimpleNamespace(name=name, nodes_to_load=(node_id,),
                                **{side: _slots(blobs[n * i + j], self._step(name)) for j, side in enumerate(sides)})
                for i, name in enumerate(names)]

    def _open_checkpoint(self, rid: str, fresh: bool) -> None:
        self._open("checkpoint", self.shim.before_checkpoint, (self._request(rid, fresh),))

    def _request_tokens(self, count: int) -> array:
        """The first `count` tokens of the request whose checkpoint is open, as its last lookup
        sent them. The capture mirrors this side's stand-ins, so it never names more than the
        stand-in holds; if it did, LookupError (the caller reports the ledger invalidated)."""
        req = self.frames[-1][3][0] if self.frames and self.frames[-1][0] == "checkpoint" else None
        ids, out = (req.origin_input_ids, req.output_ids) if req is not None else (array("q"), array("q"))
        if len(ids) + len(out) < count:
            raise LookupError(f"an insert names {count} tokens of a request this side holds "
                              f"{len(ids) + len(out)} of")
        return ids[:count] if count <= len(ids) else ids + out[: count - len(ids)]

    def start_afresh(self) -> None:
        """Records were dropped: what the ledger says can no longer be trusted. The device
        tier is reported invalidated (the analysis then counts nothing there as held) and the
        ledger starts empty; commits fill it again."""
        self.lost += 1
        self.frames.clear()
        self.requests.clear()  # chains are rebuilt from the tokens the next asks carry
        self.shim.start_afresh()


def _emitter(spec: ResolverSpec) -> Any:
    """The sink the spec names ("module:callable"), batched like the in-process emitter; or,
    with none named, the sink kvtrace's settings (environment) configure."""
    from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter

    if spec.sink:
        module, _, name = spec.sink.partition(":")
        sink, batch = getattr(importlib.import_module(module), name)(), BatchConfig(max_queue_size=1 << 20)
    else:  # the engine side decided tracing is on; here only the sink settings matter
        from kvtrace.instrumentation.config import EmitterSettings, build_sink

        settings = EmitterSettings.from_env()
        # Journaled as an engine process's emitter is: killed with the engine (a process-tree
        # kill), it leaves its events to its journal's shipper.
        return BatchEmitter(build_sink(settings), settings.batch, engine="sglang", instance=spec.identity.instance,
                            register_atexit=False, journal=settings.journal_config())
    return BatchEmitter(sink, batch, engine="sglang", instance=spec.identity.instance, register_atexit=False)


def main(spec: ResolverSpec) -> None:
    """The resolver process: read, replay, acknowledge flushes; exits on STOP or when the
    engine process is gone (this process is then re-parented)."""
    parent = spec.engine_pid or os.getppid()
    ring = Ring.attach(spec.ring, own_tracker=True)
    emitter = _emitter(spec)
    replayer = Replayer(spec, emitter)
    idle = 0
    try:
        while True:
            try:
                got = ring.poll()
            except RingCorrupt:
                # Nothing after this point can be followed: stop, and the engine's side, seeing
                # this process gone, stops recording and says so.
                log.exception("kvtrace: the SGLang resolver cannot read its ring any further; it stops")
                break
            if got is None:
                idle += 1
                if idle % 500 == 0 and not _running(parent):
                    break
                time.sleep(0.0002 if idle < 50 else 0.002)
                continue
            idle = 0
            kind, value, blobs, end = got
            try:
                replayer.handle(kind, value, blobs)
            except Exception:  # noqa: BLE001 - one bad record must not end the resolver
                replayer.errors += 1
                if replayer.errors == 1:
                    log.exception("kvtrace: the SGLang resolver could not replay a record")
            finally:
                for view in blobs:
                    view.release()
                ring.release(end)
            if kind == Rec.FLUSH:
                emitter.force_flush(timeout_millis=60_000)
                _publish(ring, replayer, emitter)
                ring.acknowledge(value)
            elif kind == Rec.STOP:
                break
    finally:
        emitter.shutdown()
        _publish(ring, replayer, emitter)
        ring.close()


def _running(pid: int) -> bool:
    """Whether the engine process still runs (this process is re-parented when it dies)."""
    if os.getppid() != pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _publish(ring: Ring, replayer: Replayer, emitter: Any) -> None:
    stats = emitter.stats()
    hicache = replayer.shim.hicache
    for i, n in enumerate((replayer.handled, stats.emitted, replayer.errors + replayer.shim.errors, replayer.lost,
                           replayer.skipped, hicache.unnamed_pages if hicache is not None else 0)):
        ring.set_counter(i, n)


if __name__ == "__main__":
    _spec = msgspec.json.decode(sys.argv[1], type=ResolverSpec)
    sys.path[:0] = [p for p in _spec.sys_path if p not in sys.path]
    main(_spec)
