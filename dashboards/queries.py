"""The dashboards' panels, defined once: the web dashboard and the Grafana dashboards run the
same SQL, so they cannot disagree.

Each query is written for Grafana's ClickHouse data source: `$__fromTime` / `$__toTime` (the
plugin expands them to `toDateTime(<unix seconds>)`), `$__interval_s`, and the dashboard
variables `${model}`, `${instance}`, `${tenant}`, `${engine}` (empty means all). `render` makes
the same substitutions for the web dashboard and for tests, escaping values as literals.
Everything aggregates inside the store: pages stay fast on tens of millions of events.
Quantiles are ClickHouse's deterministic sampling ones, so two readers of the same rows (the
web page and Grafana) show the same number.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from kvtrace.schema.events import PROBE_PREFIX
from kvtrace.store.client import endings_sql

VARIABLES = ("model", "instance", "tenant", "engine")


class PanelKind(StrEnum):
    TIMESERIES = "timeseries"
    BARS = "bars"
    TABLE = "table"


@dataclass(frozen=True, slots=True)
class Panel:
    key: str
    title: str
    kind: PanelKind
    sql: str  # with Grafana macros and variables; `{db}` is the database
    x: str  # the column plotted along x (or the first table column)
    series: tuple[str, ...]  # value columns, one trace each
    description: str = ""
    group_by: str = ""  # a column whose values split the series (one trace per value)
    right_axis: tuple[str, ...] = ()  # series in another unit, drawn against a second y axis


def filters(table: str) -> str:
    """Time range and variable filters; verdict rows know their engine through their instance."""
    clauses = ["ts_ns >= toUnixTimestamp($__fromTime) * 1000000000",
               "ts_ns < (toUnixTimestamp($__toTime) + 1) * 1000000000",
               "('${model}' = '' OR model = '${model}')",
               "('${instance}' = '' OR instance = '${instance}')",
               "('${tenant}' = '' OR tenant = '${tenant}')"]
    if table == "verdicts":  # a correctness canary's re-runs are not users' traffic
        clauses.append(f"NOT startsWith(request_id, '{PROBE_PREFIX}')")
    if table == "events":
        clauses.append("('${engine}' = '' OR engine = '${engine}')")
    else:
        clauses.append("('${engine}' = '' OR instance IN (SELECT DISTINCT instance FROM {db}.events "
                       "WHERE engine = '${engine}'))")
    return " AND ".join(clauses)


_BUCKET = "toStartOfInterval(fromUnixTimestamp64Nano(ts_ns), toIntervalSecond($__interval_s))"

_ENDED_IN_RANGE = ("ended != '' AND ended_ns >= toUnixTimestamp($__fromTime) * 1000000000 "
                   "AND ended_ns < (toUnixTimestamp($__toTime) + 1) * 1000000000 "
                   "AND ('${instance}' = '' OR instance = '${instance}') "
                   "AND ('${engine}' = '' OR engine = '${engine}')")

PANELS: tuple[Panel, ...] = (
    Panel(
        key="funnel", title="Hit funnel: logical -> recoverable -> resident -> adopted (share of prompt tokens)",
        kind=PanelKind.TIMESERIES, x="time",
        series=("logical", "recoverable", "resident", "adopted", "divergence"),
        description="Logical above recoverable is recompute the hash hit hides; adopted above recoverable is "
                    "reuse of state that was not valid.",
        sql=f"SELECT {_BUCKET} AS time, "
            "sum(logical_hit_tokens) / sum(prompt_tokens) AS logical, "
            "sum(recoverable_hit_tokens) / sum(prompt_tokens) AS recoverable, "
            "sum(resident_hit_tokens) / sum(prompt_tokens) AS resident, "
            "sum(adopted_tokens) / sum(prompt_tokens) AS adopted, "
            "(sum(logical_hit_tokens) - sum(recoverable_hit_tokens)) / sum(prompt_tokens) AS divergence "
            f"FROM {{db}}.verdicts FINAL WHERE {filters('verdicts')} GROUP BY time ORDER BY time"),
    Panel(
        key="reasons", title="Why the gap: tokens lost between logical and recoverable, by reason and group",
        kind=PanelKind.BARS, x="reason", series=("tokens_lost",), group_by="group",
        sql="SELECT reason, toString(reason_group) AS group, "
            "sum(logical_hit_tokens - recoverable_hit_tokens) AS tokens_lost, count() AS lookups "
            f"FROM {{db}}.verdicts FINAL WHERE reason != '' AND {filters('verdicts')} "
            "GROUP BY reason, group ORDER BY tokens_lost DESC"),
    Panel(
        key="restore", title="Why the gap, by tier: tokens recoverable only by restoring, and bytes to move",
        kind=PanelKind.BARS, x="tier", series=("tokens", "gib"), right_axis=("gib",),
        description="Recoverable but not resident: the state exists, on a lower tier; using it costs a load.",
        sql="SELECT tier, tokens, gib FROM (SELECT "
            "sumIf(recoverable_hit_tokens - resident_hit_tokens, restore_host_bytes > 0) AS host_t, "
            "sumIf(recoverable_hit_tokens - resident_hit_tokens, restore_disk_bytes > 0) AS disk_t, "
            "sumIf(recoverable_hit_tokens - resident_hit_tokens, restore_remote_bytes > 0) AS remote_t, "
            "sum(restore_host_bytes) / 1073741824 AS host_b, sum(restore_disk_bytes) / 1073741824 AS disk_b, "
            "sum(restore_remote_bytes) / 1073741824 AS remote_b "
            f"FROM {{db}}.verdicts FINAL WHERE {filters('verdicts')}) "
            "ARRAY JOIN ['host', 'disk', 'remote'] AS tier, [host_t, disk_t, remote_t] AS tokens, "
            "[host_b, disk_b, remote_b] AS gib WHERE tokens > 0 OR gib > 0 ORDER BY tier"),
    Panel(
        key="unsafe", title="Unsafe reuse: requests that adopted beyond what was recoverable",
        kind=PanelKind.TABLE, x="time",
        series=("instance", "request_id", "model", "tenant", "logical_hit_tokens", "recoverable_hit_tokens",
                "adopted_tokens", "reason", "reason_detail"),
        sql="SELECT fromUnixTimestamp64Nano(ts_ns) AS time, instance, request_id, model, tenant, "
            "logical_hit_tokens, recoverable_hit_tokens, adopted_tokens, reason, reason_detail "
            f"FROM {{db}}.verdicts FINAL WHERE unsafe_reuse AND {filters('verdicts')} ORDER BY ts_ns DESC LIMIT 500"),
    Panel(
        key="verify", title="Verified by re-execution: did reuse give what recompute gives?",
        kind=PanelKind.TABLE, x="time",
        series=("instance", "request_id", "model", "verdict", "agreement", "adopted_tokens", "max_abs_diff",
                "noise_floor", "detail"),
        description="`kvtrace verify` and the engine canary (KVTRACE_VERIFY_RATE) re-run sampled requests with the "
                    "prefix cache bypassed. recoverable_diverged "
                    "is a reuse bug or an identity field kvtrace does not track; unsafe_diverged confirms an alarm; "
                    "unsafe_identical says an alarm was conservative.",
        sql="SELECT fromUnixTimestamp64Nano(ts_ns) AS time, instance, request_id, model, verdict, agreement, "
            "adopted_tokens, max_abs_diff, noise_floor, detail "
            f"FROM {{db}}.verifications WHERE {filters('verifications')} ORDER BY ts_ns DESC, request_id "
            "LIMIT 1 BY instance, ts_ns, request_id LIMIT 500"),
    Panel(
        key="tiers", title="Tier occupancy: bytes resident on each tier (GiB)",
        kind=PanelKind.TIMESERIES, x="time", series=("resident_gib", "in_flight_gib"), group_by="tier",
        description="Resident is every committed or transferred-in byte minus every evicted one, counted from the "
                    "start of the stream; in flight is what loads still running at admission were moving. How much "
                    "is locked by running requests and how much is free needs the engine's allocator state, which "
                    "no event carries yet.",
        sql="SELECT time, tier, resident_gib, in_flight_gib FROM (SELECT time, tier, "
            "sum(delta) OVER (PARTITION BY tier ORDER BY time) / 1073741824 AS resident_gib, "
            "in_flight / 1073741824 AS in_flight_gib FROM (SELECT "
            f"{_BUCKET} AS time, if(kind IN ('offload', 'load'), dst_tier, tier) AS tier, "
            "sum(if(kind = 'evict', -1, 1) * nbytes * (1 + length(more_keys))) AS delta, "
            "sumIf(nbytes * (1 + length(more_keys)), kind = 'load' AND in_flight) AS in_flight "
            "FROM {db}.events FINAL WHERE kind IN ('commit', 'offload', 'load', 'evict') "
            "AND ts_ns < (toUnixTimestamp($__toTime) + 1) * 1000000000 "
            "AND ('${model}' = '' OR model = '${model}') AND ('${instance}' = '' OR instance = '${instance}') "
            "AND ('${tenant}' = '' OR tenant = '${tenant}') AND ('${engine}' = '' OR engine = '${engine}') "
            "GROUP BY time, tier)) WHERE time >= $__fromTime ORDER BY time, tier"),
    Panel(
        key="usage", title="Tier usage: locked by running requests, evictable cache, free (GiB)",
        kind=PanelKind.TIMESERIES, x="time", series=("locked_gib", "evictable_gib", "free_gib"), group_by="tier",
        description="From the usage samples engines report: per bucket, each instance's last sample, summed over "
                    "instances.",
        sql="SELECT time, tier, sum(locked) / 1073741824 AS locked_gib, sum(evictable) / 1073741824 AS evictable_gib, "
            "sum(free) / 1073741824 AS free_gib FROM (SELECT "
            f"{_BUCKET} AS time, instance, tier, argMax(locked_bytes, ts_ns) AS locked, "
            "argMax(evictable_bytes, ts_ns) AS evictable, argMax(free_bytes, ts_ns) AS free "
            f"FROM {{db}}.events FINAL WHERE kind = 'usage' AND {filters('events')} GROUP BY time, instance, tier) "
            "GROUP BY time, tier ORDER BY time, tier"),
    Panel(
        key="transfers", title="Lifecycle timings: transfer time per tier path (p50 and p99)",
        kind=PanelKind.BARS, x="path", series=("p50_ms", "p99_ms"),
        sql="SELECT concat(src_tier, ' -> ', dst_tier) AS path, count() AS transfers, "
            "quantileDeterministic(0.5)(duration_ns, block_key) / 1e6 AS p50_ms, "
            "quantileDeterministic(0.99)(duration_ns, block_key) / 1e6 AS p99_ms "
            f"FROM {{db}}.events FINAL WHERE kind IN ('load', 'offload') AND duration_ns > 0 AND {filters('events')} "
            "GROUP BY path ORDER BY path"),
    Panel(
        key="residency", title="Lifecycle timings: how long a block stays on a tier before eviction (seconds)",
        kind=PanelKind.BARS, x="tier", series=("p50_s", "p90_s", "p99_s"),
        description="From a fixed 1/16 sample of block keys (the same blocks every time): matching each eviction "
                    "to its write is a join, and the distribution needs no more.",
        sql="SELECT e.tier AS tier, count() * 16 AS evictions, "
            "quantileDeterministic(0.5)(e.ts_ns - w.ts_ns, e.block_key) / 1e9 AS p50_s, "
            "quantileDeterministic(0.9)(e.ts_ns - w.ts_ns, e.block_key) / 1e9 AS p90_s, "
            "quantileDeterministic(0.99)(e.ts_ns - w.ts_ns, e.block_key) / 1e9 AS p99_s "
            f"FROM (SELECT tier, group_id, block_key, ts_ns FROM {{db}}.events FINAL WHERE kind = 'evict' "
            f"AND cityHash64(block_key) % 16 = 0 AND {filters('events')}) AS e "
            "ASOF JOIN (SELECT if(kind IN ('offload', 'load'), dst_tier, tier) AS tier, group_id, block_key, ts_ns "
            "FROM {db}.events FINAL WHERE kind IN ('create', 'commit', 'offload', 'load') "
            "AND cityHash64(block_key) % 16 = 0 AND ts_ns < (toUnixTimestamp($__toTime) + 1) * 1000000000) AS w "
            "ON e.tier = w.tier AND e.group_id = w.group_id AND e.block_key = w.block_key AND e.ts_ns >= w.ts_ns "
            "GROUP BY tier ORDER BY tier"),
    Panel(
        key="endings", title="Emitters that ended: unclean (the process died first) or clean, with their gap",
        kind=PanelKind.TABLE, x="time",
        series=("instance", "engine", "ended", "source", "emitted", "stored", "missing", "dropped", "recovered"),
        description="An engine process killed (SIGKILL, OOM, a process-tree kill) ends its emitter unclean: the "
                    "shipper sends its last counters. missing is its sequence gap, events it numbered that the "
                    "store does not hold; dropped is how many of them it counted as dropped; recovered is what "
                    "was shipped from its journal after it died. Model and tenant filters do not apply.",
        sql="SELECT fromUnixTimestamp64Nano(ended_ns) AS time, instance, engine, ended, "
            "lower(leftPad(hex(source_id), 16, '0')) AS source, emitted, stored, missing, dropped, recovered "
            f"FROM ({endings_sql('{db}', having=_ENDED_IN_RANGE)}) "
            "ORDER BY ended = 'unclean' DESC, ended_ns DESC, source_id LIMIT 500"),
)


def by_key(key: str) -> Panel:
    for p in PANELS:
        if p.key == key:
            return p
    raise KeyError(key)


def _literal(value: str) -> str:
    return value.replace("\\", "\\\\").replace("'", "\\'")


def render(panel: Panel, db: str, from_s: int, to_s: int, interval_s: int = 60,
           variables: dict[str, str] | None = None) -> str:
    """The panel's SQL as Grafana's ClickHouse plugin would send it, for these settings."""
    return substitute(panel.sql, db, from_s, to_s, interval_s, variables)


def substitute(text: str, db: str, from_s: int, to_s: int, interval_s: int = 60,
               variables: dict[str, str] | None = None) -> str:
    values = {name: "" for name in VARIABLES} | (variables or {})
    sql = text.replace("{db}", db)
    sql = sql.replace("$__fromTime", f"toDateTime({int(from_s)})").replace("$__toTime", f"toDateTime({int(to_s)})")
    sql = sql.replace("$__interval_s", str(max(1, int(interval_s))))
    sql = re.sub(r"\$\{(\w+)\}", lambda m: _literal(values.get(m.group(1), "")), sql)
    return sql
