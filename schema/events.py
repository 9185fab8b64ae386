"""The lifecycle event: one flat, typed record, the single source of truth for every format.

One wide record (rather than a union of per-kind records) is what ClickHouse and Parquet store
best: one table, columns that do not apply hold their empty default and compress to nothing.
Which fields each kind needs is stated in `REQUIRED_BY_KIND` and enforced by `validation`.

Identity of an event is the pair (`source_id`, `seq`): the emitter draws a random `source_id`
per process and numbers its events densely, so a gap in `seq` is visible downstream as loss and
a re-sent event de-duplicates on the pair.

Token ids are never part of the record: state is identified by prefix-chained block hashes.
"""

from __future__ import annotations

import itertools
from typing import Annotated

import msgspec

from kvtrace.schema.columns import (
    F64,
    U16,
    U32,
    U64,
    DurationNs,
    Flag,
    Hash64,
    Label,
    Sorted,
    Text,
    TimeNs,
)
from kvtrace.schema.kinds import ComponentKind, EventKind, Reason, Tier, Transform

SCHEMA_VERSION = 8
"""Bump when fields are added; readers accept every version up to this one."""


def _doc(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


_ENVELOPE = msgspec.field(default_factory=int)


class Event(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """One lifecycle fact about KV-cache state or a request's use of it."""

    # -- envelope ---------------------------------------------------------------------------
    kind: Annotated[EventKind, _doc("What happened.")]
    # The emitter stamps these three; shims leave them 0. On the wire they are required.
    # A default_factory (unlike a plain default) is never dropped by omit_defaults, so they are
    # always encoded, seq 0 included: the first event of every emitter has seq 0.
    ts_ns: Annotated[TimeNs, Sorted(), _doc("Wall-clock time of the fact, ns since the Unix epoch.")] = (
        _ENVELOPE
    )
    source_id: Annotated[Hash64, _doc("Random id of the emitting process; with seq, the event id.")] = (
        _ENVELOPE
    )
    seq: Annotated[U64, Sorted(), _doc("Dense per-source sequence number; gaps mean lost events.")] = (
        _ENVELOPE
    )
    # Always encoded too: a row that omitted its version would be read as the reader's own.
    schema_version: Annotated[U16, _doc("Schema version the event was written with.")] = msgspec.field(
        default_factory=lambda: SCHEMA_VERSION
    )

    # -- where ------------------------------------------------------------------------------
    engine: Annotated[Label, _doc("Engine that emitted it: vllm, sglang, lmcache, sim, ...")] = ""
    engine_version: Annotated[Label, _doc("Engine release.")] = ""
    instance: Annotated[Label, _doc("Serving instance (one engine process group).")] = ""
    dp_rank: Annotated[U16, _doc("Data-parallel rank.")] = 0
    tp_rank: Annotated[U16, _doc("Tensor-parallel rank.")] = 0
    pp_rank: Annotated[U16, _doc("Pipeline-parallel rank.")] = 0

    # -- identity of the state: reuse is only valid when all of these match ------------------
    model: Annotated[Label, _doc("Model name.")] = ""
    model_revision: Annotated[Label, _doc("Weights id: revision, checkpoint hash or RL step.")] = ""
    adapter: Annotated[Label, _doc("LoRA / adapter name; empty for the base model.")] = ""
    tenant: Annotated[Label, _doc("Tenant namespace (cache salt).")] = ""
    # A factory, so that even an exact transform is always encoded: a reader that fills omitted
    # fields with the type's zero (ClickHouse's faster JSON path, see clickhouse.zero_when_omitted)
    # must not take it for an empty one. A C-level callable: a lambda added ~110 ns to every
    # event a shim makes.
    transform: Annotated[Transform, _doc("Relation of stored values to exact state.")] = msgspec.field(
        default_factory=itertools.repeat(Transform.EXACT).__next__)
    kv_dtype: Annotated[Label, _doc("Stored KV dtype, e.g. bfloat16, fp8_e4m3.")] = ""
    layout: Annotated[Label, _doc("Kernel / layout ABI the bytes follow, e.g. NHD, page_first.")] = ""
    block_size: Annotated[U32, _doc("Tokens per block in this object's cache group.")] = 0
    epoch: Annotated[U64, _doc("Ownership generation; state from another epoch is not reusable.")] = 0

    # -- the object ----------------------------------------------------------------------------
    component: Annotated[ComponentKind, _doc("Kind of state the object holds.")] = ComponentKind.NONE
    group_id: Annotated[U16, _doc("Cache group index within the model's recipe.")] = 0
    block_key: Annotated[Hash64, _doc("Prefix-chained hash of the block; 0 on a bulk invalidate.")] = 0
    parent_key: Annotated[Hash64, _doc("block_key of the previous block; 0 for the first.")] = 0
    token_start: Annotated[U32, _doc("First token position covered (inclusive).")] = 0
    token_end: Annotated[U32, _doc("Token position after the last one covered (exclusive).")] = 0
    tier: Annotated[Tier, _doc("Tier the fact is about (where created, committed or evicted).")] = Tier.NONE
    nbytes: Annotated[U64, _doc("Size of the object in this tier, bytes.")] = 0
    lease_expiry_ns: Annotated[TimeNs, _doc("When the object stops being reusable; 0 = no lease.")] = 0
    checksum: Annotated[Hash64, _doc("Content checksum of the stored bytes; 0 = not computed.")] = 0

    # -- transfers -----------------------------------------------------------------------------
    src_tier: Annotated[Tier, _doc("Tier copied from (offload, load).")] = Tier.NONE
    dst_tier: Annotated[Tier, _doc("Tier copied to (offload, load).")] = Tier.NONE
    duration_ns: Annotated[DurationNs, _doc("Transfer time, or time an adopt spent.")] = 0
    in_flight: Annotated[Flag, _doc("Load still in flight when the request was admitted.")] = False

    # -- evict / invalidate ----------------------------------------------------------------------
    reason: Annotated[Reason, _doc("Why it was evicted or invalidated.")] = Reason.NONE

    # -- lookup / adopt --------------------------------------------------------------------------
    request_id: Annotated[Text, _doc("Engine request id.")] = ""
    prompt_tokens: Annotated[U32, _doc("Prompt length in tokens (lookup).")] = 0
    group_block_keys: Annotated[
        list[list[Hash64]], _doc("The request's block-key chain, one list per cache group (lookup).")
    ] = []
    group_hit_tokens: Annotated[
        list[U32], _doc("Hit the engine found per cache group before reconciling (lookup).")
    ] = []
    reported_hit_tokens: Annotated[U32, _doc("Hit the engine reported after reconciling (lookup).")] = 0
    reused_tiers: Annotated[list[Tier], _doc("Tiers the adopted tokens came from (adopt).")] = []
    reused_tokens: Annotated[list[U32], _doc("Tokens adopted from each of reused_tiers (adopt).")] = []
    recomputed_tokens: Annotated[U32, _doc("Prompt tokens computed afresh (adopt).")] = 0

    # -- runs (schema version 2) ---------------------------------------------------------------
    more_keys: Annotated[
        list[Hash64],
        _doc("Further blocks of the same group the same fact applies to (a run of commits or evictions): "
             "their keys, after block_key. Lets a shim report a whole run as one event; nbytes stays per block."),
    ] = []

    # -- usage samples (schema version 3) --------------------------------------------------------
    locked_bytes: Annotated[U64, _doc("Bytes of the tier held by running requests (usage).")] = 0
    evictable_bytes: Annotated[U64, _doc("Bytes of the tier holding reusable state nobody holds (usage).")] = 0
    free_bytes: Annotated[U64, _doc("Bytes of the tier holding nothing (usage).")] = 0

    # -- probes: a request re-run with and without its cache (schema version 4) -----------------
    # request_id names the re-run that read the cache (its lookup and adopt are ordinary events,
    # so it gets a verdict of its own); prompt_tokens, reported_hit_tokens (what that run reused)
    # and duration_ns (what the probe cost) keep their meaning.
    probe_of: Annotated[Text, _doc("The request whose prompt the probe re-ran (probe).")] = ""
    probe_positions: Annotated[U32, _doc("Token positions whose log-probabilities were compared (probe).")] = 0
    probe_max_abs_diff: Annotated[
        F64, _doc("Largest |logprob cached - logprob recomputed| of a compared token (probe).")
    ] = 0.0
    probe_mean_kl: Annotated[F64, _doc("KL(recomputed || cached) over the top-k, mean over positions (probe).")] = 0.0
    probe_max_kl: Annotated[F64, _doc("KL(recomputed || cached) over the top-k, worst position (probe).")] = 0.0
    probe_first_token_differs: Annotated[
        Flag, _doc("The cached and the recomputed run generated different first tokens (probe).")
    ] = False
    noise_floor: Annotated[
        F64, _doc("Largest difference between two cache-free runs of one prompt, measured by the prober (probe).")
    ] = 0.0

    # -- the engine, as a shim found it when it attached (schema version 5) ---------------------
    # engine, engine_version, model, model_revision, kv_dtype and block_size (the engine's own
    # block size, where it has one) keep their meaning.
    max_model_len: Annotated[U32, _doc("Longest request, prompt and output, the engine serves (attach).")] = 0
    recipe: Annotated[
        Text,
        _doc("The engine's cache groups as a kvtrace recipe, JSON (attach): what its lookups are judged by "
             "when no recipe is given."),
    ] = ""

    # -- preemption (schema version 8) -------------------------------------------------------------
    preemptions: Annotated[
        U32,
        _doc("Times the request had been preempted before this lookup (lookup): 0 for its first admission, "
             "more for a re-admission, whose reuse engines count apart from their prefix-cache hit rates."),
    ] = 0
    computed_before_preemption: Annotated[
        U32,
        _doc("Tokens the request had computed when it was last preempted (lookup of a re-admission): what "
             "it computes again is this less what it reuses on resume."),
    ] = 0


PROBE_PREFIX = "kvtrace-verify-"
"""Request ids of the re-runs a correctness canary sends: what tells them from users' requests
(shims always trace them; the analysis joins probes to their verdicts by them)."""

WIRE_REQUIRED: tuple[str, ...] = ("kind", "ts_ns", "source_id", "seq")
"""Fields a stored or transmitted event must carry explicitly: without its id an event could
not be de-duplicated, and without its time it could not be ordered."""

FIELD_NAMES: tuple[str, ...] = Event.__struct_fields__
"""Column order everywhere: Struct field order, the DDL, Arrow and Parquet."""

REQUIRED_BY_KIND: dict[EventKind, tuple[str, ...]] = {
    EventKind.CREATE: ("component", "block_key", "tier"),
    EventKind.COMMIT: ("component", "block_key", "tier"),
    EventKind.OFFLOAD: ("component", "block_key", "src_tier", "dst_tier"),
    EventKind.LOAD: ("component", "block_key", "src_tier", "dst_tier"),
    EventKind.EVICT: ("component", "block_key", "tier", "reason"),
    EventKind.INVALIDATE: ("reason",),
    EventKind.LOOKUP: ("request_id", "prompt_tokens"),
    EventKind.ADOPT: ("request_id",),
    EventKind.USAGE: ("tier",),
    EventKind.PROBE: ("request_id", "probe_of"),
    EventKind.ATTACH: ("engine", "model", "recipe"),
}
"""Fields that must differ from their empty default for each kind."""


def adopted_tokens(event: Event) -> int:
    """Total tokens an adopt event reused, over all tiers."""
    return sum(event.reused_tokens)
