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


def funnel(frame: pl.DataFrame, by: Sequence[str] = (), bucket_ns: int = 0) -> pl.DataFrame:
    """Logical, recoverable, resident and adopted hit rates, token- and request-weighted.

    Token rates divide by prompt tokens; request rates are the share of lookups with a
    non-zero hit of each kind. `bucket_ns` > 0 adds a time bucket to the grouping.
    """
    keys = list(by)
    frame = users(frame)
    if bucket_ns:
        frame = frame.with_columns((pl.col("ts_ns") // bucket_ns * bucket_ns).alias("bucket_ns"))
        keys.append("bucket_ns")
    prompt = pl.col("prompt_tokens").sum()
    aggs = [
        pl.len().alias("lookups"),
        prompt.alias("prompt_tokens"),
        *(
            (pl.col(f"{name}_hit_tokens").sum() / prompt).alias(f"{name}_token_rate")
            for name in ("logical", "recoverable", "resident")
        ),
        (pl.col("adopted_tokens").sum() / prompt).alias("adopted_token_rate"),
        *(
            (pl.col(f"{name}_hit_tokens") > 0).mean().alias(f"{name}_request_rate")
            for name in ("logical", "recoverable", "resident")
        ),
        (pl.col("adopted_tokens") > 0).mean().alias("adopted_request_rate"),
        ((pl.col("logical_hit_tokens") - pl.col("recoverable_hit_tokens")).sum() / prompt).alias("divergence"),
        pl.col("unsafe_reuse").sum().alias("unsafe_reuse"),
        pl.col("missed_reuse").sum().alias("missed_reuse"),
        pl.col("cross_tenant").sum().alias("cross_tenant"),
    ]
    if not keys:
        return frame.select(aggs)
    return frame.group_by(keys).agg(aggs).sort(keys)


def reasons(frame: pl.DataFrame, by: Sequence[str] = ()) -> pl.DataFrame:
    """Tokens lost between logical and recoverable, per reason (largest first)."""
    keys = [*by, "reason"]
    return (
        users(frame).filter(pl.col("reason") != "")
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
