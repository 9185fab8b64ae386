"""What the analysis says about one lookup: three hit numbers, a verdict and the gap's reason."""

from __future__ import annotations

from enum import StrEnum

import msgspec

from kvtrace.schema.columns import F64, I64, U32, U64, Flag, Hash64, Label, Text, TimeNs
from kvtrace.schema.kinds import ComponentKind


class Verdict(StrEnum):
    """Was the hash hit usable as is? The words answer what an engineer reading "HIT" on a
    dashboard assumes, so the gap kvtrace exists to show is never hidden under a HIT."""

    HIT = "HIT"  # the whole aligned hash hit is recoverable, with nothing to restore
    PARTIAL = "PARTIAL"  # a hash hit that needs a restore or a recompute before use
    MISS = "MISS"  # no hash hit


def classify(logical: int, aligned_logical: int, recoverable: int, resident: int) -> Verdict:
    """The verdict of one lookup from its hit numbers; `aligned_logical` is the hash hit cut to
    the recipe's alignment (a tail no group can resume at is not a loss the cache could avoid).
    Every path (streaming, live, ClickHouse, DuckDB) writes the same rule."""
    if logical <= 0:
        return Verdict.MISS
    if recoverable >= aligned_logical and resident >= recoverable:
        return Verdict.HIT
    return Verdict.PARTIAL


class GapReason(StrEnum):
    """Why the recoverable boundary stops where it does (closed taxonomy)."""

    NONE = ""  # recoverable reaches the logical hit
    MISSING_BLOCK = "missing_block"
    WINDOW_OUT_OF_RANGE = "window_out_of_range"
    NO_CHECKPOINT = "no_checkpoint_at_boundary"
    MISSING_TAIL = "missing_tail"
    INDEXER_OUT_OF_SYNC = "indexer_out_of_sync"
    NOT_RESIDENT = "not_resident"  # recoverable only by fetching: separates resident from recoverable
    LEASE_EXPIRED = "lease_expired"
    IDENTITY_MISMATCH = "identity_mismatch"
    TENANT_MISMATCH = "tenant_mismatch"
    MISALIGNED = "misaligned_boundary"
    UNCOMMITTED = "uncommitted"
    INVALIDATED = "invalidated"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    CHANGED_BEFORE_USE = "changed_before_use"
    SPECULATIVE_ROLLBACK = "speculative_rollback"


MISSING_REASON: dict[ComponentKind, GapReason] = {
    ComponentKind.FULL_ATTENTION: GapReason.MISSING_BLOCK,
    ComponentKind.COMPRESSED: GapReason.MISSING_BLOCK,
    ComponentKind.CROSS_ATTENTION: GapReason.MISSING_BLOCK,
    ComponentKind.SLIDING_WINDOW: GapReason.WINDOW_OUT_OF_RANGE,
    ComponentKind.MAMBA: GapReason.NO_CHECKPOINT,
    ComponentKind.UNCOMPRESSED_TAIL: GapReason.MISSING_TAIL,
    ComponentKind.INDEXER: GapReason.INDEXER_OUT_OF_SYNC,
}
"""The reason a missing object of each component gives."""


class LookupResult(msgspec.Struct, kw_only=True, omit_defaults=False):
    """One row per lookup: the same columns from the streaming, ClickHouse and DuckDB paths."""

    ts_ns: TimeNs
    source_id: Hash64  # with seq, the lookup event's id
    seq: U64
    instance: Label
    request_id: Text
    model: Label
    tenant: Label
    prompt_tokens: U32
    reported_hit_tokens: U32
    preemptions: U32 = 0  # the request's preemptions before this lookup: 0 for its first admission
    computed_before_preemption: U32 = 0  # tokens it had computed when last preempted (a re-admission)
    logical_hit_tokens: U32
    recoverable_hit_tokens: U32
    resident_hit_tokens: U32
    adopted_tokens: U32 = 0
    recomputed_tokens: U32 = 0
    adopt_seen: Flag = False
    verdict: Verdict = Verdict.MISS
    reason: GapReason = GapReason.NONE
    reason_group: I64 = -1
    reason_detail: Text = ""  # e.g. which identity field differed
    unsafe_reuse: Flag = False  # adopted > recoverable: a correctness alarm
    missed_reuse: Flag = False  # recoverable > adopted: compute thrown away
    cross_tenant: Flag = False  # reused state committed under another tenant namespace
    restore_host_bytes: U64 = 0
    restore_disk_bytes: U64 = 0
    restore_remote_bytes: U64 = 0
    group_logical_tokens: list[U32] = []
    # The fleet view at the lookup (`Policy.fleet`; without it the fleet is this instance alone):
    # the longest hash hit on any instance of the model, the longest recoverable prefix on the
    # best one, which one, and what the routing decision cost (`analysis.fleet`).
    seen_anywhere_tokens: U32 = 0
    recoverable_anywhere_tokens: U32 = 0
    best_instance: Label = ""  # holds recoverable_anywhere ("" when it is 0; this instance on a tie)
    routing_regret_tokens: U32 = 0  # recoverable anywhere, not here (at the lookup)
    fleet_reason: GapReason = GapReason.NONE  # why the longest seen hit was not recoverable where it was seen
    best_restore_bytes: U64 = 0  # to fetch from slower tiers on the best instance


COUNTED_SQL = "adopt_seen AND preemptions = 0"
"""The verdict rows an engine counts in its prefix-cache hit rate, as SQL: a request's first
admission, adopted (`analysis.funnel.counted` is the same over a frame). A request preempted and
admitted again looks up again; vLLM counts those apart (`PrefixCacheStats.preempted_*`)."""
READMITTED_SQL = "adopt_seen AND preemptions > 0"
"""The verdict rows of re-admissions after a preemption, as SQL."""


class Agreement(StrEnum):
    """What re-executing a request without its cache says about its verdict (`kvtrace verify`)."""

    IDENTICAL = "recoverable_identical"  # the claim holds: reusing gave what recomputing gives
    DIVERGED = "recoverable_diverged"  # a reuse bug, or an identity field kvtrace does not track yet
    ALARM_CONFIRMED = "unsafe_diverged"  # kvtrace flagged the reuse, and outputs changed
    ALARM_CONSERVATIVE = "unsafe_identical"  # flagged, yet outputs matched (e.g. identical weights)
    NOTHING_REUSED = "nothing_reused"  # no cached token was used: a control, nothing to prove
    INCONCLUSIVE = "inconclusive"  # reused, but no position had numbers from both runs to compare


class Verification(msgspec.Struct, kw_only=True, omit_defaults=False):
    """One request re-executed without its cache, next to its verdict (table `verifications`)."""

    ts_ns: TimeNs
    run_id: Label  # one verify run: its rows share the noise floor
    instance: Label
    request_id: Text
    model: Label
    tenant: Label
    verdict: Verdict
    reason: GapReason = GapReason.NONE
    unsafe_reuse: Flag = False
    prompt_tokens: U32 = 0
    adopted_tokens: U32 = 0  # what the cached run reused
    positions: U32 = 0  # token positions whose log-probabilities were compared
    max_abs_diff: F64 = 0.0  # largest |logprob cached - logprob recomputed| of a compared token
    mean_kl: F64 = 0.0  # KL(recomputed || cached) over the top-k, averaged over positions
    max_kl: F64 = 0.0
    first_token_match: Flag = True  # the first generated token is the same
    noise_floor: F64 = 0.0  # max_abs_diff between two cache-free runs of the same prompts
    tolerance: F64 = 0.0  # the threshold applied: above it, the runs diverged
    agreement: Agreement = Agreement.NOTHING_REUSED
    detail: Text = ""
