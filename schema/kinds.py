"""Closed vocabularies of the event model.

Every enum is a `StrEnum` so the stored value is readable in SQL and stable across releases:
members are only ever added, never renamed. An empty value means "not applicable to this event",
which keeps ClickHouse columns non-Nullable (cheaper) and round trips exact.
"""

from __future__ import annotations

from enum import StrEnum


class EventKind(StrEnum):
    """What happened to a piece of KV-cache state, in the past tense of the lifecycle."""

    CREATE = "create"  # allocated and being written: tentative, not reusable yet
    COMMIT = "commit"  # written and published for reuse
    OFFLOAD = "offload"  # copied to a lower tier
    LOAD = "load"  # copied to a higher tier
    INVALIDATE = "invalidate"  # no longer valid for reuse (see InvalidateReason)
    EVICT = "evict"  # removed from one tier
    LOOKUP = "lookup"  # a request asked for its prefix
    ADOPT = "adopt"  # the engine reused and/or recomputed tokens for a request
    USAGE = "usage"  # a tier's occupancy at one moment: locked, evictable and free bytes (sampled)
    PROBE = "probe"  # a request's cached run compared with a cache-free recompute (correctness canary)
    ATTACH = "attach"  # a shim attached to an engine: what the engine is and how it caches (its recipe)


OBJECT_KINDS = frozenset(
    {
        EventKind.CREATE,
        EventKind.COMMIT,
        EventKind.OFFLOAD,
        EventKind.LOAD,
        EventKind.INVALIDATE,
        EventKind.EVICT,
    }
)
REQUEST_KINDS = frozenset({EventKind.LOOKUP, EventKind.ADOPT})


class ComponentKind(StrEnum):
    """The kind of state a cache group holds; resuming needs every kind a model has."""

    NONE = ""
    FULL_ATTENTION = "full_attention"  # full attention or MLA KV for every token
    SLIDING_WINDOW = "sliding_window"  # KV for the last W tokens only
    MAMBA = "mamba"  # recurrent / linear-attention / SSM checkpoint at one boundary
    COMPRESSED = "compressed"  # compressed KV blocks (ratio C)
    UNCOMPRESSED_TAIL = "uncompressed_tail"  # the tokens after the last compressed block
    INDEXER = "indexer"  # sparse-attention indexer keys, tied to one KV generation
    CROSS_ATTENTION = "cross_attention"  # encoder output KV (encoder-decoder models)
    OTHER = "other"


class Tier(StrEnum):
    """Where a copy of state lives, fastest first."""

    NONE = ""
    DEVICE = "device"  # accelerator memory (HBM)
    HOST = "host"  # host DRAM, pinned or not
    DISK = "disk"  # local disk / NVMe
    REMOTE = "remote"  # remote store (another node, object store, LMCache server)


TIER_ORDER = (Tier.DEVICE, Tier.HOST, Tier.DISK, Tier.REMOTE)


class Transform(StrEnum):
    """How the stored values relate to the exact model state; reuse needs an equal transform."""

    EXACT = "exact"
    FP8 = "fp8"
    INT8 = "int8"
    INT4 = "int4"
    COMPRESSED = "compressed"
    SPARSE = "sparse"
    SPECULATIVE_DRAFT = "speculative_draft"


class Reason(StrEnum):
    """Why an object was evicted or invalidated."""

    NONE = ""
    # evict
    CAPACITY = "capacity"  # the tier needed room (LRU or the engine's own policy)
    POLICY = "policy"  # a retention policy chose it (TTL, checkpoint thinning, ...)
    REQUEST_FINISHED = "request_finished"  # freed with the request, never published
    EXPLICIT = "explicit"  # an operator or API call removed it
    # invalidate
    WEIGHT_UPDATE = "weight_update"
    ADAPTER_UNLOAD = "adapter_unload"
    EPOCH_CHANGE = "epoch_change"
    TENANT_PURGE = "tenant_purge"
    CORRUPTION = "corruption"
    RESET = "reset"  # the whole cache was cleared
    ROLLBACK = "rollback"  # speculative tokens rejected
    RESTART = "restart"  # the engine process started: nothing its memory held before survives


class Ending(StrEnum):
    """How an emitter ended, as its last stats say."""

    RUNNING = ""  # not ended (yet)
    CLEAN = "clean"  # its shutdown ran: everything it accepted was delivered or handed on, and counted
    UNCLEAN = "unclean"  # its process died first (killed, out of memory, crashed); another process
    # shipped what its journal held and sent these stats for it


EVICT_REASONS = frozenset({Reason.CAPACITY, Reason.POLICY, Reason.REQUEST_FINISHED, Reason.EXPLICIT})
INVALIDATE_REASONS = frozenset(
    {
        Reason.WEIGHT_UPDATE,
        Reason.ADAPTER_UNLOAD,
        Reason.EPOCH_CHANGE,
        Reason.TENANT_PURGE,
        Reason.CORRUPTION,
        Reason.RESET,
        Reason.ROLLBACK,
        Reason.RESTART,
        Reason.EXPLICIT,
    }
)
