"""One picture per request when an engine reuses a KV store behind it (vLLM with LMCache).

Each side is reconstructed on its own terms: the engine's blocks (vLLM's 16-token blocks, its
hashes) and the store's chunks (LMCache's 256-token chunks, its prefix-chained hashes) are
different objects with different names, and neither shim can name the other's. What they share
is the request and token positions: block i of the engine covers [i*16, i*16+16), chunk j of
the store [j*256, j*256+256), and both chains are prefixes of the same prompt. So the join is
per request, on positions: a prefix is recoverable when the engine still holds it or the store
can serve it, and the engine adopts device tokens plus the store's tokens loaded on top.

The engine computes the prompt's last token whatever the store holds, so the store's part is
capped at prompt - 1 (as vLLM's LMCache connector does); inside a chunk any boundary serves,
because the engine loads the whole chunk and keeps the prefix it needs.

The union is per request, not per token: tokens the engine reused from device are judged
against the store too, so an engine that reuses device blocks kvtrace finds invalid while the
store holds valid chunks for the same positions is not flagged here (the engine's own result
flags it). Both sides report the same model; give the store its recipe as `lmcache:MODEL`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import msgspec

from kvtrace.schema.columns import U32, U64, Flag, Label, Text
from kvtrace.schema.verdicts import GapReason, LookupResult, Verdict, classify

if TYPE_CHECKING:
    import polars as pl


class JoinedResult(msgspec.Struct, kw_only=True, frozen=True):
    request_id: Text
    engine_instance: Label
    store_instance: Label
    prompt_tokens: U32
    device_logical_tokens: U32  # the engine's own prefix-cache hit
    device_recoverable_tokens: U32
    store_logical_tokens: U32  # the store's lookup, capped at prompt - 1
    store_recoverable_tokens: U32
    logical_hit_tokens: U32  # one prefix, whichever side holds it
    recoverable_hit_tokens: U32
    adopted_tokens: U32  # what the engine reused: device plus loaded from the store
    store_adopted_tokens: U32  # the store's own adopt: the prefix the engine held plus what it retrieved
    verdict: Verdict
    reason: GapReason
    reason_side: Label  # "engine" or "store": whose reconstruction names the gap
    unsafe_reuse: Flag  # adopted beyond what either side can justify
    missed_reuse: Flag  # recoverable beyond what was adopted
    # The store's restore bytes for its whole recoverable prefix, when it extends the engine's:
    # an upper bound, since a connector skips the chunks the engine still holds on device.
    restore_bytes: U64


def join_store(engine: Iterable[LookupResult], store: Iterable[LookupResult]) -> list[JoinedResult]:
    """Join each engine lookup with the store's lookup for the same request (its last one).

    Requests the store was not asked about keep the engine's picture alone."""
    by_request = {r.request_id: r for r in store}
    return [_join(e, by_request.get(e.request_id)) for e in engine]


def _join(e: LookupResult, s: LookupResult | None) -> JoinedResult:
    cap = max(e.prompt_tokens - 1, 0)
    s_logical = min(s.logical_hit_tokens, cap) if s else 0
    s_recoverable = min(s.recoverable_hit_tokens, cap) if s else 0
    logical = max(e.logical_hit_tokens, s_logical)
    recoverable = max(e.recoverable_hit_tokens, s_recoverable)
    adopted = e.adopted_tokens
    store_side = s is not None and s_logical > e.logical_hit_tokens
    reason, side = GapReason.NONE, ""
    if recoverable < logical:
        if store_side:
            reason, side = s.reason, "store"  # type: ignore[union-attr]  # store_side implies s
        else:
            reason, side = e.reason, "engine"
    # The joined hit is whole when recoverable reaches it, or falls short only by the side's
    # alignment (that side's reason says so); the engine's device tier is what needs no restore.
    aligned = recoverable if reason is GapReason.MISALIGNED else logical
    verdict = classify(logical, aligned, recoverable, e.resident_hit_tokens)
    restore = 0
    if s is not None and s_recoverable > e.recoverable_hit_tokens:
        restore = s.restore_host_bytes + s.restore_disk_bytes + s.restore_remote_bytes
    return JoinedResult(
        request_id=e.request_id, engine_instance=e.instance, store_instance=s.instance if s else "",
        prompt_tokens=e.prompt_tokens, device_logical_tokens=e.logical_hit_tokens,
        device_recoverable_tokens=e.recoverable_hit_tokens, store_logical_tokens=s_logical,
        store_recoverable_tokens=s_recoverable, logical_hit_tokens=logical, recoverable_hit_tokens=recoverable,
        adopted_tokens=adopted, store_adopted_tokens=s.adopted_tokens if s else 0, verdict=verdict, reason=reason,
        reason_side=side,
        unsafe_reuse=e.adopt_seen and adopted > recoverable,
        missed_reuse=e.adopt_seen and recoverable > adopted, restore_bytes=restore,
    )


STORE_SUFFIX = "/lmcache"
"""A store's instance is its engine's with this appended (the LMCache shim names it so; with
tensor parallelism each worker's store adds `/<worker>`, and worker 0's stands for the engine)."""


def join_frame(frame: pl.DataFrame) -> pl.DataFrame:
    """Every engine instance in a frame of lookup results joined with its store instance, if any:
    one row per engine lookup (empty when no instance has a store beside it)."""
    import polars as pl

    from kvtrace.analysis.funnel import frame_results

    instances = set(frame["instance"].unique().to_list()) if frame.height else set()
    rows: list[JoinedResult] = []
    for store_instance in sorted(i for i in instances if i.endswith((STORE_SUFFIX, STORE_SUFFIX + "/0"))):
        engine_instance = store_instance.removesuffix("/0").removesuffix(STORE_SUFFIX)
        if engine_instance not in instances:
            continue
        engine = frame_results(frame.filter(pl.col("instance") == engine_instance))
        store = frame_results(frame.filter(pl.col("instance") == store_instance).sort("ts_ns", "source_id", "seq"))
        rows.extend(join_store(engine, store))
    if not rows:
        return pl.DataFrame(schema={f: pl.Utf8 for f in JoinedResult.__struct_fields__}).clear()
    return pl.DataFrame([msgspec.structs.asdict(r) for r in rows])


def join_totals(results: pl.DataFrame, joined: pl.DataFrame) -> pl.DataFrame:
    """Per engine instance and its store: lookups and token sums of the joined picture
    (`joined`, from `join_frame(results)`), beside the unsafe reuse the engine's results alone
    claim (`unsafe_engine_alone`: what reading the engine without its store would report)."""
    import polars as pl

    if not joined.height:
        return pl.DataFrame(schema={"engine_instance": pl.Utf8, "store_instance": pl.Utf8, "lookups": pl.UInt32,
                                    **dict.fromkeys(("logical", "recoverable", "adopted", "unsafe", "missed",
                                                     "unsafe_engine_alone"), pl.Int64)})
    alone = results.group_by("instance").agg(pl.col("unsafe_reuse").sum().alias("unsafe_engine_alone"))
    return (joined.group_by("engine_instance", "store_instance")
            .agg(pl.len().alias("lookups"), pl.col("logical_hit_tokens").sum().alias("logical"),
                 pl.col("recoverable_hit_tokens").sum().alias("recoverable"),
                 pl.col("adopted_tokens").sum().alias("adopted"), pl.col("unsafe_reuse").sum().alias("unsafe"),
                 pl.col("missed_reuse").sum().alias("missed"))
            .join(alone, left_on="engine_instance", right_on="instance", how="left")
            .sort("engine_instance"))
