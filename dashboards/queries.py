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
from kvtrace.schema.verdicts import COUNTED_SQL, READMITTED_SQL
from kvtrace.store.client import endings_sql

VARIABLES = ("model", "instance", "tenant", "engine")


class PanelKind(StrEnum):
    TIMESERIES = "timeseries"
    BARS = "bars"
    TABLE = "table"
    STAT = "stat"  # one row of headline numbers: a tile per series


class Unit(StrEnum):
    """What a panel's numbers are, named once for both dashboards (each spells it its own way)."""

    SHARE = "share"  # a fraction 0..1 of prompt tokens, shown as a percent
    TOKENS = "tokens"
    GIB = "GiB"
    SECONDS = "s"
    MILLISECONDS = "ms"
    MICROSECONDS = "µs"
    COUNT = "count"


class Source(StrEnum):
    """The rows a panel reads: when it comes back empty, what is missing and what writes it."""

    VERDICTS = "verdicts"  # `kvtrace analyze --write-verdicts`, or the collector's live verdicts
    EVENTS = "events"  # lifecycle events from an engine shim or `kvtrace ingest`
    TIMED = "timed"  # loads, offloads and adopts that report their duration
    USAGE = "usage"  # the engines' tier usage samples
    VERIFICATIONS = "verifications"  # `kvtrace verify` or the engine canary
    EMITTERS = "emitters"  # emitters' end-of-life counters


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
    unit: Unit = Unit.COUNT  # of the series on the left axis
    right_unit: Unit = Unit.COUNT
    y_title: str = ""  # what the left axis measures; the unit is appended
    x_title: str = ""
    labels: tuple[tuple[str, str], ...] = ()  # column -> the name a reader sees in legends and tiles
    facet: bool = False  # one small chart per group_by value (the web page), instead of one chart
    stacked: bool = False  # the series add up to a whole (e.g. a tier's capacity)
    source: Source = Source.EVENTS
    zero_is_good: bool = False  # no rows is the good answer (no unsafe reuse), not missing data
    when_empty: str = ""  # what no rows means when the rows it reads exist (e.g. no load was in flight)
    log_scale: bool = False  # values span orders of magnitude (a load's and a recompute's cost per token)

    def label(self, column: str) -> str:
        return dict(self.labels).get(column, column.replace("_", " "))

    def y_axis(self) -> str:
        return axis_title(self.y_title or self.label(self.series[0]), self.unit)

    def right_y_axis(self) -> str:
        return axis_title(" and ".join(self.label(c) for c in self.right_axis), self.right_unit)


def axis_title(title: str, unit: Unit) -> str:
    """An axis title with its unit, as both dashboards print it: "share of prompt tokens (%)"."""
    return f"{title} ({'%' if unit is Unit.SHARE else unit.value})"


ALL = "__all"  # what Grafana's variables send for "All" (an empty value is not sent verbatim)


def _any(name: str, column: str = "") -> str:
    """A variable filter that an empty value or Grafana's "All" turns off."""
    return f"('${{{name}}}' IN ('', '{ALL}') OR {column or name} = '${{{name}}}')"


def filters(table: str, counted: bool = True) -> str:
    """Time range and variable filters; verdict rows know their engine through their instance.
    Verdicts are the lookups the hit rates count, unless `counted` is False (every lookup:
    unsafe reuse on a re-admission is as wrong)."""
    clauses = ["ts_ns >= toUnixTimestamp($__fromTime) * 1000000000",
               "ts_ns < (toUnixTimestamp($__toTime) + 1) * 1000000000",
               _any("model"), _any("instance"), _any("tenant")]
    if table == "verdicts":  # a correctness canary's re-runs are not users' traffic
        clauses.append(f"NOT startsWith(request_id, '{PROBE_PREFIX}')")
        if counted:
            clauses.append(COUNTED_SQL)
    if table == "events":
        clauses.append(_any("engine"))
    else:
        clauses.append(f"('${{engine}}' IN ('', '{ALL}') OR instance IN (SELECT DISTINCT instance FROM {{db}}.events "
                       "WHERE engine = '${engine}'))")
    return " AND ".join(clauses)


_BUCKET = "toStartOfInterval(fromUnixTimestamp64Nano(ts_ns), toIntervalSecond($__interval_s))"

_ENDED_IN_RANGE = ("ended != '' AND ended_ns >= toUnixTimestamp($__fromTime) * 1000000000 "
                   "AND ended_ns < (toUnixTimestamp($__toTime) + 1) * 1000000000 "
                   f"AND {_any('instance')} AND {_any('engine')}")

_FUNNEL_LABELS = (("logical", "logical (hash hit)"), ("recoverable", "recoverable (valid state)"),
                  ("resident", "resident (no restore needed)"), ("adopted", "adopted (engine reused)"),
                  ("divergence", "gap (logical - recoverable)"))

_VERDICT_MEANINGS = (("HIT", "HIT: the whole hash hit usable as is"),
                     ("PARTIAL", "PARTIAL: a hash hit that needs a restore or a recompute first"),
                     ("MISS", "MISS: no hash hit"))

_IN_RANGE_TO = "ts_ns < (toUnixTimestamp($__toTime) + 1) * 1000000000"

_LOAD_POSITION = "token_start"
_ADOPT_POSITION = "arraySum(reused_tokens)"


def _counted_share(column: str) -> str:
    """`column` as a share of prompt tokens, over the lookups the engine counts."""
    return f"sumIf({column}, {COUNTED_SQL}) / nullIf(sumIf(prompt_tokens, {COUNTED_SQL}), 0)"


def _position_bucket(position: str) -> str:
    """Context positions in powers of two from 256 tokens: the cost of a token grows with its depth."""
    return f"toUInt64(if({position} < 256, 0, exp2(floor(log2({position})))))"


PANELS: tuple[Panel, ...] = (
    Panel(
        key="headline", title="Headline", kind=PanelKind.STAT, x="lookups",
        series=("logical_rate", "recoverable_rate", "adopted_rate", "tokens_lost", "unsafe_reuses", "readmissions"),
        labels=(("logical_rate", "Logical hit rate"), ("recoverable_rate", "Recoverable hit rate"),
                ("adopted_rate", "Adopted hit rate"), ("tokens_lost", "Tokens lost (logical - recoverable)"),
                ("unsafe_reuses", "Unsafe reuses"), ("readmissions", "Re-admissions after preemption")),
        description="Shares of prompt tokens over the whole range, counted as the engine counts them (each request "
                    "once, at its first admission); tokens lost are hash hits whose state was not valid, recomputed "
                    "although the hash matched; an unsafe reuse adopted more than was recoverable (re-admissions "
                    "too); a re-admission is a request preempted and admitted again (Preemption says what it cost).",
        source=Source.VERDICTS,
        sql=f"SELECT countIf({COUNTED_SQL}) AS lookups, {_counted_share('logical_hit_tokens')} AS logical_rate, "
            f"{_counted_share('recoverable_hit_tokens')} AS recoverable_rate, "
            f"{_counted_share('adopted_tokens')} AS adopted_rate, "
            f"toInt64(sumIf(logical_hit_tokens, {COUNTED_SQL})) "
            f"- toInt64(sumIf(recoverable_hit_tokens, {COUNTED_SQL})) AS tokens_lost, "
            f"countIf(unsafe_reuse) AS unsafe_reuses, countIf({READMITTED_SQL}) AS readmissions "
            f"FROM {{db}}.verdicts FINAL WHERE {filters('verdicts', counted=False)}"),
    Panel(
        key="funnel", title="Hit funnel: logical -> recoverable -> resident -> adopted (share of prompt tokens)",
        kind=PanelKind.TIMESERIES, x="time",
        series=("logical", "recoverable", "resident", "adopted", "divergence"),
        unit=Unit.SHARE, y_title="share of prompt tokens", x_title="time (UTC)", labels=_FUNNEL_LABELS,
        source=Source.VERDICTS,
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
        key="verdicts", title="Verdicts: lookups by HIT, PARTIAL and MISS",
        kind=PanelKind.BARS, x="verdict", series=("lookups",), unit=Unit.COUNT, y_title="lookups",
        x_title="verdict", labels=(("lookups", "lookups"), *_VERDICT_MEANINGS), source=Source.VERDICTS,
        description="HIT: the whole (aligned) hash hit is recoverable with nothing to restore. PARTIAL: a hash hit "
                    "that needs a restore or a recompute before use (Why the gap says which). MISS: no hash hit. "
                    "Unsafe reuse is a separate flag.",
        sql="SELECT verdict, lookups FROM (SELECT countIf(verdict = 'HIT') AS hit, "
            "countIf(verdict = 'PARTIAL') AS partial, countIf(verdict = 'MISS') AS miss, count() AS n "
            f"FROM {{db}}.verdicts FINAL WHERE {filters('verdicts')}) "
            "ARRAY JOIN ['HIT', 'PARTIAL', 'MISS'] AS verdict, [hit, partial, miss] AS lookups WHERE n > 0"),
    Panel(
        key="reasons", title="Why the gap: tokens lost between logical and recoverable, by reason and group",
        kind=PanelKind.BARS, x="reason", series=("tokens_lost",), group_by="group", unit=Unit.TOKENS,
        y_title="tokens lost", x_title="reason", labels=(("tokens_lost", "tokens lost"),), source=Source.VERDICTS,
        when_empty="None: every hash hit in this range was recoverable up to its aligned boundary.",
        sql="SELECT reason, toString(reason_group) AS group, "
            "sum(logical_hit_tokens - recoverable_hit_tokens) AS tokens_lost, count() AS lookups "
            f"FROM {{db}}.verdicts FINAL WHERE reason != '' AND {filters('verdicts')} "
            "GROUP BY reason, group ORDER BY tokens_lost DESC"),
    Panel(
        key="restore", title="Why the gap, by tier: tokens recoverable only by restoring, and bytes to move",
        kind=PanelKind.BARS, x="tier", series=("tokens", "gib"), right_axis=("gib",), unit=Unit.TOKENS,
        right_unit=Unit.GIB, y_title="tokens to restore", x_title="tier the state is on",
        labels=(("tokens", "tokens to restore"), ("gib", "bytes to move")), source=Source.VERDICTS,
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
        key="fleet", title="Fleet: where each prompt token went, from never seen anywhere to adopted",
        kind=PanelKind.BARS, x="stage", series=("tokens",), unit=Unit.TOKENS, y_title="prompt tokens",
        x_title="stage", labels=(("tokens", "tokens"),), source=Source.VERDICTS,
        description="Never seen: no instance of the model held it by hash. Seen, not recoverable: held, but not "
                    "complete and valid on any instance. Routing regret: recoverable on another instance, not on "
                    "the one the router chose. Local loss: recoverable here, not adopted. The stages add up to the "
                    "prompt tokens. Judged with the fleet view (`kvtrace analyze --fleet --write-verdicts`); "
                    "without it every instance is its own fleet and the regret is 0.",
        sql="SELECT stage, tokens FROM (SELECT sum(prompt_tokens) - sum(seen_anywhere_tokens) AS never, "
            "sum(seen_anywhere_tokens) - sum(recoverable_anywhere_tokens) AS unrecoverable, "
            "sum(routing_regret_tokens) AS regret, "
            "sum(recoverable_anywhere_tokens - routing_regret_tokens "
            "- least(adopted_tokens, recoverable_anywhere_tokens - routing_regret_tokens)) AS local, "
            "sum(least(adopted_tokens, recoverable_anywhere_tokens - routing_regret_tokens)) AS adopted, "
            f"count() AS n FROM {{db}}.verdicts FINAL WHERE {filters('verdicts')}) "
            "ARRAY JOIN ['never seen', 'seen, not recoverable', 'routing regret', 'local loss', 'adopted'] AS stage, "
            "[toInt64(never), toInt64(unrecoverable), toInt64(regret), toInt64(local), toInt64(adopted)] AS tokens "
            "WHERE n > 0"),
    Panel(
        key="regret", title="Routing regret over time: share of prompt tokens recoverable on another instance",
        kind=PanelKind.TIMESERIES, x="time", series=("routing_regret", "seen_not_recoverable"), unit=Unit.SHARE,
        y_title="share of prompt tokens", x_title="time (UTC)",
        labels=(("routing_regret", "routing regret (recoverable elsewhere)"),
                ("seen_not_recoverable", "seen somewhere, recoverable nowhere")),
        source=Source.VERDICTS,
        sql=f"SELECT {_BUCKET} AS time, sum(routing_regret_tokens) / sum(prompt_tokens) AS routing_regret, "
            "(sum(seen_anywhere_tokens) - sum(recoverable_anywhere_tokens)) / sum(prompt_tokens) "
            "AS seen_not_recoverable "
            f"FROM {{db}}.verdicts FINAL WHERE {filters('verdicts')} GROUP BY time ORDER BY time"),
    Panel(
        key="regret_pairs", title="Routing regret by instance pair: sent to, and where more was recoverable",
        kind=PanelKind.BARS, x="pair", series=("regret_tokens",), unit=Unit.TOKENS, y_title="tokens of regret",
        x_title="sent to -> best instance", labels=(("regret_tokens", "routing regret"),), source=Source.VERDICTS,
        when_empty="None: no request in this range could have reused more on another instance (or its verdicts "
                   "were judged without the fleet view: `kvtrace analyze --fleet --write-verdicts`).",
        sql="SELECT concat(instance, ' -> ', best_instance) AS pair, sum(routing_regret_tokens) AS regret_tokens, "
            "count() AS lookups "
            f"FROM {{db}}.verdicts FINAL WHERE routing_regret_tokens > 0 AND {filters('verdicts')} "
            "GROUP BY pair ORDER BY regret_tokens DESC, pair LIMIT 50"),
    Panel(
        key="unsafe", title="Unsafe reuse: requests that adopted beyond what was recoverable",
        kind=PanelKind.TABLE, x="time", source=Source.VERDICTS, zero_is_good=True,
        series=("instance", "request_id", "model", "tenant", "logical_hit_tokens", "recoverable_hit_tokens",
                "adopted_tokens", "reason", "reason_detail"),
        sql="SELECT fromUnixTimestamp64Nano(ts_ns) AS time, instance, request_id, model, tenant, "
            "logical_hit_tokens, recoverable_hit_tokens, adopted_tokens, reason, reason_detail "
            f"FROM {{db}}.verdicts FINAL WHERE unsafe_reuse AND {filters('verdicts', counted=False)} "
            "ORDER BY ts_ns DESC LIMIT 500"),
    Panel(
        key="preemption", title="Preemption: what requests preempted and admitted again reused and computed again",
        kind=PanelKind.BARS, x="readmitted_on", series=("reused_tokens", "recomputed_tokens"),
        unit=Unit.TOKENS, y_title="tokens on resume", x_title="instance (re-admissions)",
        labels=(("reused_tokens", "reused on resume"), ("recomputed_tokens", "computed again (evicted meanwhile)")),
        source=Source.VERDICTS,
        description="A request preempted under cache pressure frees its blocks; admitted again, it reuses those "
                    "still cached and computes again what it had computed before whose blocks were taken for "
                    "other requests meanwhile. Engines keep these lookups out of their hit rates, and so do the "
                    "rates above.",
        when_empty="None: no request in this range was preempted and admitted again.",
        sql="SELECT concat(instance, ' (', toString(count()), ')') AS readmitted_on, count() AS readmissions, "
            "sum(adopted_tokens) AS reused_tokens, "
            "sum(greatest(toInt64(computed_before_preemption) - toInt64(adopted_tokens), 0)) AS recomputed_tokens "
            f"FROM {{db}}.verdicts FINAL WHERE {READMITTED_SQL} AND {filters('verdicts', counted=False)} "
            "GROUP BY instance ORDER BY readmitted_on"),
    Panel(
        key="verify", title="Verified by re-execution: did reuse give what recompute gives?",
        kind=PanelKind.TABLE, x="time", source=Source.VERIFICATIONS,
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
        key="usage", title="Tier usage reported by the engines: locked, evictable, free",
        kind=PanelKind.TIMESERIES, x="time", series=("locked_gib", "evictable_gib", "free_gib"), group_by="tier",
        unit=Unit.GIB, y_title="bytes", x_title="time (UTC)", facet=True, stacked=True, source=Source.USAGE,
        labels=(("locked_gib", "locked by running requests"), ("evictable_gib", "evictable cache"),
                ("free_gib", "free")),
        description="One chart per tier, from the usage samples engines report: per bucket, each instance's last "
                    "sample, summed over instances. Stacked, the three add up to the tier's capacity.",
        sql="SELECT time, tier, sum(locked) / 1073741824 AS locked_gib, sum(evictable) / 1073741824 AS evictable_gib, "
            "sum(free) / 1073741824 AS free_gib FROM (SELECT "
            f"{_BUCKET} AS time, instance, tier, argMax(locked_bytes, ts_ns) AS locked, "
            "argMax(evictable_bytes, ts_ns) AS evictable, argMax(free_bytes, ts_ns) AS free "
            f"FROM {{db}}.events FINAL WHERE kind = 'usage' AND {filters('events')} GROUP BY time, instance, tier) "
            "GROUP BY time, tier ORDER BY time, tier"),
    Panel(
        key="tiers", title="Tier occupancy from lifecycle events: bytes resident on each tier",
        kind=PanelKind.TIMESERIES, x="time", series=("resident_gib",), group_by="tier", unit=Unit.GIB,
        y_title="bytes resident", x_title="time (UTC)", labels=(("resident_gib", "resident"),),
        description="Counted from the events, not reported by the engine: every committed or transferred-in byte "
                    "minus every evicted one, from the start of the stream (events before the range count too). "
                    "One line per tier; where events were lost it drifts from the engines' own usage samples above.",
        sql="SELECT time, tier, resident_gib FROM (SELECT time, tier, "
            "sum(delta) OVER (PARTITION BY tier ORDER BY time) / 1073741824 AS resident_gib FROM (SELECT "
            f"{_BUCKET} AS time, if(kind IN ('offload', 'load'), dst_tier, tier) AS tier, "
            "sum(if(kind = 'evict', -1, 1) * nbytes * (1 + length(more_keys))) AS delta "
            "FROM {db}.events FINAL WHERE kind IN ('commit', 'offload', 'load', 'evict') "
            f"AND {_IN_RANGE_TO} "
            f"AND {_any('model')} AND {_any('instance')} AND {_any('tenant')} AND {_any('engine')} "
            "GROUP BY time, tier)) WHERE time >= $__fromTime ORDER BY time, tier"),
    Panel(
        key="inflight", title="Loads in flight at admission: bytes still moving to each tier",
        kind=PanelKind.TIMESERIES, x="time", series=("in_flight_gib",), group_by="tier", unit=Unit.GIB,
        y_title="bytes in flight", x_title="time (UTC)", labels=(("in_flight_gib", "in flight"),),
        source=Source.TIMED, when_empty="None in flight: every timed load in range had finished when its request "
                                        "was admitted.",
        description="Loads that were still running when their request was admitted (asynchronous restores), "
                    "by the tier they were moving to.",
        sql=f"SELECT {_BUCKET} AS time, dst_tier AS tier, "
            "sum(nbytes * (1 + length(more_keys))) / 1073741824 AS in_flight_gib "
            f"FROM {{db}}.events FINAL WHERE kind = 'load' AND in_flight AND {filters('events')} "
            "GROUP BY time, tier ORDER BY time, tier"),
    Panel(
        key="transfers", title="Lifecycle timings: transfer time per tier path (p50 and p99)",
        kind=PanelKind.BARS, x="path", series=("p50_ms", "p99_ms"), unit=Unit.MILLISECONDS,
        y_title="transfer time", x_title="tier path", labels=(("p50_ms", "p50"), ("p99_ms", "p99")),
        source=Source.TIMED,
        sql="SELECT concat(src_tier, ' -> ', dst_tier) AS path, count() AS transfers, "
            "quantileDeterministic(0.5)(duration_ns, block_key) / 1e6 AS p50_ms, "
            "quantileDeterministic(0.99)(duration_ns, block_key) / 1e6 AS p99_ms "
            f"FROM {{db}}.events FINAL WHERE kind IN ('load', 'offload') AND duration_ns > 0 AND {filters('events')} "
            "GROUP BY path ORDER BY path"),
    Panel(
        key="residency", title="Lifecycle timings: how long a block stays on a tier before eviction",
        kind=PanelKind.BARS, x="tier", series=("p50_s", "p90_s", "p99_s"), unit=Unit.SECONDS,
        y_title="time on tier before eviction", x_title="tier", labels=(("p50_s", "p50"), ("p90_s", "p90"),
                                                                       ("p99_s", "p99")),
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
            f"AND cityHash64(block_key) % 16 = 0 AND {_IN_RANGE_TO}) AS w "
            "ON e.tier = w.tier AND e.group_id = w.group_id AND e.block_key = w.block_key AND e.ts_ns >= w.ts_ns "
            "GROUP BY tier ORDER BY tier"),
    Panel(  # integer sums: a float sum's order (and last digit) varies between runs
        key="loadcost", title="Load vs recompute: measured time per token, restored by tier or recomputed",
        kind=PanelKind.BARS, x="position", series=("us_per_token",), group_by="path", unit=Unit.MICROSECONDS,
        y_title="time per token", x_title="context position: tokens before the span (bucket start)",
        labels=(("us_per_token", "per token"),), source=Source.TIMED, log_scale=True,
        description="Timed loads (seconds over the tokens the loaded blocks cover, by source tier) against timed "
                    "recomputes (an adopt's recompute seconds over its recomputed tokens), in context-position "
                    "buckets of powers of two: where a tier's bar is below recompute's, restoring is cheaper.",
        sql="SELECT position, path, sum(ns) / sum(n) / 1e3 AS us_per_token, sum(n) AS tokens, "
            "count() AS samples FROM ("
            f"SELECT {_position_bucket(_LOAD_POSITION)} AS position, concat('restore from ', src_tier) AS path, "
            "toUInt64(duration_ns) AS ns, toUInt64(token_end - token_start) AS n "
            "FROM {db}.events FINAL WHERE kind = 'load' AND duration_ns > 0 AND token_end > token_start "
            f"AND {filters('events')} UNION ALL "
            f"SELECT {_position_bucket(_ADOPT_POSITION)} AS position, 'recompute' AS path, "
            "toUInt64(duration_ns) AS ns, toUInt64(recomputed_tokens) AS n "
            "FROM {db}.events FINAL WHERE kind = 'adopt' AND duration_ns > 0 AND recomputed_tokens > 0 "
            f"AND {filters('events')}) GROUP BY position, path ORDER BY position, path"),
    Panel(
        key="endings", title="Emitters that ended: unclean (the process died first) or clean, with their gap",
        kind=PanelKind.TABLE, x="time", source=Source.EMITTERS,
        when_empty="No emitter ended in this range: an emitter reports here when it shuts down (clean) or its "
                   "process dies (unclean).",
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


# The pages, in order: each shows the headline tiles, then these panels. The web dashboard has a
# page per entry; the Grafana dashboard a row per entry, so both read the same way.
PAGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "": ("Hit funnel", ("funnel", "verdicts")),
    "gaps": ("Why the gap", ("reasons", "restore")),
    "unsafe": ("Unsafe reuse", ("unsafe", "verify")),
    "preemption": ("Preemption", ("preemption",)),
    "tiers": ("Tiers", ("usage", "tiers", "inflight")),
    "timings": ("Lifecycle timings", ("transfers", "residency")),
    "costs": ("Load vs recompute", ("loadcost",)),
    "fleet": ("Fleet", ("fleet", "regret", "regret_pairs")),
    "health": ("Event streams", ("endings",)),
}


def coverage_sql() -> str:
    """What the store holds for a view, in one row: the web page reads it to say why a panel is
    empty (no events at all, events but no verdicts, no timed loads) rather than "no data"."""
    return (f"SELECT (SELECT count() FROM {{db}}.events WHERE {filters('events')}) AS events, "
            f"(SELECT count() FROM {{db}}.verdicts FINAL WHERE {filters('verdicts', counted=False)}) AS verdicts, "
            f"(SELECT count() FROM {{db}}.events WHERE kind IN ('load', 'offload', 'adopt') AND duration_ns > 0 "
            f"AND {filters('events')}) AS timed, "
            f"(SELECT count() FROM {{db}}.events WHERE kind = 'usage' AND {filters('events')}) AS usage, "
            f"(SELECT count() FROM {{db}}.verifications WHERE {filters('verifications')}) AS verifications, "
            "(SELECT count() FROM {db}.events) AS events_stored")


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
