"""Per-lookup results in SQL: the same answers as the streaming reconstructor, set-at-a-time.

The streaming path replays state; SQL cannot, so the state rules (`analysis.state`) are
written as "the last event of some kind before this point", which is an as-of join:

1. number every event in stream order (`ord`; in ClickHouse without the fleet view, each
   instance's events apart, as nothing else compares two instances' events), expand runs
   (`more_keys`) to one row per block, and give each object event its *life*: the `ord` of the
   last event before it that left the object with no copy (the streaming path forgets an object
   then, so a commit or lease from an earlier life must not count). With it, each object event
   carries the object's *state* after it: the last write on each tier, the last commit and the
   last lease, each with its `ord`. DuckDB computes both with window functions; ClickHouse,
   which runs those on one thread, with one GROUP BY per object and array functions over
   numbers only (event kinds and tiers as small codes, the commit's tenant and identity as one
   hash, read back at the points);
2. pair each lookup with the adopt that follows it for the same request, giving one
   evaluation point at the lookup and one at the adopt;
3. explode each point into the request's blocks per cache group, and as-of join every block
   to its object's state at its last event before the point (one join, not one per tier and
   kind: the point count times the event count is what a fleet-scale run pays for; the
   object's own invalidations are events of it too), plus the bulk invalidations that match it.
   Only the blocks with a state keep a row: one without is missing, and most are (a request's
   new blocks, named by its lookup before it writes them);
4. classify each block (unusable for a reason, usable, resident), then scan the candidate
   boundaries of each point with running "last bad block" indices, which makes every group's
   completeness rule one comparison: the needed blocks [start, p/b) are all usable iff the last
   unusable block below p/b is before start (a gap between two blocks' rows is missing blocks,
   so bad ones).

Every step read twice is materialized (`CREATE TABLE ... AS`), because ClickHouse re-runs a
CTE at each reference; a step read once is a subquery of its reader, as each table of the
blocks' rows costs a full copy. One exception: where every day of the stored table is one
merged part, the events' numbers are where the rows lie, so re-reading them costs a read of the
few columns each reader needs, less than writing all of them once (`_events`). Pass `timings`
to see where a run's time goes, statement by statement (benchmarks/bench_analysis.py prints
them). The statements are written once over a small `Dialect` for the few functions that
differ between ClickHouse and DuckDB (integer division, arrays, explode, ordered lists).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import polars as pl

from kvtrace.analysis.evaluate import Policy
from kvtrace.analysis.state import IDENTITY_FIELDS
from kvtrace.schema.clickhouse import EVENTS
from kvtrace.schema.fields import field_specs
from kvtrace.schema.kinds import TIER_ORDER, ComponentKind, EventKind, Reason, Tier
from kvtrace.schema.recipes import Recipe, RecipeBook, SourceKey, recipe_from_json
from kvtrace.schema.verdicts import MISSING_REASON, GapReason, LookupResult

# -- dialects -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Dialect:
    """The spelling of the few operations ClickHouse and DuckDB write differently."""

    name: str
    database: str = ""  # ClickHouse database for scratch tables
    settings: str = ""  # ClickHouse: the run's SETTINGS clause (see `settings_clause`)

    @property
    def clickhouse(self) -> bool:
        return self.name == "clickhouse"

    def table(self, name: str) -> str:
        return f"{self.database}.{name}" if self.clickhouse else name

    def create_as(self, name: str, select: str) -> str:
        if self.clickhouse:
            return f"CREATE TABLE {self.table(name)} ENGINE = Memory AS {self.with_settings(select)}"
        return f"CREATE TEMP TABLE {name} AS {select}"

    def with_settings(self, select: str) -> str:
        """`select` under the run's settings. A SETTINGS clause at the end of the last SELECT
        of a UNION would be that SELECT's alone, so the statement is wrapped whole."""
        return f"SELECT * FROM ({select}){self.settings}" if self.settings else select

    def create(self, name: str, columns: str) -> str:
        suffix = " ENGINE = Memory" if self.clickhouse else ""
        temp = "" if self.clickhouse else "TEMP "
        return f"CREATE {temp}TABLE {self.table(name)} ({columns}){suffix}"

    def create_keyed(self, name: str, key: str, select: str) -> str:
        """A small table read by `lookup` on its column `key`: ClickHouse's Join engine, a hash
        table built once, then probed per row by `joinGet` (half the time of a JOIN carrying the
        wide rows of millions of events through it)."""
        if self.clickhouse:
            return f"CREATE TABLE {self.table(name)} ENGINE = Join(ANY, LEFT, {key}) AS {self.with_settings(select)}"
        return self.create_as(name, select)

    def lookup(self, name: str, key: str, value: str, of: str) -> str:
        """`value` of the row of the `create_keyed` table whose `key` equals `of` (one exists;
        `of` names its table, or DuckDB reads it as the key itself)."""
        if self.clickhouse:
            return f"joinGet('{self.table(name)}', '{value}', {of})"
        return f"(SELECT k.{value} FROM {name} k WHERE k.{key} = {of})"

    def drop(self, name: str) -> str:
        return f"DROP TABLE IF EXISTS {self.table(name)}"

    def idiv(self, a: str, b: str) -> str:
        return f"intDiv({a}, {b})" if self.clickhouse else f"(({a}) // ({b}))"

    def list_len(self, x: str) -> str:
        return f"length({x})" if self.clickhouse else f"coalesce(len({x}), 0)"

    def list_sum(self, x: str) -> str:
        return f"arraySum({x})" if self.clickhouse else f"coalesce(list_sum({x}), 0)"

    def series(self, start: str, stop: str, step: str) -> str:
        """One row per value of range(start, stop, step), as a select-list expression."""
        if self.clickhouse:
            return f"arrayJoin(range({start}, {stop}, {step}))"
        return f"unnest(range({start}, {stop}, {step}))"

    def explode_list(self, first: str, rest: str) -> str:
        """One row per element of [first, *rest], as a select-list expression."""
        if self.clickhouse:
            return f"arrayJoin(arrayConcat([{first}], {rest}))"
        return f"unnest(list_concat([{first}], {rest}))"

    def ordered_list(self, value: str, order: str) -> str:
        if self.clickhouse:
            return f"arrayMap(t -> t.2, arraySort(groupArray(({order}, {value}))))"
        return f"list({value} ORDER BY {order})"

    def explode_chain(self, select: str, source: str) -> str:
        """`select` plus `key` and 0-based `i` for every element of `chain` in `source`."""
        if self.clickhouse:
            return (f"SELECT {select}, key, toInt64(i1) - 1 AS i FROM {source}"
                    " ARRAY JOIN chain AS key, arrayEnumerate(chain) AS i1")
        return f"SELECT {select}, unnest(chain) AS key, unnest(range(len)) AS i FROM {source}"

    def quote(self, text: str) -> str:
        if self.clickhouse:
            return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"
        return "'" + text.replace("'", "''") + "'"


CLICKHOUSE_SETTINGS = {"join_use_nulls": 1, "allow_experimental_analyzer": 1, "max_block_size": 262144}
"""`max_block_size`: the per-object arrays and the joins work on blocks of 256k rows, not 64k
(10M events, alternating: 4.17-4.38 s against 4.34-4.69 s; 1M-row blocks were slower, 4.75-5.22 s;
32k events unchanged)."""

_JOINS_AS_WRITTEN = {"query_plan_optimize_join_order_limit": 0, "query_plan_join_swap_table": "false"}
"""Each join runs as written, its right side the hash table: the statements put the few rows
there (`fl`, `cd`, `rs` look a few thousand rows up in tables of millions). ClickHouse's join
reordering (25.x on) decides from the sizes of earlier runs of the same statement; a run's
scratch tables are new, so it had none and built its hash tables from the millions: `fl` 0.31-0.44
-> 0.06 s, `cd` 0.43-0.46 -> 0.23-0.25 s, `rs` 0.19-0.23 -> 0.08-0.09 s on 10M events. Sent only
to servers that know them (older ones run joins as written anyway)."""

_NO_JIT = {"compile_expressions": 0, "compile_aggregate_expressions": 0, "compile_sort_description": 0}
"""Expressions are not compiled to machine code: an expression is compiled once it has run a
few times, and a run's ~30 statements, each planned once, pay for compiling and gain little
(an analysis of 32k events 0.47-1.23 s with it, 0.41-0.44 s without; of 10M events 4.19-4.94 s
against 4.21-4.54 s, alternating)."""

_IF_KNOWN = {**_JOINS_AS_WRITTEN, **_NO_JIT}
"""Settings sent only to servers that know them."""


def settings_clause(settings: Mapping[str, int | str]) -> str:
    """Settings as a statement's own SETTINGS clause. Passed to the client instead, the embedded
    engine's client reads, SETs and restores each one around every call (nine statements more
    for four settings): ~3 ms a statement, ~0.25 s of a run's ~60 statements, whatever its size."""
    def value(v: int | str) -> str:
        return str(v) if isinstance(v, int) else "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return (" SETTINGS " + ", ".join(f"{k} = {value(v)}" for k, v in settings.items())) if settings else ""


# -- the statements -------------------------------------------------------------------------------

_IDENTITY_STR = [f for f in IDENTITY_FIELDS if f != "epoch"]
_MISSING_CASE = "CASE comp " + " ".join(
    f"WHEN '{c.value}' THEN '{r.value}'" for c, r in MISSING_REASON.items()
) + " ELSE 'missing_block' END"
_BEYOND = "block beyond the request's key chain"


_EVENT_COLUMNS = ("kind, source_id, seq, instance, tenant, " + ", ".join(_IDENTITY_STR)
                  + ", epoch, group_id, tier, dst_tier, nbytes, checksum, lease_expiry_ns, reason")
"""The stored events' columns that `ev` carries: what the object state, the requests' pairing,
the invalidations and the fleet view read (the request-side lists, and the times, are fetched
for lookups and adopts alone)."""


def _start(d: Dialect, p: str) -> str:
    """First needed block index at boundary p (> 0) for the row's group: `GroupSpec.needed`."""
    return (
        f"(CASE comp WHEN 'sliding_window' THEN {d.idiv(f'greatest({p} - win, 0)', 'b')} "
        f"WHEN 'mamba' THEN {d.idiv(p, 'b')} - 1 "
        f"WHEN 'uncompressed_tail' THEN {d.idiv(d.idiv(p, 'greatest(ratio, 1)') + ' * ratio', 'b')} "
        "ELSE 0 END)"
    )


@dataclass(frozen=True, slots=True)
class _Plan:
    """Names of the scratch tables of one run, unique so runs never collide. `events`: the
    numbered events' SELECT when they are read where they lie rather than written (see
    `_events`)."""

    prefix: str
    events: str = ""

    def __getattr__(self, name: str) -> str:  # plan.ev -> kvt_1a2b_ev
        return f"{self.prefix}_{name}"


def _events(d: Dialect, t: _Plan) -> str:
    """The numbered events (`ev`), as a table or as the SELECT that numbers them in place. Where
    every day is one merged part, numbering costs no sort, so each reader numbers the rows it
    reads instead of `ev` writing all of them first (10M events: `ev` took 0.88-0.95 s of ~5.3,
    most of it the copy of ~25 columns of 10M rows; each reader reads the few columns it needs).
    The readers then read the stored table more than once; a merge or an insert between two of
    their reads fails the later read (`PARTS_MOVED`) and the run starts again, numbering by
    sorting (see `_run`)."""
    return f"({t.events})" if t.events else d.table(t.ev)


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a ClickHouse table's events can be numbered without sorting them (`placed_parts`).
    A merged part (the only one of its partition, level above 0) stores its rows in the sort
    order, de-duplicated: each row's offset there is its place. `parts` gives each such part
    its base (the numbers before it); `days` gives each other partition (several parts, or one
    never merged: `FINAL` must merge them) its base and `span` the numbers each may use, where
    its rows are numbered by sorting. Bases follow the partitions' order, which is time's
    (partitions are days, `schema.clickhouse`)."""

    parts: tuple[tuple[str, int], ...] = ()
    days: tuple[tuple[str, int], ...] = ()
    span: int = 0

    @property
    def merged(self) -> bool:
        """Every day one merged part: every event numbered where it lies."""
        return bool(self.parts) and not self.days


@dataclass(frozen=True, slots=True)
class Placed:
    """The stored events of a ClickHouse `table` (`where` selects them) and their `layout`."""

    table: str
    where: str
    layout: Layout


PARTS_MOVED = "kvtrace: the events table's parts changed during the run"
"""What the in-place numbering raises on a row of a part or partition it was not given, or on
more rows of an unmerged day than its span (merged or written since the parts were listed;
see `_run`)."""


def placed_parts(partitions: Iterable[tuple[str, str, int, int]]) -> Layout:
    """The table's layout from its active parts, (partition, part, level, rows) each. A merged
    partition is numbered in place by the rule ClickHouse's own `FINAL` uses to skip merging
    one (`do_not_merge_across_partitions_select_final`): a merge already de-duplicated the rows
    of the part it wrote. With none merged, or more rows than the numbers below 2^40 hold, the
    layout is empty: the whole table is numbered by sorting. Each unmerged day may use twice
    the unmerged rows and 2^20 more (rows written during the run)."""
    by_partition: dict[str, list[tuple[str, int, int]]] = {}
    for partition, part, level, rows in partitions:
        by_partition.setdefault(partition, []).append((part, level, rows))
    merged = {day: held[0] for day, held in by_partition.items() if len(held) == 1 and held[0][1] > 0}
    if not merged:
        return Layout()
    unmerged = sum(rows for day, held in by_partition.items() if day not in merged for _, _, rows in held)
    span = 2 * unmerged + (1 << 20) if len(merged) < len(by_partition) else 0
    parts, days, base = [], [], 0
    for day in sorted(by_partition):
        if day in merged:
            parts.append((merged[day][0], base))
            base += merged[day][2]
        else:
            days.append((day, base))
            base += span
    return Layout(tuple(parts), tuple(days), span) if base < 1 << 40 else Layout()


def _numbered_in_place(d: Dialect, t: _Plan, placed: Placed, cols: str) -> str:
    """Each instance's events numbered above its code's multiple of 2^40 in stream order, as
    `_steps_events` numbers them, from where each row lies: a part's rows are stored in the
    sort order (instance, then time), and the parts of one instance's rows follow each other by
    day, so a row's part's base plus its offset there orders it among its instance's rows. The
    numbers have gaps (other instances' rows), which nothing reads. No sort, no merge: 10M
    events, 0.64-0.71 -> 0.42-0.44 s for `ev` (the sorted read passed every column through
    FINAL's merge and the merge of the sorted ranges, row by row). The unmerged days (a live
    store's newest) are read sorted, as without a layout, each numbered above its base. A row
    of a part or day not given, or past its day's span, fails the statement (`PARTS_MOVED`)."""
    layout, moved = placed.layout, d.quote(PARTS_MOVED)
    code = d.lookup(t.it, "instance", "code", "instance")

    def base(column: str, named: tuple[tuple[str, int], ...]) -> str:
        names, bases = ", ".join(d.quote(n) for n, _ in named), ", ".join(str(b) for _, b in named)
        return f"transform({column}, [{names}], CAST([{bases}] AS Array(Int64)), toInt64(-1))"

    days = ", ".join(d.quote(day) for day, _ in layout.days)
    rest = f" AND _partition_id NOT IN ({days})" if days else ""
    numbered = (f"SELECT CAST({code} * {1 << 40} + base + _part_offset + 1 + throwIf(base < 0, {moved})"
                f" AS BIGINT) AS ord, {cols}, block_key, more_keys FROM (SELECT {cols}, block_key, more_keys,"
                f" {base('_part', layout.parts)} AS base, _part_offset FROM {placed.table}"
                f" WHERE ({placed.where}){rest})")
    if not days:
        return numbered
    return (f"{numbered} UNION ALL SELECT CAST({code} * {1 << 40} + base + rn"
            f" + throwIf(rn > {layout.span}, {moved}) AS BIGINT) AS ord, {cols}, block_key, more_keys FROM"
            f" (SELECT *, rowNumberInAllBlocks() + 1 AS rn FROM (SELECT {cols}, block_key, more_keys,"
            f" {base('_partition_id', layout.days)} AS base FROM {placed.table} FINAL"
            f" WHERE ({placed.where}) AND _partition_id IN ({days}) ORDER BY instance, ts_ns, source_id, seq))")


def _steps_events(d: Dialect, t: _Plan, source: str, in_order: bool = False,
                  bare: str = "", fleet: bool = False,
                  placed: Placed | None = None) -> tuple[_Plan, list[tuple[str, str]], str]:
    """The steps that number the events and read them, and the object state's statement (`w`);
    and the plan, which reads the events where they lie when every day is one merged part
    (`_events`)."""
    # Stream order for every event, carrying only the narrow columns object state needs: the
    # request-side lists are fetched for lookups and adopts alone (a few rows, not millions).
    cols = _EVENT_COLUMNS
    ig = _ig(d, t, "n.instance", "n.group_id")
    if d.clickhouse and (not fleet or in_order):
        # Without the fleet view no statement compares two instances' events (objects, requests
        # and bulk invalidations are all the instance's own): each instance's rows are numbered
        # above its code's multiple of 2^40, in stream order. They are read in the table's own
        # order (its sort key starts with the instance, then time), which the sort takes as it
        # is, and numbered outside it, the way ClickHouse documents for `rowNumberInAllBlocks`:
        # the sorted rows reach it as one stream. A window (`row_number() OVER (PARTITION BY
        # instance ...)`) numbered the same rows on one thread, in 0.67-1.01 s of 10M events
        # (it varied between processes), this in 0.66-0.72 s; the numbers equal. One instance's
        # rows (`in_order`, the fleet view's case without a second instance) are its stream order.
        # Merged days need no sort at all (`_numbered_in_place`).
        code = d.lookup(t.it, "instance", "code", "instance")
        numbered = (_numbered_in_place(d, t, placed, cols) if placed is not None and placed.layout.parts else
                    f"SELECT CAST({code} * {1 << 40} + rowNumberInAllBlocks() + 1 AS BIGINT) AS ord, {cols},"
                    f" block_key, more_keys FROM (SELECT {cols}, block_key, more_keys FROM {source}"
                    " ORDER BY instance, ts_ns, source_id, seq)")
        ig = f"CAST(intDiv(n.ord, {1 << 40}) * 65536 + n.group_id AS BIGINT)"  # the instance's code, as `_ig`
    else:
        # Several instances' rows interleave in time: the window's sort then merges every column
        # it carries row by row (4M events of 64 instances: 4.8 s, of which the numbers alone
        # 0.4 s; DuckDB's sorts them too, 10.9 s of 10M): number a narrow copy, join the rest
        # back by (source_id, seq), 1.2 s. The number needs no frame, but the default one (RANGE)
        # makes ClickHouse compare each row with the last to find its peers: ROWS spares that.
        # ClickHouse numbers the sorted copy outside its sort instead, as above: 10M events
        # 0.42-0.44 -> 0.12-0.13 s, the numbers equal.
        order = "ts_ns, source_id, seq"
        narrow = (f"SELECT o_src, o_seq, CAST(rowNumberInAllBlocks() + 1 AS BIGINT) AS ord FROM (SELECT source_id"
                  f" AS o_src, seq AS o_seq FROM {source} ORDER BY {order})" if d.clickhouse else
                  f"SELECT source_id AS o_src, seq AS o_seq, CAST(row_number() OVER (ORDER BY {order}"
                  f" ROWS BETWEEN CURRENT ROW AND CURRENT ROW) AS BIGINT) AS ord FROM {source}")
        numbered = (
            f"SELECT o.ord AS ord, {', '.join(f'e.{c} AS {c}' for c in (c.strip() for c in cols.split(',')))},"
            f" e.block_key AS block_key, e.more_keys AS more_keys"
            f" FROM {source} e JOIN ({narrow}) o ON o.o_src = e.source_id AND o.o_seq = e.seq"
        )
    # Each event also names its object's instance and group as one number (`ig`, see `_ig`). A
    # run of blocks stays one row here (see `_per_block`).
    picked = ", ".join("CAST(n.group_id AS BIGINT) AS group_id" if c == "group_id" else f"n.{c} AS {c}"
                       for c in (c.strip() for c in cols.split(",")))
    ev = (f"SELECT n.ord AS ord, {picked}, {ig} AS ig,"
          f" n.block_key AS block_key, n.more_keys AS more_keys FROM ({numbered}) n")
    inline = d.clickhouse and (not fleet or in_order) and placed is not None and placed.layout.merged
    if inline:
        t = replace(t, events=ev)
    # Copies held after each write: per tier, whether its last write there left one, summed over
    # tiers; all in one window, one sort. The life is the last event before this one that left
    # the object with no copy. Each is its frame's last non-NULL value (rows of one event share
    # their values), which DuckDB finds without a running max's segment tree (`w` 4.86 -> 4.48 s
    # on 10M events).
    obj = "PARTITION BY ig, block_key ORDER BY ord"
    last = [
        f"coalesce(last_value(CASE WHEN wtier = '{tier.value}' THEN present END IGNORE NULLS) OVER "
        f"({obj} ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW), 0)"
        for tier in TIER_ORDER
    ]
    life = ("coalesce(last_value(CASE WHEN copies = 0 AND kind <> 'invalidate' THEN ord END IGNORE NULLS)"
            f" OVER ({obj} ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0)")
    copies = (
        f"SELECT *, {' + '.join(last)} AS copies FROM ("
        f" SELECT ord, ig, block_key, kind, CASE WHEN kind = 'commit' THEN {_idh(d)} ELSE 0 END AS idh,"
        "  nbytes, checksum, lease_expiry_ns,"
        f"  {_WRITTEN_TIER} AS wtier,"
        "  CASE WHEN kind = 'evict' THEN 0 ELSE 1 END AS present"
        f" FROM {_object_events(d, t)})"
    )
    writes = _writes_with_arrays(d, t) if d.clickhouse else _state_with_windows(copies, life, obj)
    asked = ("kind", "ts_ns", "source_id", "seq", "instance", "engine", "request_id", "tenant", *_IDENTITY_STR,
             "epoch", "group_block_keys", *_REQUEST_SUMS)
    picked = (", ".join(f"r.{c} AS {c}" for c in asked if c not in _REQUEST_SUMS)
              + ", CAST(r.prompt_tokens AS BIGINT) AS prompt_tokens,"
              " CAST(r.reported_hit_tokens AS BIGINT) AS reported_hit_tokens,"
              " CAST(r.preemptions AS BIGINT) AS preemptions,"
              " CAST(r.computed_before_preemption AS BIGINT) AS computed_before_preemption,"
              f" CAST({d.list_sum('r.reused_tokens')} AS BIGINT) AS adopted,"
              " CAST(r.recomputed_tokens AS BIGINT) AS recomputed")
    if inline:
        # Numbered where they lie, the lookups and adopts are read once with their numbers (a
        # merged part holds no copies to skip), not read and then joined to the numbered events
        # (10M events, alternating: `rq` 0.38-0.39 -> 0.34-0.35 s).
        assert placed is not None
        requests = (f"SELECT r.ord AS ord, {picked} FROM ({_numbered_in_place(d, t, placed, ', '.join(asked))}) r"
                    " WHERE r.kind IN ('lookup', 'adopt')")
    else:
        requests = (
            f"SELECT e.ord AS ord, {picked} FROM ({_requests_read(d, source, bare)}) r"
            f" JOIN (SELECT ord, source_id AS e_src, seq AS e_seq FROM {_events(d, t)}"
            " WHERE kind IN ('lookup', 'adopt')) e ON e.e_src = r.source_id AND e.e_seq = r.seq"
        )
    req = "PARTITION BY instance, request_id ORDER BY ord ROWS BETWEEN 1 FOLLOWING AND 1 FOLLOWING"
    lookups = (
        "SELECT * FROM ("
        " SELECT *,"
        f"  coalesce(max(kind) OVER ({req}), '') AS next_kind,"
        f"  coalesce(max(ord) OVER ({req}), 0) AS next_ord,"
        f"  coalesce(max(ts_ns) OVER ({req}), 0) AS next_ts,"
        f"  coalesce(max(adopted) OVER ({req}), 0) AS next_adopted,"
        f"  coalesce(max(recomputed) OVER ({req}), 0) AS next_recomputed"
        f" FROM {d.table(t.rq)})"
        " WHERE kind = 'lookup'"
    )
    # The invalidations, few, in a table of their own: read after the object state, they would
    # keep `ev` (10M events: ~1 GB) alive past its last big reader (see `_run`).
    invalidations = (f"SELECT ord, instance, tier, tenant, adapter, reason, block_key FROM {_events(d, t)}"
                     " WHERE kind = 'invalidate'")
    steps = [*([] if inline else [(t.ev, ev)]), (t.rq, requests), (t.lk, lookups), (t.iv, invalidations)]
    # The commits' tenants and identities, one row per number the state carries. Grouped by
    # that number, not by the strings (a DISTINCT on eight strings, 0.15 s of 10M events, 0.09 s
    # so): a group whose rows differ in any field (its least and greatest value differ) is two
    # identities sharing a hash (`_check_identities`).
    fields = ("tenant", *_IDENTITY_STR, "epoch")
    picked = ", ".join(f"min(v_{f}) AS {f}" for f in fields)
    clash = " OR ".join(f"min(v_{f}) <> max(v_{f})" for f in fields)
    steps.append((t.ids, f"SELECT idh, {picked}, CASE WHEN {clash} THEN 1 ELSE 0 END AS clash FROM"
                         f" (SELECT {_idh(d)} AS idh, {', '.join(f'{f} AS v_{f}' for f in fields)}"
                         f" FROM {_events(d, t)} WHERE kind = 'commit') GROUP BY idh"))
    return t, steps, writes


def _requests_read(d: Dialect, source: str, bare: str) -> str:
    """The stored lookups and adopts, once each. ClickHouse reads them from the table as stored
    (`bare`), each stored copy of an event once (`LIMIT 1 BY` the table's sort key, which is
    what `FINAL` de-duplicates on): `FINAL` reads the key columns of every row to merge them,
    for a few thousand rows kept (0.25 -> 0.19 s of 10M events)."""
    kinds = "kind IN ('lookup', 'adopt')"
    if d.clickhouse and bare:
        return f"SELECT * FROM {bare} WHERE {kinds} LIMIT 1 BY {', '.join(EVENTS.order_by)}"
    return f"SELECT * FROM {source} WHERE {kinds}"


_Parts = list[tuple[str, str, list[tuple[str, str, str]]]]

_REQUEST_SUMS = ("prompt_tokens", "reported_hit_tokens", "preemptions", "computed_before_preemption", "reused_tokens",
                 "recomputed_tokens")
"""The request columns `rq` casts (or sums) as it reads them."""


def _per_block(d: Dialect, t: _Plan, columns: str, where: str) -> str:
    """The events `where` selects, one row per block: an event naming a run of blocks
    (`more_keys`) gives one row for each, all with its `ord`. Only runs are exploded: exploding
    every event copied every column of 10M rows (0.5 s) to split the few runs."""
    ev, n = _events(d, t), d.list_len("more_keys")
    return (f"(SELECT {columns}, block_key FROM {ev} WHERE ({where}) AND {n} = 0 UNION ALL"
            f" SELECT {columns}, {d.explode_list('block_key', 'more_keys')} AS block_key FROM {ev}"
            f" WHERE ({where}) AND {n} > 0)")


_EV_COLUMNS = f"ord, {_EVENT_COLUMNS}, ig"
"""The columns of `ev` besides the blocks (see `_steps_events`)."""


def _object_events(d: Dialect, t: _Plan) -> str:
    """The object events the state is computed from: those of objects a point reads, before
    its last point there (`ob`). A block only its own request's lookup named (before it was
    written), and every event after an object's last point, cannot change a verdict. An
    invalidation naming no block is a bulk one (`bk`), as the streaming state reads it."""
    kinds = ("kind IN ('create', 'commit', 'offload', 'load', 'evict')"
             " OR (kind = 'invalidate' AND block_key <> 0)")
    return (f"(SELECT e.* FROM {_per_block(d, t, _EV_COLUMNS, kinds)} e JOIN (SELECT ig AS m_ig, block_key AS m_k,"
            f" upto FROM {d.table(t.ob)}) m ON m.m_ig = e.ig AND m.m_k = e.block_key WHERE e.ord < m.upto)")


def _state_parts(c: Callable[[str], str] = str, numeric: bool = False) -> _Parts:
    """What the state after each object event carries, as (category, condition, columns): the
    last write on each tier, the last commit, the last lease and the object's own last
    invalidation, each column as (name, source column, value when there is none). One as-of
    join to these rows then replaces one per category (each hashing the whole write table) at
    every evaluation point. `c` spells a column in the conditions. The commit's tenant and
    identity are one number (`idh`, see `_idh`), read back at the points from the few distinct
    ones. `numeric` is ClickHouse's form: kinds and tiers as codes (`_KIND_CODES`, `TIER_ORDER`).

    Each category keeps its event's `ord`: with the object's `life` (where its current life
    began, see `_steps_events`), that says whether the commit and the lease belong to it."""
    def is_kind(*kinds: str) -> str:
        if numeric:
            return f"{c('kind')} IN ({', '.join(str(_KIND_CODES.index(k) + 1) for k in kinds)})"
        return f"{c('kind')} IN ({', '.join(repr(k) for k in kinds)})"

    lease = f"{is_kind('commit')} OR ({is_kind('offload', 'load')} AND {c('lease_expiry_ns')} <> 0)"
    # A copy's bytes are what restoring it moves: none for the device's, which is resident.
    parts = [
        (tier.value[:3], f"{c('wtier')} = {i}" if numeric else f"{c('wtier')} = '{tier.value}'",
         [(f"{tier.value[:3]}_{n}", col, none) for n, col, none in
          (("ord", "ord", "0"), ("kind", "kind", "0" if numeric else "''"), ("nb", "nbytes", "0"),
           ("ck", "checksum", "0")) if n != "nb" or tier is not Tier.DEVICE])
        for i, tier in enumerate(TIER_ORDER, 1)
    ]
    parts.append(("c", is_kind("commit"),
                  [("c_ord", "ord", "0"), ("c_id", "idh", "0"), ("c_ck0", "checksum", "0"), ("c_nb0", "nbytes", "0")]))
    parts.append(("le", lease, [("le_ord", "ord", "0"), ("le_ns0", "lease_expiry_ns", "0")]))
    parts.append(("o", is_kind("invalidate"), [("o_ord", "ord", "0")]))  # the object's own, on every tier
    return parts


_KIND_CODES = ("create", "commit", "offload", "load", "evict", "invalidate")
"""Object event kinds as numbers 1-6 in ClickHouse's per-object arrays (tiers: 1-4, `TIER_ORDER`)."""

_WRITTEN_TIER = "CASE WHEN kind IN ('offload', 'load') THEN dst_tier WHEN kind = 'invalidate' THEN '' ELSE tier END"
"""The tier an object event leaves a copy on (or removes it from: evict); none for an invalidation,
which applies to every tier's copy written before it."""

def _idh(d: Dialect) -> str:
    """A commit's tenant and identity as one number: the state carries it instead of eight strings
    (each run checks that no two distinct identities share one: `_check_identities`). In DuckDB's
    windows the strings cost as much as the rest of the state: `w` 3.3 -> 1.8 s on 10M events."""
    named = ", ".join(("tenant", *_IDENTITY_STR, "epoch"))
    return f"cityHash64({named})" if d.clickhouse else f"hash({named})"


def _state_with_windows(rows: str, life: str, obj: str) -> str:
    """Per object event, the state after it: each category's last event so far, one struct per
    category carried forward by `last_value(... IGNORE NULLS)` over the object's one sort, with
    the `life` window in the same select (it reads the copies, not the state: one window level
    fewer, `w` 3.3 -> 2.9 s on 10M events)."""
    carried, flat = [], []
    for cat, cond, columns in _state_parts():
        fields = ", ".join(f"{name} := {col}" for name, col, _ in columns)
        carried.append(f"last_value(CASE WHEN {cond} THEN struct_pack({fields}) END IGNORE NULLS) OVER"
                       f" ({obj} ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS s_{cat}")
        flat.extend(f"s_{cat}.{name} AS {name}" for name, _, _ in columns)
    return (f"SELECT ig, block_key, ord, life, {', '.join(flat)} FROM ("
            f" SELECT ig, block_key, ord, {life} AS life, {', '.join(carried)} FROM ({rows}))")


def _writes_with_arrays(d: Dialect, t: _Plan) -> str:
    """The same rows as the window form, for ClickHouse: one GROUP BY per object and array
    functions instead of window sorts, which ClickHouse runs on one thread (about half of the
    whole analysis on 10M events before this). The arrays hold numbers only (`numeric` in
    `_state_parts`), which made this statement ~2x faster than with the strings."""
    fields = ["ord", "kc", "idh", "nbytes", "checksum", "lease_expiry_ns", "wt"]
    n = {name: i + 1 for i, name in enumerate(fields)}
    n["kind"], n["wtier"] = n["kc"], n["wt"]  # as numbers: see _KIND_CODES
    evict = _KIND_CODES.index("evict") + 1
    # Per tier, whether its last write left a copy (1), took it away (0: an evict) or none yet (-1).
    filled = [
        f"arrayFill(v -> v >= 0, arrayMap(e -> if(e.{n['wtier']} = {code}, toInt8(e.{n['kind']} != {evict}), -1), evs))"
        for code, _ in enumerate(TIER_ORDER, 1)
    ]
    copies = (
        "arrayMap((a, b, c, x) -> greatest(a, 0) + greatest(b, 0) + greatest(c, 0) + greatest(x, 0),"
        f" {', '.join(filled)})"
    )
    # Where the object's current life began, as seen by each event: the last event before it
    # that left the object with no copy (0: none), carried forward, shifted by one.
    life = ("arrayPushFront(arrayPopBack(arrayFill(x -> x > 0,"
            f" arrayMap((e, c) -> if(c = 0 AND e.{n['kind']} != {_KIND_CODES.index('invalidate') + 1},"
            f" e.{n['ord']}, 0), evs, {copies}))), 0)")
    # Per category, a mask of its events; its state is one tuple of its columns, that
    # category's values where the mask is set, carried forward over the rest by arrayFill. No
    # array is indexed by another: a lambda that captures one, or an ARRAY JOIN that keeps one,
    # copies it for every element. One tuple per category, not one array per column: two
    # lambdas per category instead of two per column (10M events, the statement unwritten:
    # 1.19-1.23 -> 1.11-1.14 s).
    parts = _state_parts(lambda col: f"e.{n[col]}", numeric=True)
    masks = ", ".join(f"arrayMap(e -> toUInt8({cond}), evs) AS m_{cat}" for cat, cond, _ in parts)
    values = []
    for cat, _, cols in parts:
        picked, nones = ", ".join(f"e.{n[col]}" for _, col, _ in cols), ", ".join(none for _, _, none in cols)
        values.append(f"arrayFill((v, m) -> m = 1, arrayMap((e, m) -> if(m = 1, tuple({picked}), tuple({nones})),"
                      f" evs, m_{cat}), m_{cat}) AS a_{cat}")
    names = [f"s_{cat}.{i} AS {name}" for cat, _, cols in parts for i, (name, _, _) in enumerate(cols, 1)]
    # One array per field, zipped: a tuple's groupArray serializes each value into the arena
    # (0.35 -> 0.20 s of this statement's grouping on 10M events).
    zipped = ", ".join(f"groupArray({f})" for f in fields)
    # The written tier (`_WRITTEN_TIER`) as its code, each `indexOf` reading one LowCardinality
    # column, which ClickHouse computes once per distinct value (a CASE over three of them makes
    # every row's string first).
    tiers = f"[{', '.join(repr(t.value) for t in TIER_ORDER)}]"
    return (
        f"SELECT ig, block_key, ord, life, {', '.join(names)} FROM ("
        f" SELECT ig, block_key, arrayMap(e -> e.1, evs) AS a_ord, lives, {', '.join(values)} FROM ("
        f" SELECT ig, block_key, evs, {life} AS lives, {masks} FROM ("
        f"   SELECT ig, block_key, arraySort(v -> v.1, arrayZip({zipped})) AS evs FROM ("
        "    SELECT ord, ig, block_key,"
        f"     toUInt8(indexOf([{', '.join(repr(k) for k in _KIND_CODES)}], kind)) AS kc,"
        f"     if(kind = 'commit', {_idh(d)}, 0) AS idh, nbytes, checksum, lease_expiry_ns,"
        f"     toUInt8(if(kind IN ('offload', 'load'), indexOf({tiers}, dst_tier),"
        f"      if(kind = 'invalidate', 0, indexOf({tiers}, tier)))) AS wt"
        f"    FROM {_object_events(d, t)})"
        "   GROUP BY ig, block_key)))"
        f" ARRAY JOIN a_ord AS ord, lives AS life, {', '.join(f'a_{cat} AS s_{cat}' for cat, _, _ in parts)}"
    )


def _ig(d: Dialect, t: _Plan, instance: str, group: str) -> str:
    """An object's instance and cache group as one number: the instance's code (its rank among
    the run's instances, `it`) and the group (a UInt16). Objects are found by (ig, block key):
    joins on two integers instead of a string and two integers (the join that picks the objects'
    events took 1.5 s of 10M events, 0.45 s so)."""
    return f"CAST({d.lookup(t.it, 'instance', 'code', instance)} * 65536 + {group} AS BIGINT)"


_PG_COLUMNS = ("lid, phase, at_ord, at_ts, instance, tenant, " + ", ".join(f"r_{f}" for f in (*_IDENTITY_STR, "epoch"))
               + ", adopted, g, comp, b, win, ratio, align, ngroups, cap, chain, len")
"""The columns of a point (one lookup, adopt or fleet judgement, per cache group), in order."""


def _steps_blocks(d: Dialect, t: _Plan, policy: Policy, writes: str) -> list[tuple[str, str]]:
    keep = "1" if policy.keep_one_token else "0"
    if policy.keep_one_token and policy.stores:
        stores = ", ".join("'" + name.replace("'", "''") + "'" for name in sorted(policy.stores))
        keep = f"CASE WHEN l.engine IN ({stores}) THEN 0 ELSE 1 END"
    ids = ", ".join(f"l.{f} AS r_{f}" for f in (*_IDENTITY_STR, "epoch"))
    points = []
    for phase, at_ord, at_ts, cond in ((0, "l.ord", "l.ts_ns", "1 = 1"),
                                       (1, "l.next_ord", "l.next_ts", "l.next_kind = 'adopt'")):
        points.append(
            f"SELECT l.ord AS lid, {phase} AS phase, {at_ord} AS at_ord, {at_ts} AS at_ts, l.instance AS instance,"
            f" l.tenant AS tenant, {ids}, l.next_adopted AS adopted,"
            " r.g AS g, r.comp AS comp, r.b AS b, r.win AS win, r.ratio AS ratio, r.align AS align,"
            " r.ngroups AS ngroups,"
            f" greatest(l.prompt_tokens - {keep}, 0) AS cap, l.group_block_keys[r.g + 1] AS chain,"
            f" CAST({d.list_len('l.group_block_keys[r.g + 1]')} AS BIGINT) AS len"
            f" FROM {d.table(t.lk)} l"
            f" JOIN {d.table(t.rm)} m ON m.src = l.source_id AND m.engine = l.engine AND m.model = l.model"
            f" JOIN {d.table(t.rc)} r ON r.model = m.rkey WHERE {cond}"
        )
    pg = " UNION ALL ".join(points)
    # A point-block carries its point's own columns; the lookup's identity stays with the point
    # (`pg`), where `im` reads it once per point.
    cols = "lid, phase, at_ord, at_ts, instance, tenant, g, comp, b, win, ratio, len, cap"
    pb = d.explode_chain(cols + ", ig", f"(SELECT p.*, {_ig(d, t, 'p.instance', 'p.g')} AS ig FROM {d.table(t.pg)} p)")
    fleet = _steps_fleet_points(d, t, pg, cols) if policy.fleet else [(t.pg, pg)]

    # The object's state just before each point: its last event before it (one as-of join),
    # which carries the last write on each tier, commit and lease, and where the object's
    # current life began, and the object's own last invalidation. Only the blocks that have one
    # get a row: a block without is missing at that point, and every later step reads a block
    # without a row as missing (most of a long prompt's blocks are new: 2.55M of the 3.56M
    # point-blocks of the 10M-event benchmark, which no longer go through `pc` and `bs`).
    # The commit's tenant and identity stay one number (`_idh`): its tenant and adapter (the
    # bulk invalidations' scope) are read back from the few distinct ones, and its identity is
    # judged once per point in `im`. ClickHouse: kinds stay codes (0: none; see `_kind_is`).
    numeric = d.clickhouse
    state = [(name, none) for _, _, columns in _state_parts(numeric=numeric) for name, _, none in columns]
    state.append(("life", "0"))
    columns = ", ".join(name for name, _ in state)
    keys = "s.s_ig = p.ig AND s.s_k = p.key"
    point, nulls = "p.*", ""
    tenants = (f" LEFT JOIN (SELECT idh AS i_id, tenant AS c_tenant0, adapter AS c_adapter FROM {d.table(t.ids)}) i"
               " ON i.i_id = s.c_id")
    if d.clickhouse:
        # A hash as-of join: the state rides along; the lookup's identity is left behind.
        found = (f"{d.table(t.pb)} p ASOF JOIN (SELECT ig AS s_ig, block_key AS s_k,"
                 f" ord AS s_ord, {columns} FROM {d.table(t.w)}) s ON {keys} AND p.at_ord > s.s_ord{tenants}")
        # Every state column's "none" is its type's default (0, and '' for the commit's tenant
        # and adapter), which is what a row without a match gets when the join makes no NULLs:
        # the state's ~25 Nullable columns, each then coalesced, cost ~0.25 s of `pc`'s 1.1 on
        # 10M events.
        if any(none != "0" for _, none in state):
            raise AssertionError("a ClickHouse state column's none is not its type's default")
        picked = [f"s.{name} AS {name}" for name, _ in state] + ["i.c_tenant0 AS c_tenant0", "i.c_adapter AS c_adapter"]
        nulls = " SETTINGS join_use_nulls = 0"
        kept = "lid, phase, at_ord, at_ts, instance, tenant, g, comp, b, win, ratio, len, cap, i"
        point = ", ".join(f"p.{c} AS {c}" for c in kept.split(", "))
    else:
        picked = [f"coalesce(s.{name}, {none}) AS {name}" for name, none in state]
        picked += ["coalesce(i.c_tenant0, '') AS c_tenant0", "coalesce(i.c_adapter, '') AS c_adapter"]
        # DuckDB's as-of join sorts everything it carries: carrying the state made it 7x slower
        # than finding the state's row alone and fetching it by its rowid (one row each, even
        # where an event names a block twice).
        found = (
            f"(SELECT p.*, s.s_row AS s_row FROM {d.table(t.pb)} p"
            f"  ASOF JOIN (SELECT ig AS s_ig, block_key AS s_k, ord AS s_ord,"
            f"  rowid AS s_row FROM {d.table(t.w)}) s ON {keys} AND p.at_ord > s.s_ord) p"
            f" JOIN (SELECT rowid AS s_at, {columns} FROM {d.table(t.w)}) s ON s.s_at = p.s_row{tenants}"
        )
    po = f"SELECT {point}, {', '.join(picked)} FROM {found}{nulls}"
    # The commit's facts and the lease, when they belong to the object's current life: after
    # the last event before the point's state that left the object with no copy.
    live = "c_ord > life"
    pc = (
        f"SELECT *, CASE WHEN {live} THEN 1 ELSE 0 END AS c_ok,"
        f" CASE WHEN {live} THEN c_tenant0 ELSE '' END AS c_tenant,"
        f" CASE WHEN {live} THEN c_adapter ELSE '' END AS c_adp,"
        f" CASE WHEN {live} THEN c_ck0 ELSE 0 END AS c_ck,"
        f" CASE WHEN {live} THEN c_nb0 ELSE 0 END AS c_nb,"
        " CASE WHEN le_ord > life THEN le_ns0 ELSE 0 END AS lease"
        f" FROM ({po})"
    )
    # Bulk invalidations matching each block's copies (scope: instance, tier, tenant, adapter).
    bulk_cols = ", ".join(
        f"max(CASE WHEN bi.tier IN ('', '{tier.value}') THEN bi.ord ELSE 0 END) AS bulk_{tier.value[:3]}"
        for tier in TIER_ORDER
    )
    # They depend on the block only through its point and its commit's tenant and adapter: found
    # once per distinct (instance, point, tenant, adapter), a few per point, not per block; only
    # instances that had one are read.
    bulk = f"{d.table(t.iv)} WHERE block_key = 0"
    bk = (
        f"SELECT p.instance AS instance, p.at_ord AS at_ord, p.c_tenant AS c_tenant, p.c_adp AS c_adp, {bulk_cols}"
        f" FROM (SELECT DISTINCT instance, at_ord, c_tenant, c_adp FROM {d.table(t.pc)}"
        f"  WHERE instance IN (SELECT instance FROM {bulk})) p"
        f" JOIN (SELECT instance AS bi_i, ord, tier, tenant AS bi_tenant, adapter AS bi_adapter FROM {bulk}) bi"
        " ON bi.bi_i = p.instance"
        " WHERE bi.ord < p.at_ord AND (bi.bi_tenant = '' OR bi.bi_tenant = p.c_tenant)"
        " AND (bi.bi_adapter = '' OR bi.bi_adapter = p.c_adp)"
        " GROUP BY p.instance, p.at_ord, p.c_tenant, p.c_adp"
    )
    # The state lookup is read once (by pc), so it is a subquery, not a table: each table of a
    # block's rows costs a materialization of every column (as much as a join in DuckDB).
    # The objects the points read come first, each with its last point: the state is computed
    # for them alone.
    ob = f"SELECT ig, key AS block_key, max(at_ord) AS upto FROM {d.table(t.pb)} GROUP BY ig, key"
    return [*fleet, (t.pb, pb), (t.ob, ob), (t.w, writes), (t.pc, pc), (t.im, _identity_pairs(d, t)), (t.bk, bk),
            *_steps_status(d, t, policy)]


_WRITE_KINDS = "('create', 'commit', 'offload', 'load')"


def _steps_fleet_points(d: Dialect, t: _Plan, pg: str, cols: str) -> list[tuple[str, str]]:
    """The fleet view's points (`analysis.fleet`): each lookup judged again, at the lookup, on
    every other instance of its model that wrote one of its blocks before it, as a point of its
    own (phase 1 + the instance's index), so every later step computes its hits as for the
    lookup's own instance. An instance's model is that of its first write (as the streaming
    index files it); a lookup's is its own instance's if it wrote before the lookup, else the
    lookup's. The streaming path judges fewer (those whose held blocks could beat the best so
    far); the others cannot win, so the rows are the same."""
    fi = ("SELECT instance, CAST(row_number() OVER (ORDER BY instance) AS BIGINT) AS idx, model, first_ord FROM ("
          f" SELECT instance, argMin(model, ord) AS model, min(ord) AS first_ord FROM {_events(d, t)}"
          f" WHERE kind IN {_WRITE_KINDS} GROUP BY instance)")
    blocks = d.explode_chain(cols + ", r_model AS scope", f"(SELECT * FROM {d.table(t.pg0)} WHERE phase = 0)")
    # The candidates' models are compared after the blocks' join, on its few distinct rows: DuckDB
    # joined the eight-row table of instances first, which multiplied the lookups' blocks by the
    # instances before the join with the writes (1M events of 8 instances: `fc` 0.32-0.38 -> 0.07-0.09 s).
    # Only an instance that still holds one of the blocks at the lookup can win either number:
    # one whose copies of them were all evicted has a hash hit and a recoverable prefix of 0, and
    # ties go to the lookup's own instance. A block is held on a tier while that tier's last write
    # of it is later than its last eviction there. The streaming path's candidates are the same
    # (its index of live objects). 10M events of 8 instances: 567 (lookup, instance) pairs wrote
    # a block before the lookup, 225 held one. DuckDB judged the others' points for nothing (`w`
    # and `pc`: 18.5 -> 13.3 s in all); ClickHouse's grouping of the writes and evictions per
    # block took 5.1 s where its judging of those points took ~2, so it judges every writer.
    if d.clickhouse:
        per_block = _per_block(d, t, "instance, group_id, ord, ord AS w_ord, 0 AS x_ord", f"kind IN {_WRITE_KINDS}")
        group = "p.lid, e.instance, p.want"
    else:
        per_block = _per_block(d, t, f"instance, group_id, ord, {_WRITTEN_TIER} AS wtier,"
                                     " CASE WHEN kind = 'evict' THEN 0 ELSE ord END AS w_ord,"
                                     " CASE WHEN kind = 'evict' THEN ord ELSE 0 END AS x_ord",
                               f"kind IN {_WRITE_KINDS} OR kind = 'evict'")
        group = "p.lid, e.instance, p.want, p.g, p.key, e.wtier"
    fc = (
        "SELECT DISTINCT x.lid AS lid, x.instance AS instance FROM ("
        " SELECT p.lid AS lid, e.instance AS instance, p.want AS want, max(e.w_ord) AS w_ord, max(e.x_ord) AS x_ord"
        " FROM ("
        f"  SELECT b.*, coalesce(oi.model, b.scope) AS want FROM ({blocks}) b"
        f"  LEFT JOIN {d.table(t.fi)} oi ON oi.instance = b.instance AND oi.first_ord < b.at_ord WHERE b.key <> 0) p"
        f" JOIN {per_block} e ON e.group_id = p.g AND e.block_key = p.key"
        f" WHERE e.ord < p.at_ord AND e.instance <> p.instance GROUP BY {group}) x"
        f" JOIN {d.table(t.fi)} ci ON ci.instance = x.instance WHERE ci.model = x.want AND x.w_ord > x.x_ord"
    )
    names = [c.strip() for c in _PG_COLUMNS.split(",")]
    swap = {"phase": "1 + c.idx AS phase", "instance": "c.instance AS instance"}
    picked = ", ".join(swap.get(n, f"g.{n} AS {n}") for n in names)
    points = (f"SELECT {', '.join(names)} FROM {d.table(t.pg0)} UNION ALL"
              f" SELECT {picked} FROM {d.table(t.pg0)} g JOIN ("
              f"  SELECT f.lid AS lid, f.instance AS instance, i.idx AS idx"
              f"  FROM {d.table(t.fc)} f JOIN {d.table(t.fi)} i ON i.instance = f.instance) c ON c.lid = g.lid"
              " WHERE g.phase = 0")
    return [(t.pg0, pg), (t.fi, fi), (t.fc, fc), (t.pg, points)]


def _identity_checks(have: str, want: str) -> list[tuple[str, str, str]]:
    """Per identity field, in order: (field, "the commit's value differs from the lookup's",
    both values as text), the commit's column spelled `have` + field, the lookup's `want` + field."""
    checks = []
    for f in IDENTITY_FIELDS:
        h, w = f"{have}{f}", f"{want}{f}"
        if f == "epoch":
            shown = f"CAST({h} AS VARCHAR) || ' != ' || CAST({w} AS VARCHAR)"
            checks.append((f, f"{h} <> 0 AND {w} <> 0 AND {h} <> {w}", shown))
        elif f == "adapter":  # empty is the base model, a value like any other
            checks.append((f, f"{h} <> {w}", f"{h} || ' != ' || {w}"))
        else:
            checks.append((f, f"{h} <> '' AND {w} <> '' AND {h} <> {w}", f"{h} || ' != ' || {w}"))
    return checks


def _identity_pairs(d: Dialect, t: _Plan) -> str:
    """The first identity field in which each point's live commits differ from the
    point's lookup, once per distinct (commit identity, point), a few rows, rather than comparing
    eight strings on every point-block (`pc` carries the commit's identity as its hash)."""
    checks = _identity_checks("i.c_", "r.r_")
    named = ", ".join(f"{f} AS c_{f}" for f in (*_IDENTITY_STR, "epoch"))
    wanted = ", ".join(f"r_{f}" for f in (*_IDENTITY_STR, "epoch"))
    field = " ".join(f"WHEN {differs} THEN {d.quote(f)}" for f, differs, _ in checks)
    detail = " ".join(f"WHEN {differs} THEN {d.quote(f + ': ')} || {shown}" for f, differs, shown in checks)
    return (
        "SELECT x.c_id AS c_id, x.lid AS lid, x.phase AS phase,"
        f" CASE {field} ELSE '' END AS id_field, CASE {detail} ELSE '' END AS id_detail"
        f" FROM (SELECT DISTINCT c_id, lid, phase FROM {d.table(t.pc)} WHERE c_ok = 1) x"
        f" JOIN (SELECT idh, {named} FROM {d.table(t.ids)}) i ON i.idh = x.c_id"
        f" JOIN (SELECT DISTINCT lid AS r_lid, phase AS r_phase, {wanted} FROM {d.table(t.pg)}) r"
        " ON r.r_lid = x.lid AND r.r_phase = x.phase"
    )


def _kind_is(d: Dialect, column: str, kind: str) -> str:
    """A state's event kind test: ClickHouse's state carries kinds as their codes (`_KIND_CODES`):
    spelled back as strings at every point-block, they cost `pc` ~0.3 s of 1.3 on 10M events."""
    return f"{column} = {_KIND_CODES.index(kind) + 1}" if d.clickhouse else f"{column} = '{kind}'"


def _steps_status(d: Dialect, t: _Plan, policy: Policy) -> list[tuple[str, str]]:
    status, inv_pick = [], []
    for tier in TIER_ORDER:
        x = tier.value[:3]
        inv = f"greatest(p.o_ord, coalesce(bk.bulk_{x}, 0))"
        evicted = _kind_is(d, f"p.{x}_kind", "evict")
        status.append(
            f"CASE WHEN p.{x}_ord = 0 OR {evicted} THEN 0"
            f" WHEN {inv} > p.{x}_ord THEN 1"
            f" WHEN {_kind_is(d, f'p.{x}_kind', 'create')} THEN 2"
            f" WHEN p.c_ck <> 0 AND p.{x}_ck <> 0 AND p.{x}_ck <> p.c_ck THEN 3 ELSE 4 END AS st_{x}"
        )
        inv_pick.append(f"CASE WHEN p.{x}_ord > 0 AND NOT ({evicted}) AND {inv} > p.{x}_ord"
                        f" THEN {inv} ELSE 0 END")
    ps = (
        f"SELECT p.*, {', '.join(status)}, greatest({', '.join(inv_pick)}) AS inv_ord"
        + ", im.id_field AS id_field, im.id_detail AS id_detail"
        # (the joined tables' columns renamed: ClickHouse qualifies a `p.*` column named like one)
        + f" FROM {d.table(t.pc)} p LEFT JOIN (SELECT instance AS k_i, at_ord AS k_at, c_tenant AS k_t, c_adp AS k_a,"
        f" {', '.join(f'bulk_{tier.value[:3]}' for tier in TIER_ORDER)} FROM {d.table(t.bk)}) bk"
        " ON bk.k_i = p.instance AND bk.k_at = p.at_ord AND bk.k_t = p.c_tenant AND bk.k_a = p.c_adp"
        + " LEFT JOIN (SELECT c_id AS m_id, lid AS m_lid, phase AS m_phase, id_field, id_detail"
        f" FROM {d.table(t.im)}) im ON im.m_id = p.c_id AND im.m_lid = p.lid AND im.m_phase = p.phase"
    )
    shared = (
        f"p.c_tenant NOT IN ({', '.join(d.quote(s) for s in sorted(policy.shared_tenants))})"
        if policy.shared_tenants
        else "1 = 1"
    )
    code = [
        f"WHEN best = 0 THEN {_MISSING_CASE}",
        f"WHEN best = 1 THEN CASE WHEN coalesce(ir.reason, '') = '{Reason.ROLLBACK.value}' THEN"
        f" '{GapReason.SPECULATIVE_ROLLBACK.value}' ELSE '{GapReason.INVALIDATED.value}' END",
        f"WHEN best = 2 THEN '{GapReason.UNCOMMITTED.value}'",
        f"WHEN best = 3 THEN '{GapReason.CHECKSUM_MISMATCH.value}'",
        f"WHEN p.c_ok = 0 THEN '{GapReason.UNCOMMITTED.value}'",
        f"WHEN p.c_tenant <> p.tenant AND {shared} THEN '{GapReason.TENANT_MISMATCH.value}'",
    ]
    detail = [
        "WHEN best = 0 THEN ''",
        "WHEN best = 1 THEN coalesce(ir.reason, '')",
        "WHEN best IN (2, 3) THEN ''",
        "WHEN p.c_ok = 0 THEN 'no commit seen'",
        f"WHEN p.c_tenant <> p.tenant AND {shared} THEN 'tenant: ' || p.c_tenant || ' != ' || p.tenant",
    ]
    epoch_reason = (f"CASE WHEN comp = '{ComponentKind.INDEXER.value}' THEN '{GapReason.INDEXER_OUT_OF_SYNC.value}'"
                    f" ELSE '{GapReason.IDENTITY_MISMATCH.value}' END")
    field = "coalesce(p.id_field, '')"  # judged once per (commit identity, point) in `im`
    code += [f"WHEN {field} = 'epoch' THEN {epoch_reason}",
             f"WHEN {field} <> '' THEN '{GapReason.IDENTITY_MISMATCH.value}'"]
    detail.append(f"WHEN {field} <> '' THEN p.id_detail")
    code.append(f"WHEN p.lease <> 0 AND p.lease <= p.at_ts THEN '{GapReason.LEASE_EXPIRED.value}'")
    detail.append("WHEN 1 = 1 THEN ''")
    restore_tier = (
        "CASE WHEN st_dev = 4 THEN 'device' WHEN st_hos = 4 THEN 'host' WHEN st_dis = 4 THEN 'disk' ELSE 'remote' END"
    )
    restore_nb = (
        "CASE WHEN st_hos = 4 THEN hos_nb WHEN st_dis = 4 THEN dis_nb ELSE rem_nb END"
    )
    bst = (
        "SELECT lid, phase, g, i, comp, b, win, ratio, len, cap, tenant, c_tenant, present, usable,"
        " CASE WHEN usable = 1 AND st_dev = 4 THEN 1 ELSE 0 END AS resident, code, detail,"
        f" {restore_tier} AS restore_tier,"
        f" CASE WHEN {restore_nb} <> 0 THEN {restore_nb} ELSE c_nb END AS restore_nb FROM ("
        "  SELECT *, CASE WHEN code = '' THEN 1 ELSE 0 END AS usable FROM ("
        "   SELECT p.*, CASE WHEN best > 0 THEN 1 ELSE 0 END AS present,"
        f"    CASE {' '.join(code)} ELSE '' END AS code, CASE {' '.join(detail)} END AS detail FROM ("
        f"     SELECT *, greatest(st_dev, st_hos, st_dis, st_rem) AS best FROM ({ps})) p"
        f"   LEFT JOIN (SELECT ord AS ir_ord, reason FROM {d.table(t.iv)}) ir"
        "   ON ir.ir_ord = p.inv_ord))"
    )
    # The running "last bad block" indices per point and group, in a narrow table of their own:
    # a window (or an array) carrying the blocks' wide rows costs a copy of every column.
    return [(t.bs, bst), (t.pw, _running(d, t))]  # ps is read once: a subquery of bs


_RUNNING = (("lb", "usable", "max"), ("lr", "resident", "max"), ("lq", "present", "max"), ("nb", "usable", "min"))
"""Per block i of a point's group: the last block at or before i that is not usable (`lb`), not
resident (`lr`), not present (`lq`), -1 for none; and the first at or after i not usable
(`nb`), the chain's length for none."""


def _running(d: Dialect, t: _Plan) -> str:
    """`_RUNNING` at each block of a (point, group) that has a row in `bs`, in index order. The
    blocks without one are missing, so each is bad on every count: a block whose row follows a
    gap has the gap's last block (i - 1) as a bad one before it, and one followed by a gap has
    i + 1 after it (the chain's end is the gap's end). Each row's candidate bad index is its own
    i when it is bad, else that neighbour, and the running index is the last (first) candidate
    so far. DuckDB runs these as windows in parallel; ClickHouse runs windows on one thread, so
    there each group's flags become arrays, filled forward (`arrayFill`) or backward
    (`arrayReverseFill`)."""
    keys = "lid, phase, g, comp, b, win, ratio, cap, len"
    if not d.clickhouse:
        # A group's indices are unique and its frame ordered by them, so the last bad index so
        # far is the frame's last non-NULL one (the first, looking ahead): DuckDB finds that
        # without the running max's segment tree, 2.64 -> 1.15 s on 10M events, rows equal.
        grp = "PARTITION BY lid, phase, g ORDER BY i"
        before, after = "UNBOUNDED PRECEDING AND CURRENT ROW", "CURRENT ROW AND UNBOUNDED FOLLOWING"
        cols = ", ".join(
            f"coalesce({'last_value' if agg == 'max' else 'first_value'}(CASE WHEN {flag} = 0 THEN i"
            f" WHEN {'i - pv > 1 THEN i - 1' if agg == 'max' else 'nx - i > 1 THEN i + 1'} END IGNORE NULLS)"
            f" OVER ({grp} ROWS BETWEEN {before if agg == 'max' else after}), {'-1' if agg == 'max' else 'len'})"
            f" AS {name}"
            for name, flag, agg in _RUNNING)
        return (f"SELECT {keys}, i, {cols} FROM (SELECT {keys}, i, usable, resident, present,"
                f" lag(i, 1, -1) OVER ({grp}) AS pv, lead(i, 1, len) OVER ({grp}) AS nx FROM {d.table(t.bs)})")
    order = ["usable", "resident", "present"]
    zipped = ", ".join(f"groupArray({f})" for f in order)  # numeric arrays zipped: no tuple aggregated
    arrays = ", ".join(
        f"{'arrayFill' if agg == 'max' else 'arrayReverseFill'}(x -> x >= 0,"
        f" arrayMap((x, n) -> if(x.{order.index(flag) + 2} = 0, x.1, "
        + ("if(x.1 - n > 1, x.1 - 1, -1)), a, a_pv)" if agg == "max" else "if(n - x.1 > 1, x.1 + 1, -1)), a, a_nx)")
        + f") AS a_{name}"
        for name, flag, agg in _RUNNING)
    return (
        f"SELECT {keys}, i, lb, lr, lq, if(nb0 < 0, len, nb0) AS nb FROM ("
        f" SELECT {keys}, a_i, {arrays} FROM ("
        f"  SELECT {keys}, arraySort(x -> x.1, arrayZip(groupArray(i), {zipped})) AS a, arrayMap(x -> x.1, a) AS a_i,"
        "   arrayPushFront(arrayPopBack(a_i), -1) AS a_pv, arrayPushBack(arrayPopFront(a_i), len) AS a_nx"
        f"  FROM {d.table(t.bs)} GROUP BY {keys}))"
        " ARRAY JOIN a_i AS i, a_lb AS lb, a_lr AS lr, a_lq AS lq, a_nb AS nb0"
    )


def _steps_boundaries(d: Dialect, t: _Plan) -> list[tuple[str, str]]:
    # Each group's own hash hit: the longest boundary (a multiple of its block size, at most the
    # cap) whose needed blocks are all present, valid or not, and that needs at least one. The
    # boundary after block i is (i + 1) * b, so each block's row answers for one boundary.
    p = "(i + 1) * b"
    hits = (
        f"SELECT lid, phase, g, max({p}) AS glog FROM ("
        f" SELECT lid, phase, g, i, b, cap, lq, {_start(d, p)} AS st FROM {d.table(t.pw)})"
        f" WHERE {p} <= cap AND st < i + 1 AND lq < st GROUP BY lid, phase, g"
    )
    gs = (
        "SELECT g.lid AS lid, g.phase AS phase, g.g AS g, g.comp AS comp, g.b AS b, g.win AS win, g.ratio AS ratio,"
        " g.align AS align, g.ngroups AS ngroups, g.len AS len, g.cap AS cap, g.adopted AS adopted, g.tenant AS tenant,"
        " coalesce(h.glog, 0) AS glog"
        f" FROM {d.table(t.pg)} g LEFT JOIN {d.table(t.gh)} h ON h.lid = g.lid AND h.phase = g.phase AND h.g = g.g"
    )
    pts = (
        "SELECT lid, phase, max(glog) AS logical, any_value(align) AS align, any_value(ngroups) AS ngroups,"
        f" {d.ordered_list('glog', 'g')} AS group_logical"
        f" FROM {d.table(t.gs)} GROUP BY lid, phase"
    )
    if d.clickhouse:
        pts = pts.replace("any_value(", "any(")
    top = d.idiv("logical", "align") + " * align"
    # A candidate boundary p is complete in a group when its needed blocks [st, j) are all usable:
    # the last unusable block before j is before st. A block j - 1 without a row is missing
    # (see `_running`), so it is that last unusable block itself.
    cand = (
        "SELECT c.lid AS lid, c.phase AS phase, c.p AS p,"
        " sum(CASE WHEN c.st >= c.j OR (c.j <= c.len AND coalesce(w.lb, c.j - 1) < c.st) THEN 1 ELSE 0 END) AS ok,"
        " sum(CASE WHEN c.st >= c.j OR (c.j <= c.len AND coalesce(w.lr, c.j - 1) < c.st) THEN 1 ELSE 0 END) AS rok,"
        f" any_value(c.ngroups) AS ngroups FROM {d.table(t.pw)} w RIGHT JOIN ("
        f"  SELECT g.*, cp.p AS p, {d.idiv('cp.p', 'g.b')} AS j, {_start(d, 'cp.p')} AS st"
        f" FROM {d.table(t.gs)} g JOIN ("
        f"   SELECT lid, phase, {d.series('align', f'{top} + 1', 'align')} AS p FROM {d.table(t.pp)}) cp"
        "   ON cp.lid = g.lid AND cp.phase = g.phase) c"
        " ON w.lid = c.lid AND w.phase = c.phase AND w.g = c.g AND w.i = c.j - 1"
        " GROUP BY c.lid, c.phase, c.p"
    )
    if d.clickhouse:
        cand = cand.replace("any_value(", "any(")
    rec = (
        "SELECT p.lid AS lid, p.phase AS phase, p.logical AS logical, p.align AS align,"
        " p.group_logical AS group_logical,"
        f" {d.idiv('p.logical', 'p.align')} * p.align AS top,"
        " coalesce(r.rec, 0) AS rec, coalesce(r.res, 0) AS res"
        f" FROM {d.table(t.pp)} p LEFT JOIN (SELECT lid, phase,"
        " max(CASE WHEN ok = ngroups THEN p ELSE 0 END) AS rec, max(CASE WHEN rok = ngroups THEN p ELSE 0 END) AS res"
        f" FROM {d.table(t.cd)} GROUP BY lid, phase) r ON r.lid = p.lid AND r.phase = p.phase"
    )
    # Why the wanted boundary fails (the aligned logical hit; at adopt, what was recoverable at
    # lookup): the first group, in recipe order, with an unusable block there. The few rows
    # looked up in the blocks' table are the join's right side (its hash table), not the table.
    # A block without a row is missing (see `_running`): the first unusable one from st on is st
    # itself when st has none, and its reason is the group's missing one.
    fail = (
        "SELECT x.lid AS lid, x.phase AS phase, x.g AS g,"
        " CASE WHEN x.fi < x.len THEN coalesce(bb.code, x.missing) ELSE x.missing END AS code,"
        f" CASE WHEN x.fi < x.len THEN coalesce(bb.detail, '') ELSE {d.quote(_BEYOND)} END AS detail,"
        f" row_number() OVER (PARTITION BY x.lid, x.phase ORDER BY x.g) AS rank FROM {d.table(t.bs)} bb RIGHT JOIN ("
        "  SELECT q.lid AS lid, q.phase AS phase, q.g AS g, q.len AS len, q.missing AS missing, q.j AS j, q.st AS st,"
        "   CASE WHEN q.st >= q.j THEN -1"
        "   WHEN q.st < q.len AND coalesce(s.nb, q.st) < least(q.j, q.len) THEN coalesce(s.nb, q.st)"
        f"   WHEN q.j > q.len THEN q.len ELSE -1 END AS fi FROM {d.table(t.pw)} s RIGHT JOIN ("
        f"   SELECT g.lid AS lid, g.phase AS phase, g.g AS g, g.len AS len, {_MISSING_CASE} AS missing,"
        f"    {d.idiv('r.q', 'g.b')} AS j, {_start(d, 'r.q')} AS st"
        f"   FROM {d.table(t.gs)} g JOIN (SELECT r.lid AS lid, r.phase AS phase,"
        "     CASE WHEN r.phase = 1 THEN r0.rec ELSE r.top END AS q"
        f"     FROM {d.table(t.rb)} r JOIN {d.table(t.rb)} r0 ON r0.lid = r.lid AND r0.phase = 0) r"
        "    ON r.lid = g.lid AND r.phase = g.phase WHERE r.q > 0) q"
        "  ON s.lid = q.lid AND s.phase = q.phase AND s.g = q.g AND s.i = q.st) x"
        " ON bb.lid = x.lid AND bb.phase = x.phase AND bb.g = x.g AND bb.i = x.fi"
        " WHERE x.fi >= 0"
    )
    # Bytes to restore at the recoverable boundary (at the lookup, on each instance judged), per
    # source tier.
    restore = (
        "SELECT w.lid AS lid, w.phase AS phase,"
        + ", ".join(
            f" sum(CASE WHEN w.resident = 0 AND w.restore_tier = '{tier}' THEN w.restore_nb ELSE 0 END) AS r_{tier}"
            for tier in ("host", "disk", "remote")
        )
        + f" FROM {d.table(t.bs)} w JOIN (SELECT g.lid AS lid, g.phase AS phase, g.g AS g,"
        f"  {d.idiv('r.rec', 'g.b')} AS j, {_start(d, 'r.rec')} AS st"
        f"  FROM {d.table(t.gs)} g JOIN {d.table(t.rb)} r ON r.lid = g.lid AND r.phase = g.phase"
        "  WHERE g.phase <> 1 AND r.rec > 0) n ON n.lid = w.lid AND n.phase = w.phase AND n.g = w.g"
        " WHERE w.phase <> 1 AND w.i >= n.st AND w.i < n.j GROUP BY w.lid, w.phase"
    )
    # Did the adopted prefix include state committed under another tenant namespace?
    cross = (
        "SELECT w.lid AS lid, max(CASE WHEN w.present = 1 AND w.c_tenant <> w.tenant THEN 1 ELSE 0 END) AS cross"
        f" FROM {d.table(t.bs)} w JOIN (SELECT lid, g, {d.idiv('pa', 'b')} AS j, {_start(d, 'pa')} AS st FROM ("
        f"  SELECT g.*, {d.idiv('g.adopted', 'g.b')} * g.b AS pa FROM {d.table(t.gs)} g WHERE g.phase = 1)"
        "  WHERE pa > 0) n ON n.lid = w.lid AND n.g = w.g"
        " WHERE w.phase = 1 AND w.i >= n.st AND w.i < n.j GROUP BY w.lid"
    )
    return [(t.gh, hits), (t.gs, gs), (t.pp, pts), (t.cd, cand), (t.rb, rec), (t.fl, fail), (t.rs, restore),
            (t.cx, cross)]


def _reason(rec: str, top: str, logical: str, code: str) -> str:
    """Why a point's aligned hash hit was not recoverable: its first failing group's code, or
    a misaligned boundary (as `evaluate` names it)."""
    return (f"CASE WHEN {rec} < {top} THEN coalesce({code}, '')"
            f" WHEN {top} < {logical} THEN '{GapReason.MISALIGNED.value}' ELSE '' END")


def _steps_fleet_view(d: Dialect, t: _Plan) -> list[tuple[str, str]]:
    """Per lookup, the fleet view from its points at the lookup (its own, phase 0, and one per
    other instance judged): the longest hash hit and the longest recoverable prefix, each on the
    first instance in (tokens, its own instance, name) order, as `analysis.fleet.judge` picks."""
    any_value = "any" if d.clickhouse else "any_value"
    points = (
        "SELECT r.lid AS lid, r.phase AS phase, r.logical AS logical, r.rec AS rec, i.instance AS instance,"
        f" {_reason('r.rec', 'r.top', 'r.logical', 'f.code')} AS reason,"
        " coalesce(rs.r_host, 0) + coalesce(rs.r_disk, 0) + coalesce(rs.r_remote, 0) AS restore,"
        " CASE WHEN r.phase = 0 THEN 1 ELSE 0 END AS own"
        f" FROM {d.table(t.rb)} r"
        f" JOIN (SELECT lid, phase, {any_value}(instance) AS instance FROM {d.table(t.pg)} GROUP BY lid, phase) i"
        " ON i.lid = r.lid AND i.phase = r.phase"
        f" LEFT JOIN (SELECT * FROM {d.table(t.fl)} WHERE rank = 1) f ON f.lid = r.lid AND f.phase = r.phase"
        f" LEFT JOIN {d.table(t.rs)} rs ON rs.lid = r.lid AND rs.phase = r.phase"
        " WHERE r.phase <> 1"
    )
    ranked = (
        "SELECT *, row_number() OVER (PARTITION BY lid ORDER BY logical DESC, own DESC, instance) AS seen_rank,"
        " row_number() OVER (PARTITION BY lid ORDER BY rec DESC, own DESC, instance) AS best_rank"
        f" FROM ({points})"
    )
    fv = (
        "SELECT s.lid AS lid, s.logical AS seen, b.rec AS best,"
        " CASE WHEN b.rec > 0 THEN b.instance ELSE '' END AS best_instance,"
        " CASE WHEN b.rec < s.logical THEN s.reason ELSE '' END AS reason,"
        " CASE WHEN b.rec > 0 THEN b.restore ELSE 0 END AS restore"
        f" FROM (SELECT * FROM {d.table(t.fr)} WHERE seen_rank = 1) s"
        f" JOIN (SELECT * FROM {d.table(t.fr)} WHERE best_rank = 1) b ON b.lid = s.lid"
    )
    return [(t.fr, ranked), (t.fv, fv)]


def _final(d: Dialect, t: _Plan, fleet: bool) -> str:
    changed = "(a.lid IS NOT NULL AND a.rec < l.rec)"
    rec = f"CASE WHEN {changed} THEN a.rec ELSE l.rec END"
    res = f"CASE WHEN {changed} THEN least(l.res, a.res) ELSE l.res END"
    adopted = "CASE WHEN k.next_kind = 'adopt' THEN k.next_adopted ELSE 0 END"
    seen = "k.next_kind = 'adopt'"
    lookup_reason = (
        "CASE WHEN l.rec < l.top THEN coalesce(lf.code, '')"
        f" WHEN l.top < l.logical THEN '{GapReason.MISALIGNED.value}' ELSE '' END"
    )
    lookup_group = "CASE WHEN l.rec < l.top THEN coalesce(lf.g, -1) ELSE -1 END"
    lookup_detail = (
        "CASE WHEN l.rec < l.top THEN coalesce(lf.detail, '') WHEN l.top < l.logical THEN"
        " 'logical ' || CAST(l.logical AS VARCHAR) || ' is not a multiple of ' || CAST(l.align AS VARCHAR) ELSE '' END"
    )
    return (
        "SELECT k.ts_ns AS ts_ns, k.source_id AS source_id, k.seq AS seq, k.instance AS instance,"
        " k.request_id AS request_id, k.model AS model, k.tenant AS tenant, k.prompt_tokens AS prompt_tokens,"
        " k.reported_hit_tokens AS reported_hit_tokens, k.preemptions AS preemptions,"
        " k.computed_before_preemption AS computed_before_preemption,"
        " l.logical AS logical_hit_tokens,"
        f" {rec} AS recoverable_hit_tokens, {res} AS resident_hit_tokens, {adopted} AS adopted_tokens,"
        f" CASE WHEN {seen} THEN k.next_recomputed ELSE 0 END AS recomputed_tokens,"
        f" CASE WHEN {seen} THEN 1 ELSE 0 END AS adopt_seen,"
        f" CASE WHEN l.logical = 0 THEN 'MISS' WHEN {rec} >= l.top AND {res} >= {rec} THEN 'HIT' ELSE 'PARTIAL' END"
        " AS verdict,"  # schema.verdicts.classify
        f" CASE WHEN {changed} THEN '{GapReason.CHANGED_BEFORE_USE.value}' ELSE {lookup_reason} END AS reason,"
        f" CASE WHEN {changed} THEN coalesce(af.g, -1) ELSE {lookup_group} END AS reason_group,"
        f" CASE WHEN {changed} THEN coalesce(af.code, '') ELSE {lookup_detail} END AS reason_detail,"
        f" CASE WHEN {adopted} > {rec} THEN 1 ELSE 0 END AS unsafe_reuse,"
        f" CASE WHEN {seen} AND {rec} > {adopted} THEN 1 ELSE 0 END AS missed_reuse,"
        " coalesce(cx.cross, 0) AS cross_tenant,"
        " coalesce(rs.r_host, 0) AS restore_host_bytes, coalesce(rs.r_disk, 0) AS restore_disk_bytes,"
        " coalesce(rs.r_remote, 0) AS restore_remote_bytes, l.group_logical AS group_logical_tokens,"
        + (" fv.seen AS seen_anywhere_tokens, fv.best AS recoverable_anywhere_tokens,"
           " fv.best_instance AS best_instance, fv.best - l.rec AS routing_regret_tokens, fv.reason AS fleet_reason,"
           " fv.restore AS best_restore_bytes" if fleet else
           # The fleet is the instance alone (see Policy.fleet): its own numbers at the lookup.
           " l.logical AS seen_anywhere_tokens, l.rec AS recoverable_anywhere_tokens,"
           " CASE WHEN l.rec > 0 THEN k.instance ELSE '' END AS best_instance, 0 AS routing_regret_tokens,"
           f" CASE WHEN l.rec < l.logical THEN {lookup_reason} ELSE '' END AS fleet_reason,"
           " coalesce(rs.r_host, 0) + coalesce(rs.r_disk, 0) + coalesce(rs.r_remote, 0) AS best_restore_bytes")
        + f" FROM {d.table(t.lk)} k"
        f" JOIN {d.table(t.rb)} l ON l.lid = k.ord AND l.phase = 0"
        f" LEFT JOIN {d.table(t.rb)} a ON a.lid = k.ord AND a.phase = 1"
        f" LEFT JOIN (SELECT * FROM {d.table(t.fl)} WHERE phase = 0 AND rank = 1) lf ON lf.lid = k.ord"
        f" LEFT JOIN (SELECT * FROM {d.table(t.fl)} WHERE phase = 1 AND rank = 1) af ON af.lid = k.ord"
        f" LEFT JOIN (SELECT * FROM {d.table(t.rs)} WHERE phase = 0) rs ON rs.lid = k.ord"
        f" LEFT JOIN {d.table(t.cx)} cx ON cx.lid = k.ord"
        + (f" LEFT JOIN {d.table(t.fv)} fv ON fv.lid = k.ord" if fleet else "")
        + " ORDER BY k.ts_ns, k.source_id, k.seq"  # stream order (`ord` may be per instance: `_steps_events`)
    )


_RECIPE_COLUMNS = (
    "model VARCHAR, g BIGINT, comp VARCHAR, b BIGINT, win BIGINT, ratio BIGINT, align BIGINT, ngroups BIGINT"
)


_KEY_COLUMNS = "src {u64}, engine VARCHAR, model VARCHAR, rkey VARCHAR"


def _key_rows(d: Dialect, keyed: Mapping[SourceKey, tuple[str, Recipe]]) -> str:
    """Which recipe each source's lookups of a model use (see RecipeBook.key)."""
    return ", ".join(f"({src}, {d.quote(engine)}, {d.quote(model)}, {d.quote(key)})"
                     for (src, engine, model), (key, _) in keyed.items())


def _published(d: Dialect, source: str, recipes: RecipeBook, read: Reader) -> RecipeBook:
    """The book with every engine's own recipe from its attach events, in stream order."""
    attach = read(f"SELECT source_id, engine, model, instance, recipe FROM {source}"
                  f" WHERE kind = '{EventKind.ATTACH.value}' ORDER BY ts_ns, source_id, seq")
    for src, engine, model, instance, text in attach.iter_rows():
        recipes = recipes.publish(int(src), str(engine), str(model), recipe_from_json(text), str(instance))
    return recipes


def _check_commits(d: Dialect, source: str, recipes: RecipeBook, read: Reader) -> None:
    """Refuse a given recipe the commits contradict: the longest block of each group's commits
    (see RecipeBook.check_commits); only models a recipe was given for are read."""
    if not (recipes.scoped or recipes.default is not None):
        return
    tokens = "token_end - token_start"
    blocks = f"1 + {d.list_len('more_keys')}"
    span = f"intDiv({tokens}, {blocks})" if d.clickhouse else f"({tokens}) // ({blocks})"
    spans = read(f"SELECT engine, model, group_id, max({span}) AS span, count(*) AS n FROM {source}"
                 f" WHERE kind = '{EventKind.COMMIT.value}' GROUP BY engine, model, group_id"
                 " ORDER BY engine, model, group_id")
    for engine, model, group_id, longest, n in spans.iter_rows():
        recipes.check_commits(str(engine), str(model), int(group_id), int(longest), int(n))


def _check_identities(d: Dialect, t: _Plan, read: Reader) -> None:
    """The state carries a commit's tenant and identity as a 64-bit hash (`_idh`): refuse the
    run, rather than judge with the wrong strings, if two distinct ones ever shared a hash."""
    clashes = int(read(f"SELECT count(*) AS n FROM {d.table(t.ids)} WHERE clash = 1").item())
    if clashes:
        raise RuntimeError(f"{clashes} hash(es) stand for more than one commit identity; the SQL path cannot tell"
                           " them apart: use the streaming path (`kvtrace analyze --path stream`)")


def _recipe_rows(d: Dialect, recipes: Mapping[str, Recipe]) -> str:
    rows = []
    for model, r in recipes.items():
        for grp in r.groups:
            rows.append(
                f"({d.quote(model)}, {grp.group_id}, {d.quote(grp.component.value)}, {grp.block_size},"
                f" {grp.window}, {grp.ratio}, {r.alignment}, {len(r.groups)})"
            )
    return ", ".join(rows)


# -- running ------------------------------------------------------------------------------------


Executor = Callable[[str], None]
Reader = Callable[[str], Any]


@dataclass(frozen=True, slots=True)
class StatementTiming:
    """One statement of a SQL run: where the time of a slow analysis goes (see the benchmark).

    `name` is the scratch table a step creates (without the run's prefix) or, for a read, what
    it reads; `rows` is the table's row count afterwards (the rows a read returned)."""

    name: str
    seconds: float
    rows: int


def _run(
    d: Dialect,
    source: str,
    recipes: RecipeBook,
    policy: Policy,
    execute: Executor,
    read: Reader,
    keep_tables: bool = False,
    timings: list[StatementTiming] | None = None,
    bare: str = "",
    placed: Placed | None = None,
) -> pl.DataFrame:
    """`bare`: the stored rows without de-duplication (ClickHouse's table without `FINAL`),
    for the reads whose answer repeats cannot change. `placed`: the table and its layout, whose
    merged days' events are numbered as they lie (`_numbered_in_place`). A merge or an insert
    after the parts were listed fails the read that meets it (`PARTS_MOVED`): the run starts
    again, numbering by sorting."""
    if placed is None:
        return _run_once(d, source, recipes, policy, execute, read, keep_tables, timings, bare)
    started = time.perf_counter()
    try:
        return _run_once(d, source, recipes, policy, execute, read, keep_tables, timings, bare, placed)
    except Exception as exc:
        if PARTS_MOVED not in str(exc):
            raise
    if timings is not None:
        timings.append(StatementTiming("(parts moved)", time.perf_counter() - started, 0))
    return _run_once(d, source, recipes, policy, execute, read, keep_tables, timings, bare)


def _run_once(d: Dialect, source: str, recipes: RecipeBook, policy: Policy, execute: Executor, read: Reader,
              keep_tables: bool, timings: list[StatementTiming] | None, bare: str,
              placed: Placed | None = None) -> pl.DataFrame:
    """One try of `_run`."""
    t = _Plan(f"kvt_{uuid.uuid4().hex[:10]}")
    created: list[str] = []

    def short(name: str) -> str:
        return name.removeprefix(t.prefix + "_")

    def step(name: str, select: str, key: str = "") -> None:
        started = time.perf_counter()
        execute(d.create_keyed(name, key, select) if key else d.create_as(name, select))
        created.append(name)
        if timings is not None:
            seconds = time.perf_counter() - started
            rows = read(f"SELECT count(*) AS n FROM {d.table(name)}").item()
            timings.append(StatementTiming(short(name), seconds, int(rows)))

    def timed_read(name: str, sql: str) -> Any:
        started = time.perf_counter()
        frame = read(sql)
        if timings is not None:
            timings.append(StatementTiming(name, time.perf_counter() - started, len(frame)))
        return frame

    def timed_call(name: str, fn: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        out = fn()
        if timings is not None:
            timings.append(StatementTiming(name, time.perf_counter() - started, 0))
        return out

    try:
        # The run's instances, numbered (see `_IG`); one instance's events are read in stream order.
        step(t.it, "SELECT instance, CAST(row_number() OVER (ORDER BY instance) AS BIGINT) AS code"
                   f" FROM (SELECT DISTINCT instance FROM {bare or source})", key="instance")
        in_order = (d.clickhouse and policy.fleet
                    and int(read(f"SELECT count(*) AS n FROM {d.table(t.it)}").item()) <= 1)
        t, first, writes = _steps_events(d, t, source, in_order, bare, policy.fleet, placed)
        for name, select in first:
            step(name, select)
        recipes = timed_call("(attach recipes)", lambda: _published(d, source, recipes, read))
        timed_call("(check commits)", lambda: _check_commits(d, source, recipes, read))
        timed_call("(check identities)", lambda: _check_identities(d, t, read))
        triples = timed_read("(lookup sources)", f"SELECT DISTINCT source_id, engine, model FROM {d.table(t.lk)}")
        keyed = recipes.keyed(sorted((int(src), str(engine), str(model)) for src, engine, model in triples.iter_rows()))
        chosen = dict(keyed.values())
        for table, columns, rows in ((t.rc, _RECIPE_COLUMNS, _recipe_rows(d, chosen)),
                                     (t.rm, _KEY_COLUMNS.format(u64="UInt64" if d.clickhouse else "UBIGINT"),
                                      _key_rows(d, keyed))):
            execute(d.create(table, columns))
            created.append(table)
            if rows:
                execute(f"INSERT INTO {d.table(table)} VALUES {rows}")
        fleet = _steps_fleet_view(d, t) if policy.fleet else []
        rest = [*_steps_blocks(d, t, policy, writes), *_steps_boundaries(d, t), *fleet]
        final = _final(d, t, policy.fleet)
        for k, (name, select) in enumerate(rest):
            step(name, select)
            if not keep_tables:  # each scratch table goes once nothing after reads it: the run's peak is smaller
                later = " ".join([*(sql for _, sql in rest[k + 1:]), final])
                for done in [c for c in created if not re.search(re.escape(d.table(c)) + r"\b", later)]:
                    execute(d.drop(done))
                    created.remove(done)
        return conform_results(timed_read("(final)", final))
    finally:
        if not keep_tables:
            for name in reversed(created):
                execute(d.drop(name))


def conform_results(frame: pl.DataFrame) -> pl.DataFrame:
    """The LookupResult columns with one dtype each, whichever path computed them."""
    ints = {"ts_ns": pl.Int64, "source_id": pl.UInt64, "seq": pl.UInt64}
    out = []
    for spec in field_specs(LookupResult):
        name, kind = spec.name, spec.column.clickhouse
        dtype: Any
        if name in ints:
            dtype = ints[name]
        elif spec.depth:
            dtype = pl.List(pl.Int64)
        elif kind == "Bool":
            dtype = pl.Boolean
        elif spec.enum_type is not None or "String" in kind:
            dtype = pl.Utf8
        else:
            dtype = pl.Int64
        col = pl.col(name)
        out.append((col.cast(pl.Int64) != 0).alias(name) if dtype == pl.Boolean and frame[name].dtype != pl.Boolean
                   else col.cast(dtype))
    return frame.select(out)


def placed_events(store: Any, table: str = "events", where: str = "1") -> Placed:
    """The stored events of `table` (`where` selects them) and their layout (`placed_parts`)."""
    parts = store.query_polars(
        "SELECT partition_id, name, level, rows FROM system.parts"
        " WHERE database = {db:String} AND table = {table:String} AND active", {"db": store.db, "table": table})
    return Placed(f"{store.db}.{table}", where, placed_parts(parts.iter_rows()))


def clickhouse_results(
    store: Any,
    recipes: RecipeBook | Recipe | None = None,
    policy: Policy = Policy(),
    where: str = "1",
    timings: list[StatementTiming] | None = None,
    table: str = "events",
    in_place: bool = True,
) -> pl.DataFrame:
    """Per-lookup results computed inside ClickHouse over the stored (de-duplicated) events of
    `table` (a cluster node's `events_local`: one shard, see `analysis.shards`); `timings`, when
    given, receives one entry per statement. `in_place=False` numbers the events by sorting them
    even where the table's parts would let them be numbered where they lie (`placed_events`):
    the cost on a table with unmerged parts, which the benchmark prints beside the other."""
    source = f"(SELECT * FROM {store.db}.{table} FINAL WHERE {where})"
    bare = f"(SELECT * FROM {store.db}.{table} WHERE {where})"  # for reads repeats cannot change: see _run
    placed = placed_events(store, table, where) if in_place else None

    known = set(store.query_polars("SELECT name FROM system.settings WHERE name IN ("
                                   + ", ".join(f"'{name}'" for name in _IF_KNOWN) + ")")["name"])
    clause = settings_clause({**CLICKHOUSE_SETTINGS, **{k: v for k, v in _IF_KNOWN.items() if k in known}})

    def execute(sql: str) -> None:  # a CREATE ... AS carries the clause (Dialect.create_as); DROPs need none
        store.command(sql)

    def read(sql: str) -> pl.DataFrame:  # every read is one SELECT
        return store.query_polars(sql + clause)

    book = RecipeBook.of(recipes)
    try:
        return _run(Dialect("clickhouse", store.db, clause), source, book, policy, execute, read, timings=timings,
                    bare=bare, placed=placed)
    except Exception as exc:
        # ClickHouse's analyzer reads `db.table` as `alias.column` when a table alias of the
        # statement is spelled like the database (a store named `x`, `g`, `p`...): then the
        # scratch tables go to a database of their own, named like no alias.
        if f"Compound identifier '{store.db}." not in str(exc):
            raise
    scratch = f"kvtrace_scratch_{uuid.uuid4().hex[:12]}"
    execute(f"CREATE DATABASE {scratch}")
    try:
        if timings is not None:
            timings.clear()
        return _run(Dialect("clickhouse", scratch, clause), source, book, policy, execute, read, timings=timings,
                    bare=bare, placed=placed)
    finally:
        execute(f"DROP DATABASE IF EXISTS {scratch}")


def duckdb_results(
    parquet: str | Path | Iterable[str | Path],
    recipes: RecipeBook | Recipe | None = None,
    policy: Policy = Policy(),
    connection: Any = None,
    timings: list[StatementTiming] | None = None,
) -> pl.DataFrame:
    """Per-lookup results computed by DuckDB over Parquet exports of the events; `timings`,
    when given, receives one entry per statement."""
    import duckdb

    paths = [str(parquet)] if isinstance(parquet, (str, Path)) else [str(p) for p in parquet]
    con = connection if connection is not None else duckdb.connect()
    d = Dialect("duckdb")
    listed = ", ".join(d.quote(p) for p in paths)
    source = f"read_parquet([{listed}], union_by_name = true)"
    try:
        # Exports written before a schema version lack its columns: single blocks before version 2
        # (more_keys), no attach events before version 5 (recipe).
        columns = {row[0] for row in con.execute(f"DESCRIBE SELECT * FROM {source}").fetchall()}
        added = [f"{default} AS {name}" for name, default in (("more_keys", "CAST([] AS UBIGINT[])"), ("recipe", "''"))
                 if name not in columns]
        if added:
            source = f"(SELECT *, {', '.join(added)} FROM {source})"
        return _run(d, source, RecipeBook.of(recipes), policy, lambda sql: con.execute(sql),
                    lambda sql: con.sql(sql).pl(), timings=timings)
    finally:
        if connection is None:
            con.close()
