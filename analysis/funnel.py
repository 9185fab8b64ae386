"""Hit funnels and gap reasons over per-lookup results, as polars DataFrames."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec
import polars as pl

from kvtrace.schema.events import PROBE_PREFIX
from kvtrace.schema.verdicts import LookupResult

DIMENSIONS = ("model", "instance", "tenant")


def results_frame(results: Iterable[LookupResult]) -> pl.DataFrame:
    """One row per lookup; enum columns hold their string values."""
    rows = [msgspec.structs.asdict(r) for r in results]
    if not rows:
        return pl.DataFrame(schema={f: pl.Utf8 for f in LookupResult.__struct_fields__})
    frame = pl.DataFrame(rows)
    return frame.with_columns(pl.col("verdict").cast(pl.Utf8), pl.col("reason").cast(pl.Utf8))


def frame_results(frame: pl.DataFrame) -> list[LookupResult]:
    """The lookups of a results frame as typed values again (the inverse of results_frame)."""
    return msgspec.convert(frame.to_dicts(), list[LookupResult], strict=False)


def users(frame: pl.DataFrame) -> pl.DataFrame:
    """The lookups of users' requests: a correctness canary's re-runs are left out of rates."""
    if not frame.height:
        return frame
    return frame.filter(~pl.col("request_id").str.starts_with(PROBE_PREFIX))


def admitted(frame: pl.DataFrame, first: bool) -> pl.Expr:
    """Lookups adopted at a request's first admission (`first`), or at a re-admission after a
    preemption. A frame without the column (made by hand) holds first admissions only."""
    adopted = pl.col("adopt_seen") if "adopt_seen" in frame.columns else pl.lit(True)
    if "preemptions" not in frame.columns:
        return adopted & pl.lit(first)
    return adopted & ((pl.col("preemptions") == 0) if first else (pl.col("preemptions") > 0))


def of_counted(frame: pl.DataFrame, column: str) -> pl.Expr:
    """`column` of the lookups `counted` keeps, for aggregations beside others over every lookup."""
    return pl.col(column).filter(admitted(frame, first=True))


def counted(frame: pl.DataFrame) -> pl.DataFrame:
    """The lookups an engine counts in its prefix-cache hit rate: users' requests at their first
    admission, with the adopt that admitted them. A request preempted and admitted again looks
    up again, and vLLM keeps those lookups apart (`PrefixCacheStats.preempted_*`, not in its
    `prefix_cache_queries`); a lookup the scheduler made while the request waited for room is
    followed by the one it was admitted on, and counted by no engine."""
    frame = users(frame)
    return frame.filter(admitted(frame, first=True)) if frame.height else frame


def funnel(frame: pl.DataFrame, by: Sequence[str] = (), bucket_ns: int = 0) -> pl.DataFrame:
    """Logical, recoverable, resident and adopted hit rates, token- and request-weighted, over
    the lookups the engine counts (`counted`), so the adopted rate is the engine's own hit rate.

    Token rates divide by prompt tokens; request rates are the share of lookups with a
    non-zero hit of each kind. The alarms (unsafe, missed, cross-tenant reuse) count every
    adopted lookup, re-admissions too: a wrong reuse on resume is as wrong. `readmissions`
    counts those (see `preemption`). `bucket_ns` > 0 adds a time bucket to the grouping.
    """
    keys = list(by)
    frame = users(frame)
    if bucket_ns:
        frame = frame.with_columns((pl.col("ts_ns") // bucket_ns * bucket_ns).alias("bucket_ns"))
        keys.append("bucket_ns")
    def of(column: str) -> pl.Expr:
        return of_counted(frame, column)

    prompt = of("prompt_tokens").sum()
    aggs = [
        admitted(frame, first=True).sum().alias("lookups"),
        prompt.alias("prompt_tokens"),
        *(
            (of(f"{name}_hit_tokens").sum() / prompt).alias(f"{name}_token_rate")
            for name in ("logical", "recoverable", "resident")
        ),
        (of("adopted_tokens").sum() / prompt).alias("adopted_token_rate"),
        *(
            (of(f"{name}_hit_tokens") > 0).mean().alias(f"{name}_request_rate")
            for name in ("logical", "recoverable", "resident")
        ),
        (of("adopted_tokens") > 0).mean().alias("adopted_request_rate"),
        ((of("logical_hit_tokens") - of("recoverable_hit_tokens")).sum() / prompt).alias("divergence"),
        pl.col("unsafe_reuse").sum().alias("unsafe_reuse"),
        pl.col("missed_reuse").sum().alias("missed_reuse"),
        pl.col("cross_tenant").sum().alias("cross_tenant"),
        admitted(frame, first=False).sum().alias("readmissions"),
    ]
    if not keys:
        return frame.select(aggs)
    return frame.group_by(keys).agg(aggs).sort(keys)


def preemption(frame: pl.DataFrame, by: Sequence[str] = ()) -> pl.DataFrame:
    """What preemption cost, beside the hit rates: the re-admissions (adopted lookups of a
    request after a preemption), the requests preempted, the tokens they reused on resume, and
    the tokens they computed again: what each had computed when it was preempted, less what it
    reused on resume. Those were freed at the preemption and their blocks taken for other
    requests under the same cache pressure (evicted) before it came back; a re-admission whose
    hash hit was not valid says so in its own gap reason, as any lookup does."""
    frame = users(frame)
    frame = frame.filter(admitted(frame, first=False)) if frame.height else frame
    before = (pl.col("computed_before_preemption") if "computed_before_preemption" in frame.columns
              else pl.col("prompt_tokens")).cast(pl.Int64)
    again = (before - pl.col("adopted_tokens").cast(pl.Int64)).clip(lower_bound=0)
    aggs = [pl.len().alias("readmissions"), pl.col("request_id").n_unique().alias("requests"),
            pl.col("prompt_tokens").cast(pl.Int64).sum().alias("prompt_tokens"),
            pl.col("adopted_tokens").cast(pl.Int64).sum().alias("reused_tokens"),
            again.sum().alias("recomputed_tokens"),
            (pl.col("logical_hit_tokens") - pl.col("recoverable_hit_tokens")).cast(pl.Int64).sum().alias("tokens_lost")]
    if not by:
        return frame.select(aggs)
    return frame.group_by(list(by)).agg(aggs).sort(list(by))


def reasons(frame: pl.DataFrame, by: Sequence[str] = ()) -> pl.DataFrame:
    """Tokens lost between logical and recoverable, per reason (largest first), over the lookups
    the hit rates count (`counted`)."""
    keys = [*by, "reason"]
    return (
        counted(frame).filter(pl.col("reason") != "")
        .group_by(keys)
        .agg(
            pl.len().alias("lookups"),
            (pl.col("logical_hit_tokens") - pl.col("recoverable_hit_tokens")).sum().alias("tokens_lost"),
        )
        .sort("tokens_lost", descending=True)
    )


def restore_bytes(frame: pl.DataFrame, by: Sequence[str] = ()) -> pl.DataFrame:
    """Bytes that restore actions would move, per source tier."""
    cols = [pl.col(f"restore_{t}_bytes").sum() for t in ("host", "disk", "remote")]
    return frame.select(cols) if not by else frame.group_by(list(by)).agg(cols).sort(list(by))


FLEET_STAGES = ("never_seen", "seen_not_recoverable", "routing_regret", "local_loss", "adopted")
"""Where a prompt's tokens went, in order; they add up to its prompt tokens (`fleet_funnel`)."""


def fleet_funnel(frame: pl.DataFrame, by: Sequence[str] = ()) -> pl.DataFrame:
    """Prompt tokens split into the fleet stages: never seen anywhere, seen but recoverable
    nowhere, recoverable elsewhere but not here (routing regret), recoverable here but not
    adopted (local loss), and adopted within what was recoverable. Unsafe reuse (adopted past
    recoverable) is counted as its own column, not as a stage."""
    here = pl.col("recoverable_anywhere_tokens") - pl.col("routing_regret_tokens")  # at the lookup
    safe = pl.min_horizontal(pl.col("adopted_tokens"), here)
    stages = {
        "never_seen": pl.col("prompt_tokens") - pl.col("seen_anywhere_tokens"),
        "seen_not_recoverable": pl.col("seen_anywhere_tokens") - pl.col("recoverable_anywhere_tokens"),
        "routing_regret": pl.col("routing_regret_tokens"),
        "local_loss": here - safe,
        "adopted": safe,
    }
    aggs = [pl.len().alias("lookups"), pl.col("prompt_tokens").sum(),
            *(stages[name].sum().alias(name) for name in FLEET_STAGES),
            (pl.col("routing_regret_tokens") > 0).sum().alias("regretted_lookups"),
            (pl.col("adopted_tokens") - here).clip(lower_bound=0).sum().alias("adopted_past_recoverable")]
    tokens = ("prompt_tokens", "seen_anywhere_tokens", "recoverable_anywhere_tokens", "routing_regret_tokens",
              "adopted_tokens")
    frame = users(frame).with_columns(pl.col(c).cast(pl.Int64) for c in tokens)  # differences, not wrapped
    if not by:
        return frame.select(aggs)
    return frame.group_by(list(by)).agg(aggs).sort(list(by))


def regret_pairs(frame: pl.DataFrame) -> pl.DataFrame:
    """Routing regret by (instance the request was sent to, instance that held more), largest first."""
    return (
        users(frame).filter(pl.col("routing_regret_tokens") > 0)
        .group_by("instance", "best_instance")
        .agg(pl.len().alias("lookups"), pl.col("routing_regret_tokens").sum().alias("regret_tokens"))
        .sort("regret_tokens", "instance", "best_instance", descending=[True, False, False])
    )
