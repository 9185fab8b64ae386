"""The out-of-process SGLang mode's resolver, fed records by hand: a checkpoint's insert names
its pages with the tokens its request's lookup sent, and an insert that names tokens the
resolver no longer holds makes it start afresh (reported), never name pages wrongly. The mode
end to end, against the in-process shim on SGLang's real cache, is in tests/engines/sglang."""

from __future__ import annotations

import numpy as np
import pytest

from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.identity import Identity
from kvtrace.instrumentation.page_keys import page_keys
from kvtrace.instrumentation.sglang.records import (
    CALLS,
    CHECKPOINT_RETURNED,
    Acted,
    Action,
    Backed,
    Backup,
    Checkpoint,
    Fetched,
    Insert,
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
from kvtrace.instrumentation.sglang.resolver import Replayer
from kvtrace.instrumentation.sinks.memory import MemorySink
from kvtrace.schema import EventKind
from kvtrace.schema.kinds import ComponentKind, Reason, Tier
from kvtrace.schema.recipes import GroupSpec, Recipe, recipe_from_json

PAGE = 16


def _replayer() -> tuple[Replayer, BatchEmitter, MemorySink]:
    sink = MemorySink()
    emitter = BatchEmitter(sink, BatchConfig(), register_atexit=False)
    spec = ResolverSpec(ring="unused", page_size=PAGE, components=("FULL",), page_bytes=(1,),
                        identity=Identity(instance="r"), usage_interval_s=0)
    return Replayer(spec, emitter), emitter, sink


def _lookup(rid: str, tokens: np.ndarray) -> tuple[int, int, list]:
    # a request, nothing recorded inside the call, an object not seen before
    fields = Lookup(0, 0, 0, rid, None, None, None, request=True, repeat=False, opened=False, fresh=True)
    return Rec.LOOKUP, 0, [encode(fields), tokens.tobytes()]


def _checkpointed_insert(rid: str, known: int, slots: np.ndarray, folded: bool) -> list[tuple[int, int, list]]:
    """A checkpoint of `rid` whose insert names `known` of its tokens, as the capture writes it:
    `folded`, the insert's records open and close the checkpoint too (its usual form);
    otherwise with the checkpoint's own records (when something else inside comes first)."""
    def insert(opens: str | None) -> list:
        return [encode(Insert(known, known, None, None, checkpoint=opens, fresh=False)), b"", slots.tobytes()]

    if folded:
        return [(Rec.INSERT, 0, insert(rid)), (Rec.INSERTED, 0 << 2 | CHECKPOINT_RETURNED, [])]
    return [(Rec.CHECKPOINT, 0, [encode(Checkpoint(rid, fresh=False))]), (Rec.INSERT, 0, insert(None)),
            (Rec.INSERTED, 0, []), (Rec.END, CALLS.index("checkpoint"), [])]


@pytest.mark.parametrize("folded", [True, False], ids=["folded", "own-records"])
def test_a_checkpoints_insert_is_named_by_its_requests_tokens(folded: bool) -> None:
    replayer, emitter, sink = _replayer()
    tokens = np.arange(5000, 5000 + 4 * PAGE, dtype=np.int64)
    slots = np.arange(4, dtype=np.int64) * PAGE + 64  # page starts, as SGLang holds them
    for kind, value, blobs in [_lookup("a", tokens), *_checkpointed_insert("a", len(tokens), slots, folded)]:
        replayer.handle(kind, value, blobs)
    assert emitter.shutdown()
    commits = [e for e in sink.events if e.kind is EventKind.COMMIT]
    assert len(commits) == 1 and replayer.lost == 0
    assert [commits[0].block_key, *commits[0].more_keys] == page_keys(tokens, PAGE).tolist()
    assert not replayer.frames  # the checkpoint and its insert both closed


@pytest.mark.parametrize("folded", [True, False], ids=["folded", "own-records"])
def test_an_insert_naming_tokens_it_does_not_hold_drops_the_ledger_not_the_requests(folded: bool) -> None:
    """Never expected (the capture mirrors the stand-ins); if it happens the commit is missing,
    so the ledger is reported invalidated, while the requests the resolver holds stay valid."""
    replayer, emitter, sink = _replayer()
    slots = np.arange(4, dtype=np.int64) * PAGE
    for kind, value, blobs in _checkpointed_insert("never-looked-up", 4 * PAGE, slots, folded):
        replayer.handle(kind, value, blobs)
    assert emitter.shutdown()
    assert replayer.lost == 0 and replayer.errors == 1
    assert "never-looked-up" in replayer.requests
    assert not [e for e in sink.events if e.kind is EventKind.COMMIT]
    (reset,) = [e for e in sink.events if e.kind is EventKind.INVALIDATE]
    assert reset.tier is Tier.DEVICE and reset.reason is Reason.EXPLICIT


def _window_replayer() -> tuple[Replayer, BatchEmitter, MemorySink]:
    sink = MemorySink()
    emitter = BatchEmitter(sink, BatchConfig(), register_atexit=False)
    spec = ResolverSpec(ring="unused", page_size=PAGE, components=("FULL", "SWA"), page_bytes=(1, 0),
                        identity=Identity(instance="r"), usage_interval_s=0)
    return Replayer(spec, emitter), emitter, sink


def _window_record(kind: Rec, name: str, full: np.ndarray, window: np.ndarray, component: str = "SWA") -> tuple:
    """A window action as the capture writes it: the full-attention page starts it names and the
    window slots the allocator's table maps them to when the shim would read it."""
    fields = Acted(name, PAGE) if kind is Rec.ACTED else Action(name, component, PAGE)
    return kind, 0, [encode(fields), full.tobytes(), window.tobytes()]


def _keys(events: list, kind: EventKind, group: int) -> list[int]:
    return [k for e in events if e.kind is kind and e.group_id == group for k in (e.block_key, *e.more_keys)]


def test_window_pages_are_named_in_the_window_numbering_the_records_carry() -> None:
    """A window's state lives in its own pool, numbered by the allocator's full-to-window table;
    the resolver has no allocator, only the table's entries each record carried. A recovery
    moves a window to other window slots: a free of the old ones then names nothing, and a
    free of the new ones names the recovered pages."""
    replayer, emitter, sink = _window_replayer()
    tokens = np.arange(7000, 7000 + 4 * PAGE, dtype=np.int64)
    full = np.arange(4, dtype=np.int64) * PAGE + 64
    first, moved = full + 1024, full + 4096  # window slots, before and after the recovery
    insert = encode(Insert(len(tokens), 0, None, None, None, False))
    records = [
        (Rec.INSERT, 0, [insert, tokens.tobytes(), full.tobytes()]),
        _window_record(Rec.ACTED, "SWARebuild", full, first),  # the insert builds the window
        (Rec.INSERTED, 0, []),
        _window_record(Rec.ACTION, "FreeComponentDeviceSlot", full, first),  # the window evicted
        _window_record(Rec.ACTED, "RecoverSWAWithLockedFull", full, moved),  # and recovered elsewhere
        _window_record(Rec.ACTION, "FreeComponentDeviceSlot", full, first),  # its old slots: nothing held
    ]
    for kind, value, blobs in records:
        replayer.handle(kind, value, blobs)
    assert emitter.shutdown()
    names = page_keys(tokens, PAGE).tolist()
    assert _keys(sink.events, EventKind.COMMIT, 0) == names
    assert _keys(sink.events, EventKind.COMMIT, 1) == names * 2  # built, then recovered
    assert _keys(sink.events, EventKind.EVICT, 1) == names  # only the first free found them
    assert replayer.errors == 0 and replayer.shim.errors == 0


def test_a_free_that_read_no_window_table_keeps_the_full_numbering() -> None:
    """Without a table (a record with no window slots) the shim names the window by the
    full-attention slots, as it does in-process; a table left from an earlier record is not read."""
    replayer, emitter, sink = _window_replayer()
    tokens = np.arange(9000, 9000 + 2 * PAGE, dtype=np.int64)
    full = np.arange(2, dtype=np.int64) * PAGE
    replayer.handle(*_window_record(Rec.ACTION, "FreeComponentDeviceSlot", full + 512, full + 2048))  # a table seen
    replayer.handle(Rec.INSERT, 0, [encode(Insert(len(tokens), 0, None, None, None, False)), tokens.tobytes(),
                                    full.tobytes()])
    replayer.handle(Rec.ACTED, 0, [encode(Acted("SWARebuild", PAGE)), full.tobytes()])  # then none
    replayer.handle(Rec.INSERTED, 0, [])
    replayer.handle(Rec.ACTION, 0, [encode(Action("FreeComponentDeviceSlot", "SWA", PAGE)), full.tobytes()])
    assert emitter.shutdown()
    names = page_keys(tokens, PAGE).tolist()
    assert _keys(sink.events, EventKind.COMMIT, 1) == names and _keys(sink.events, EventKind.EVICT, 1) == names
    assert replayer.cache.token_to_kv_pool_allocator.full_to_swa_index_mapping is None


def test_host_loads_are_reported_when_loading_check_retires_them_one_by_one() -> None:
    """HiCache's loads retire at the scheduler's `loading_check`: a load still in progress at one
    check is reported at a later one, with the time from its start on the capture's clock; the
    resolver never reads its own clock for it."""
    replayer, emitter, sink = _replayer()
    tokens = np.arange(3000, 3000 + 4 * PAGE, dtype=np.int64)
    device, host = np.arange(4, dtype=np.int64) * PAGE, np.arange(4, dtype=np.int64) * PAGE + 1024
    first, second = np.arange(2, dtype=np.int64) * PAGE + 2048, np.arange(2, 4, dtype=np.int64) * PAGE + 2048
    ms = 1_000_000

    def copy(kind: Rec, node: int, at: int, source: np.ndarray, target: np.ndarray) -> tuple:
        fields = (Backup if kind is Rec.BACKUP else Restore)(node, at, [])
        return kind, 0, [encode(fields), source.tobytes(), target.tobytes()]

    def check(before: list[int], still: list[int], count: int, at: int) -> tuple:
        return Rec.RESTORED, 0, [encode(Restored(before, still, count, at, opened=False))]

    records = [
        (Rec.INSERT, 0, [encode(Insert(len(tokens), 0, None, None, None, False)), tokens.tobytes(),
                         device.tobytes()]),
        (Rec.INSERTED, 0, []),
        copy(Rec.BACKUP, 7, 10 * ms, device, host),
        (Rec.BACKED, 0, [encode(Backed(7, 13 * ms))]),
        copy(Rec.RESTORE, 1, 20 * ms, host[:2], first),
        copy(Rec.RESTORE, 2, 21 * ms, host[2:], second),
        check([1, 2], [2], 1, 25 * ms),  # the first is done, the second still loading
        check([2], [], 1, 30 * ms),  # something not an id still loads: only the second retires
    ]
    for kind, value, blobs in records:
        replayer.handle(kind, value, blobs)
    assert emitter.shutdown() and replayer.errors == 0 and replayer.shim.errors == 0
    names = page_keys(tokens, PAGE).tolist()
    moves = [(e.kind, [e.block_key, *e.more_keys], e.duration_ns) for e in sink.events
             if e.kind in (EventKind.OFFLOAD, EventKind.LOAD)]
    assert moves == [(EventKind.OFFLOAD, names, 3 * ms), (EventKind.LOAD, names[:2], 5 * ms),
                     (EventKind.LOAD, names[2:], 9 * ms)]
    assert not replayer.frames


def test_a_storage_write_reports_what_its_acknowledgement_completed() -> None:
    """A storage write acknowledged short of its end reports the pages it completed, and not the
    Mamba state that goes with the last page; a whole one reports both, on the capture's clock."""
    sink = MemorySink()
    emitter = BatchEmitter(sink, BatchConfig(), register_atexit=False)
    spec = ResolverSpec(ring="unused", page_size=PAGE, components=("FULL", "MAMBA"), page_bytes=(1, 1),
                        identity=Identity(instance="r"), usage_interval_s=0)
    replayer = Replayer(spec, emitter)
    tokens = np.arange(5000, 5000 + 4 * PAGE, dtype=np.int64)
    device, host = np.arange(4, dtype=np.int64) * PAGE, np.arange(4, dtype=np.int64) * PAGE + 1024
    state, state_host = np.array([3], dtype=np.int64), np.array([9], dtype=np.int64)
    storage_names = [f"{i:016x}" + "0" * 48 for i in range(1, 5)]
    ms = 1_000_000

    def store(op: int, at: int) -> tuple:
        return Rec.STORE, 0, [encode(Store(op, at, storage_names, ["MAMBA"])), host.tobytes(), state_host.tobytes()]

    records = [
        (Rec.INSERT, 0, [encode(Insert(len(tokens), 0, None, None, None, False)), tokens.tobytes(), device.tobytes(),
                         state.tobytes()]),  # with its Mamba state
        (Rec.INSERTED, 0, []),  # the tree kept the state at the key's end
        (Rec.BACKUP, 0, [encode(Backup(7, 10 * ms, ["MAMBA"])), device.tobytes(), host.tobytes(), state.tobytes(),
                         state_host.tobytes()]),
        (Rec.BACKED, 0, [encode(Backed(7, 12 * ms))]),
        store(5, 20 * ms),
        (Rec.STORED, 0, [encode(Stored(5, 2 * PAGE, 24 * ms))]),  # two pages of four made it
        store(6, 30 * ms),
        (Rec.STORED, 0, [encode(Stored(6, None, 35 * ms))]),
    ]
    for kind, value, blobs in records:
        replayer.handle(kind, value, blobs)
    assert emitter.shutdown() and replayer.errors == 0 and replayer.shim.errors == 0
    names = page_keys(tokens, PAGE).tolist()
    to_disk = [(e.group_id, [e.block_key, *e.more_keys], e.duration_ns) for e in sink.events
               if e.kind is EventKind.OFFLOAD and e.dst_tier is Tier.DISK]
    assert to_disk == [(0, names[:2], 4 * ms), (0, names, 5 * ms), (1, names[-1:], 5 * ms)]


def test_a_window_staged_by_a_prefetch_is_named_from_its_last_page() -> None:
    """A prefetch lands one page, and the window staged with it reaches one page further back,
    onto the node it hangs under, whose slot the commit frees again: the staged window slot of
    the landed page gets that page's key, the freed one none."""
    sink = MemorySink()
    emitter = BatchEmitter(sink, BatchConfig(), register_atexit=False)
    spec = ResolverSpec(ring="unused", page_size=PAGE, components=("FULL", "SWA"), page_bytes=(1, 1),
                        identity=Identity(instance="r"), usage_interval_s=0)
    replayer = Replayer(spec, emitter)
    tokens = np.arange(7000, 7000 + PAGE, dtype=np.int64)
    host, window = np.array([64 * PAGE], dtype=np.int64), np.array([5 * PAGE, 6 * PAGE], dtype=np.int64)
    storage_names = ["ab" * 32]
    records = [
        # under the root, with a name this resolver never learned: keyed from its tokens
        # for request r9, which waited 3 ms for it
        (Rec.FETCHED, 0, [encode(Fetched(0, storage_names, True, None, None, None, "r9", 3_000_000, True)),
                          tokens.tobytes(), host.tobytes()]),
        (Rec.STAGED, 0, [encode(Staged(["SWA"], ["SWA"])), window.tobytes(), window[:1].tobytes()]),
    ]
    for kind, value, blobs in records:
        replayer.handle(kind, value, blobs)
    assert emitter.shutdown() and replayer.errors == 0 and replayer.shim.errors == 0
    key = page_keys(tokens, PAGE).tolist()
    loads = [(e.group_id, [e.block_key, *e.more_keys], e.request_id, e.duration_ns, e.in_flight)
             for e in sink.events if e.kind is EventKind.LOAD]
    # the state with the pages, for their request; the wait counted once, with the pages
    assert loads == [(0, key, "r9", 3_000_000, True), (1, key, "r9", 0, False)]
    assert replayer.shim.ledger[(1, Tier.HOST)].peek(np.array([5, 6])).tolist() == [0, key[0]]


def test_the_resolver_stops_at_a_ring_it_cannot_follow() -> None:
    """A resolver whose ring holds no record where one must start exits (the engine's side then
    sees it gone and stops recording) instead of reading the same spot at full CPU forever. The
    records before that point are handled and their counters published."""
    import os
    import subprocess
    import sys

    import msgspec

    from kvtrace.instrumentation.ring import Ring

    ring = Ring.create(1 << 16)
    try:
        assert ring.offer(Rec.FLUSH, 1)  # a record it can handle
        position = ring.position
        assert ring.offer(Rec.FLUSH, 2)
        ring.buf[256 + position : 256 + position + 16] = b"\x00" * 16  # then its head is gone
        spec = ResolverSpec(ring=ring.name, page_size=PAGE, components=("FULL",), page_bytes=(1,),
                            identity=Identity(instance="r"), usage_interval_s=0, engine_pid=os.getpid(),
                            sink="kvtrace.instrumentation.sinks.memory:MemorySink")
        done = subprocess.run([sys.executable, "-m", "kvtrace.instrumentation.sglang.resolver",
                               msgspec.json.encode(spec).decode()], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "cannot read its ring any further" in done.stderr
        assert ring.consumer_counter(0) == 1 and ring.acknowledged() == 1  # what came before the break
    finally:
        ring.close()


def test_the_resolver_attaches_first_with_what_the_engine_side_read() -> None:
    """The spec carries what the in-process shim's attach reads off the live cache (its recipe,
    release and context length), which the resolver's stand-in cache cannot tell (a window's
    size): the resolver attaches with it before any record, once. A spec without a recipe (an
    engine side that could not derive one) attaches nothing."""
    import msgspec

    recipe = Recipe(name="sglang", groups=(GroupSpec(group_id=0, component=ComponentKind.FULL_ATTENTION,
                                                     block_size=PAGE),
                                           GroupSpec(group_id=1, component=ComponentKind.SLIDING_WINDOW,
                                                     block_size=PAGE, window=4 * PAGE)))
    spec = ResolverSpec(ring="unused", page_size=PAGE, components=("FULL", "SWA"), page_bytes=(1, 0),
                        identity=Identity(instance="r", model="m"), engine_version="0.5.23", max_model_len=4096,
                        recipe=recipe, usage_interval_s=0)
    spec = msgspec.json.decode(msgspec.json.encode(spec), type=ResolverSpec)  # as it travels
    sink = MemorySink()
    emitter = BatchEmitter(sink, BatchConfig(), register_atexit=False)
    replayer = Replayer(spec, emitter)
    for kind, value, blobs in [_lookup("a", np.arange(4 * PAGE, dtype=np.int64))]:
        replayer.handle(kind, value, blobs)
    assert emitter.shutdown() and replayer.shim.errors == 0
    attach, *rest = sink.events
    assert attach.kind is EventKind.ATTACH and recipe_from_json(attach.recipe) == recipe
    assert (attach.engine, attach.model, attach.engine_version, attach.max_model_len, attach.block_size) == (
        "sglang", "m", "0.5.23", 4096, PAGE)
    assert [(e.kind, e.tier, e.reason) for e in rest[:2]] == [(EventKind.INVALIDATE, Tier.DEVICE, Reason.RESTART),
                                                              (EventKind.INVALIDATE, Tier.HOST, Reason.RESTART)]
    assert [e.kind for e in rest[2:]] == [EventKind.LOOKUP]

    bare, bare_emitter, bare_sink = _replayer()  # no recipe in its spec
    assert bare_emitter.shutdown() and bare.shim.errors == 0 and not bare_sink.events
