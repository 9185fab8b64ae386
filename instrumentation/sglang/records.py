"""What the out-of-process SGLang mode sends from the scheduler thread (`capture`) to the resolver
process (`resolver`): the ring's record kinds, the typed fields of each record, and the spec
the resolver starts from. Both sides import this module and nothing else of each other.

A ring record (`kvtrace.instrumentation.ring`) is a kind, a 64-bit value and blobs. Two shapes:
- bare: the kind and its value say it all (a call's start or end, an insert's result, a flush,
  a loss), one 16-byte write, the cheapest record there is;
- with fields: the first blob is one of the `Fields` structs below, msgpack-encoded as an array
  (`array_like`: no field names on the wire) whose first element is its kind (the struct's
  tag), then raw int64 blobs (token ids, the first slot of each page as SGLang held it) that
  its docstring names. The value is 0. `decode` reads any of them, typed, in one call.
A record costs more for its number of blobs than for its bytes (each is a step of Python on the
scheduler thread), so the small fields share one blob.

HiCache's records (`Backup` to `Staged`) are made where `hicache.HiCacheHooks` reads the same
calls in-process, all on the scheduler thread: the storage tier's writes and prefetches run on
SGLang's own threads, but what the hooks read of them happens there. Times are the scheduler
thread's monotonic clock in ns, taken where the in-process hooks take theirs. Components are
named as SGLang names them ("FULL", "SWA", "MAMBA").
"""

from __future__ import annotations

from enum import IntEnum

import msgspec

from kvtrace.instrumentation.identity import Identity
from kvtrace.schema.recipes import Recipe


class Rec(IntEnum):
    """Record kinds on the ring: the bare ones with what their value holds, the others named
    after their fields' struct (whose tag is the kind)."""

    BEGIN = 1  # bare: a wrapped call with nothing to read starts; value: its CALLS index
    END = 2  # bare: a call returned; value: its CALLS index (match_prefix and insert end with their own)
    ABORT = 3  # bare: it raised; value: its CALLS index
    LOOKUP = 4  # `Lookup`
    INSERT = 5  # `Insert`; bare (value 0) for an insert without a key or value: no blobs
    INSERTED = 6  # bare: the insert returned; value: prefix_len << 2 | MAMBA_EXISTED | CHECKPOINT_RETURNED
    CHECKPOINT = 7  # `Checkpoint`
    ACTION = 8  # `Action`
    ADMIT = 9  # `Admit`
    ACTED = 10  # `Acted`
    FLUSH = 11  # bare: value: a flush number the resolver acknowledges once its sink has it
    STOP = 12  # bare: the resolver exits
    LOST = 13  # bare: value: records dropped since the last one that got through (the ring writes it)
    BACKUP = 14  # `Backup`
    BACKED = 15  # `Backed`
    RESTORE = 16  # `Restore`
    RESTORED = 17  # `Restored`
    STORE = 18  # `Store`
    STORED = 19  # `Stored`
    FETCHED = 20  # `Fetched`
    CLEARED = 21  # bare: `clear_storage_backend` emptied the storage tier
    STAGED = 22  # `Staged`
    KEPT = 23  # `Kept`


CALLS = ("match_prefix", "checkpoint", "insert", "evict", "evict_for_alloc", "evict_host", "reset",
         "loading_check", "check_hicache_events", "init_load_back", "release_session")
"""The wrapped calls a BEGIN, END or ABORT names, by index."""

MAMBA_EXISTED = 1  # INSERTED: the tree already had the Mamba state at the key's end
CHECKPOINT_RETURNED = 2  # INSERTED: the checkpoint around it returned right after (its END, folded in)

REQUESTS_KEPT = 8192
"""Request stand-ins the resolver keeps; the capture mirrors which, and how many tokens each holds."""


class Fields(msgspec.Struct, array_like=True, gc=False):
    """A record's small fields: its first blob. Each kind of record with fields subclasses this
    with its kind as tag."""


class Lookup(Fields, tag=int(Rec.LOOKUP)):
    """`match_prefix` returned. Blobs: the request's prompt tokens (or the key's, without a
    request; none for a repeat), then its output tokens if it has any."""

    device: int  # SGLang's hit on device, in tokens
    host: int  # and on host
    full: int  # its full-attention hit (`full_kv_hit_length`), 0 where it has none
    request_id: str  # "" without a request
    extra_key: str | None
    cache_salt: str | None
    counters: tuple[int, int, int] | None  # the pool's (locked, evictable, free) when a usage sample is due
    request: bool  # the call had a request
    repeat: bool  # the request asked again with the same answer: no tokens
    opened: bool  # something inside the call was recorded, and its opening with it (else this opens it)
    fresh: bool  # a request object not seen before (in-process its page chain starts anew)
    preemptions: int = 0  # the request's retractions so far (SGLang's retraction_count)
    computed: int = 0  # what it had computed when last retracted


class Insert(Fields, tag=int(Rec.INSERT)):
    """An insert starts (this opens the call). Blobs: the key's tokens (inside a checkpoint,
    less the first `known`, which are the request's as its last lookup sent them), the first
    slot of each of its pages, and its Mamba slots when it has a Mamba value."""

    length: int  # the key's length, in tokens
    known: int  # leading tokens not carried: the checkpointed request's own
    extra_key: str | None
    cache_salt: str | None
    checkpoint: str | None  # the request whose checkpoint this record also opens (as CHECKPOINT would)
    fresh: bool  # that request's object was not seen before (as `Checkpoint.fresh`)


class Checkpoint(Fields, tag=int(Rec.CHECKPOINT)):
    """A checkpoint whose first record inside is not its insert starts. No blobs."""

    request_id: str
    fresh: bool  # a request object not seen before


class Action(Fields, tag=int(Rec.ACTION)):
    """A cache action is about to free slots. Blobs: the first slot of each page it frees and,
    where the shim translates them (a cache with a window: a KV free, or the window's own), the
    window slots the allocator maps those pages to, read before the free."""

    name: str  # the action's class name
    component: str  # the component whose pool it frees
    step: int  # slots per ledger entry of that pool


class Acted(Fields, tag=int(Rec.ACTED)):
    """A window action ran (`capture.WINDOW_ACTIONS`). Blobs: the first slot of each
    full-attention page it names (a rebuild's source value, a recovery's kept full value), and
    the window slots the allocator maps them to now, where it has a table."""

    name: str
    step: int


class Admit(Fields, tag=int(Rec.ADMIT)):
    """What an admitted request reused, per tier (SGLang's own split). No blobs."""

    prompt_tokens: int
    device: int
    host: int
    storage: int
    request_id: str
    tenant: str | None


class Backup(Fields, tag=int(Rec.BACKUP)):
    """HiCache: `cache_controller.write` returned host slots. Blobs: the first slot of each page
    on device, then on host, then each extra pool's device and host slots, in `pools` order."""

    node_id: int
    time_ns: int
    pools: list[str]  # the components of the extra pools that travel with the copy


class Backed(Fields, tag=int(Rec.BACKED)):
    """HiCache: a backup acknowledged (`_finish_write_through_ack`). No blobs."""

    ack_id: int
    time_ns: int


class Restore(Fields, tag=int(Rec.RESTORE)):
    """HiCache: `cache_controller.load` returned device slots. Blobs: the first slot of each page
    on host, then on device, then each extra pool's host and device slots, in `pools` order."""

    node_id: int
    time_ns: int
    pools: list[str]


class Restored(Fields, tag=int(Rec.RESTORED)):
    """HiCache: `loading_check` returned with loads in progress when it began. No blobs."""

    before: list[int]  # the (int) load ids in progress before it
    still: list[int]  # and after it
    loading: int  # how many loads are in progress after it, ids or not
    time_ns: int
    opened: bool  # its opening was recorded (else this opens it)


class Store(Fields, tag=int(Rec.STORE)):
    """HiCache: `cache_controller.write_storage` queued a write. Blobs: the first slot of each of
    its pages on host, then each state's host slots, in `states` order."""

    op_id: int
    time_ns: int
    names: list[str]  # SGLang's storage names of its pages
    states: list[str]  # the components of the states written with them


class Stored(Fields, tag=int(Rec.STORED)):
    """HiCache: the storage acknowledgement queue handed a write back. No blobs."""

    op_id: int
    completed_tokens: int | None  # None: all of it
    time_ns: int


class Fetched(Fields, tag=int(Rec.FETCHED)):
    """HiCache: `tree_core.insert_host` put a landed prefetch on host. Blobs: the key's tokens,
    the first slot of each page on host."""

    prefix_len: int
    names: list[str]  # SGLang's storage names of its pages
    root: bool  # it hangs under the root (`hicache.hung_under`)
    parent: str | None  # else the storage name of the node it hangs under, if known
    extra_key: str | None
    cache_salt: str | None
    request_id: str  # the request the prefetch was for
    took_ns: int  # since SGLang started the prefetch
    held: bool  # the request waits for it (`hicache.holds_requests`)


class Staged(Fields, tag=int(Rec.STAGED)):
    """HiCache: `tree_core.commit_hicache_transfers` committed a landed prefetch's states. Blobs:
    the host slots of each state staged, then of each the commit frees again, in order."""

    staged: list[str]  # their components
    released: list[str]


class Kept(Fields, tag=int(Rec.KEPT)):
    """`claim_kv_row` returned True: a streaming session keeps the request's KV row. Blobs: the
    request's tokens and the first slot of each of the row's pages, as far as both reach its
    committed length (what the in-process shim reads at `claim_kv_row`)."""

    cache_salt: str | None
    extra_key: str | None


AnyFields = (Lookup | Insert | Checkpoint | Action | Acted | Admit | Backup | Backed | Restore | Restored
             | Store | Stored | Fetched | Staged | Kept)

encode = msgspec.msgpack.Encoder().encode
"""A record's fields as its first blob."""

decode = msgspec.msgpack.Decoder(AnyFields).decode
"""A record's first blob as its fields, typed by the tag it carries."""


class ResolverSpec(msgspec.Struct, frozen=True):
    """What the resolver process needs to rebuild the shim (no live SGLang object), passed to
    it as JSON on its command line. The resolver attaches (`RadixCacheShim.emit_attach`) with
    the recipe the engine side derived from the live cache; a spec without one attaches nothing."""

    ring: str
    page_size: int
    components: tuple[str, ...]
    page_bytes: tuple[int, ...]
    identity: Identity
    sample_rate: float = 1.0
    engine_version: str = ""
    max_model_len: int = 0  # the longest request the engine serves (SGLang's context length); 0: unknown
    recipe: Recipe | None = None  # the cache's own (`recipe.recipe_from_cache`)
    usage_interval_s: float = 1.0
    engine_pid: int = 0  # the resolver exits once this process is gone
    sink: str = ""  # "module:callable" making the sink; empty: the sink kvtrace's settings name
    sys_path: tuple[str, ...] = ()  # where the sink's module is found, ahead of the defaults
