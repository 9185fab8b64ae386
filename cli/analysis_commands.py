"""`kvtrace analyze`, `costs`, `capacity`, `report` and `calibrate`: what the events say, from
the store or from event files. The answers are computed by `kvtrace.analysis` (and the report
by `kvtrace.dashboards.report`); these handlers choose the source, call them and print."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from kvtrace.cli.arguments import add_recipe_option, int_list, non_negative, positive, time_ns

if TYPE_CHECKING:
    import polars as pl

    from kvtrace.analysis.run import Analysis, Observations
    from kvtrace.schema.recipes import RecipeBook


def register(sub: argparse._SubParsersAction) -> None:
    analyze = sub.add_parser("analyze", help="hit funnel and gap reasons per lookup, by any of three paths")
    analyze.add_argument("parquet", nargs="*", help="event files for the duckdb path: Parquet exports, JSONL or "
                                                    "spool files")
    add_recipe_option(analyze)
    analyze.add_argument("--path", choices=["clickhouse", "stream", "duckdb"],
                         help="where to compute: in the store (clickhouse, the default), replayed in Python (stream, "
                              "what --since/--until use), or DuckDB on event files (duckdb)")
    analyze.add_argument("--since", type=time_ns, default=None,
                         help="only lookups made from this time (ISO time or ns; inclusive), read from the nearest "
                              "snapshot before it instead of the whole history; the run leaves one at --until")
    analyze.add_argument("--until", type=time_ns, default=None,
                         help="only lookups made before this time (ISO time or ns; exclusive; default now)")
    analyze.add_argument("--snapshot-every-s", type=non_negative, default=3600,
                         help="with --since/--until: while reading, also leave a snapshot every N seconds of stream "
                              "time (0: only at --until)")
    analyze.add_argument("--shard", action="append", default=[], metavar="DSN",
                         help="a shard's store, one per shard (repeatable): each shard's own events are analysed on "
                              "its node (events_local on a cluster) and the rows joined; a cluster shards by instance, "
                              "so no event crosses shards")
    analyze.add_argument("--by", default="", help="comma-separated dimensions: model,instance,tenant")
    analyze.add_argument("--bucket-s", type=non_negative, default=0, help="also group by time buckets of N seconds")
    analyze.add_argument("--shared-tenant", action="append", default=[], help="namespace every tenant may reuse")
    analyze.add_argument("--fleet", action="store_true",
                         help="also judge each lookup on every instance of its model: seen and recoverable anywhere, "
                              "the best instance and the routing regret (prints the fleet funnel; not with --shard)")
    analyze.add_argument("-o", "--output", help="write per-lookup results to this Parquet file")
    analyze.add_argument("--joined-output", help="write the engine + KV store picture per request (vLLM with "
                                                  "LMCache: instances X and X/lmcache) to this Parquet file")
    analyze.add_argument("--write-verdicts", action="store_true",
                         help="also store the per-lookup rows in the verdicts table (what dashboards and alerts read "
                              "when no collector reconstructs live)")
    analyze.set_defaults(handler=cmd_analyze, extra="analysis")

    costs = sub.add_parser("costs", help="load vs recompute: fitted costs, crossovers, seconds lost")
    costs.add_argument("parquet", nargs="*", help="Parquet exports to read instead of the store")
    add_recipe_option(costs)
    costs.add_argument("--starts", default="0,1024,8192,32768",
                       help="context positions (tokens) to give the crossover at (default 0,1024,8192,32768)")
    costs.add_argument("--fleet", action="store_true",
                       help="also judge each lookup on every instance of its model and price the routing regret in "
                            "seconds (serving on the chosen instance vs the best one)")
    costs.add_argument("-o", "--output", help="write the per-lookup restore decisions to this Parquet file")
    costs.set_defaults(handler=cmd_costs, extra="analysis")

    capacity = sub.add_parser("capacity", help="hit rate against cache capacity per group, from stack distances")
    capacity.add_argument("parquet", nargs="*", help="Parquet exports to read instead of the store")
    add_recipe_option(capacity)
    capacity.add_argument("--capacities", default="64,256,1024,4096,16384,65536",
                          help="capacities to evaluate, in blocks of each group (comma-separated)")
    capacity.add_argument("--requests", type=float, default=0.99, help="share of requests to serve (default 0.99)")
    capacity.add_argument("--prefix", type=float, default=0.99, help="share of their reusable prefix (default 0.99)")
    capacity.set_defaults(handler=cmd_capacity, extra="analysis")

    rep = sub.add_parser("report", help="write the HTML report (funnel, reasons, crossover, capacity)")
    rep.add_argument("parquet", nargs="*", help="Parquet exports to read instead of the store")
    add_recipe_option(rep)
    rep.add_argument("-o", "--output", default="kvtrace-report.html", help="where (default kvtrace-report.html)")
    rep.add_argument("--bucket-s", type=positive, default=60, help="funnel time buckets (default 60 s)")
    rep.set_defaults(handler=cmd_report, extra="dashboards")

    cal = sub.add_parser("calibrate", help="measure prefill and copy costs on this machine (needs torch)")
    cal.add_argument("--model", required=True, help="the model name events carry (what cost models join on)")
    cal.add_argument("--layers", type=positive, default=4, help="transformer layers of the timed model")
    cal.add_argument("--hidden", type=positive, default=512, help="hidden size")
    cal.add_argument("--heads", type=positive, default=8, help="attention heads")
    cal.add_argument("--kv-heads", type=positive, default=2, help="KV heads (grouped-query attention)")
    cal.add_argument("--head-dim", type=positive, default=64, help="dimension per head")
    cal.add_argument("--intermediate", type=positive, default=1408, help="MLP intermediate size")
    cal.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                     help="weights' and KV's dtype")
    cal.add_argument("--device", default="cpu", help="cpu, or cuda[:N] when a GPU is present")
    cal.add_argument("--starts", default="0,512,1024,2048", help="cached tokens before each timed chunk")
    cal.add_argument("--chunks", default="64,128,256,512", help="tokens per timed chunk")
    cal.add_argument("--sizes-mib", default="1,2,4,8,16,32,64,128", help="copy sizes for tier bandwidth")
    cal.add_argument("--repeats", type=positive, default=3, help="timings per point; the median is kept")
    cal.set_defaults(handler=cmd_calibrate, extra="analysis")


# -- analyze --------------------------------------------------------------------------------

_FUNNEL_COLUMNS = {
    "lookups": "lookups",
    "prompt_tokens": "prompt tok",
    "logical_token_rate": "logical",
    "recoverable_token_rate": "recoverable",
    "resident_token_rate": "resident",
    "adopted_token_rate": "adopted",
    "divergence": "gap",
    "unsafe_reuse": "unsafe",
    "missed_reuse": "missed",
    "cross_tenant": "x-tenant",
    "readmissions": "readmitted",
}


def _funnel_table(table: pl.DataFrame) -> pl.DataFrame:
    """Token-weighted rates as percentages, short headers: readable in an 100-column terminal."""
    import polars as pl

    keys = [c for c in table.columns if c not in _FUNNEL_COLUMNS and not c.endswith("_rate")]
    rates = [c for c in _FUNNEL_COLUMNS if c.endswith("_rate") or c == "divergence"]
    return table.select(
        *keys,
        *(
            (pl.col(c) * 100).round(1).cast(pl.Utf8).add("%").alias(_FUNNEL_COLUMNS[c]) if c in rates
            else pl.col(c).alias(_FUNNEL_COLUMNS[c])
            for c in _FUNNEL_COLUMNS
        ),
    )


def cmd_analyze(args: argparse.Namespace) -> int:
    import polars as pl

    from kvtrace.analysis.evaluate import Policy
    from kvtrace.analysis.funnel import fleet_funnel, funnel, preemption, reasons, regret_pairs
    from kvtrace.analysis.run import AnalysisPath, analyze, analyze_range, save_verdicts
    from kvtrace.schema.recipes import RecipeBook, RecipeError, UnknownModel
    from kvtrace.store.client import Store

    by = [d for d in args.by.split(",") if d]
    unknown = set(by) - {"model", "instance", "tenant"}
    if unknown:
        print(f"error: --by takes model, instance, tenant; not {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    try:
        recipes = RecipeBook.parse(args.recipe)
    except (RecipeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    policy = Policy(shared_tenants=frozenset(args.shared_tenant), fleet=args.fleet)
    ranged = args.since is not None or args.until is not None
    if args.fleet and args.shard:
        print("error: --fleet needs every instance's events in one place: a shard holds only its own instances "
              "(not --shard)", file=sys.stderr)
        return 2
    if ranged and (args.path not in (None, "stream") or args.shard or args.parquet):
        print("error: --since/--until read the store from a snapshot by the stream path: they do not combine "
              "with --path clickhouse or duckdb, --shard or event files", file=sys.stderr)
        return 2
    path = AnalysisPath(args.path or ("stream" if ranged else "clickhouse"))
    run = None
    try:
        if ranged:
            with Store(args.dsn) as store:
                store.require_schema()
                until = args.until if args.until is not None else time.time_ns()
                analysis, run = analyze_range(recipes, store, args.since or 0, until, policy,
                                              every_ns=args.snapshot_every_s * 10**9)
        elif args.shard:
            shards = [Store(dsn) for dsn in args.shard]
            try:
                for shard in shards:
                    shard.require_schema()
                analysis = analyze(recipes, path, policy, shards=shards)
            finally:
                for shard in shards:
                    shard.close()
        elif path is AnalysisPath.DUCKDB:
            analysis = analyze(recipes, path, policy, files=args.parquet)
        else:
            with Store(args.dsn) as store:
                store.require_schema()
                analysis = analyze(recipes, path, policy, store=store)
    except (UnknownModel, ValueError) as exc:
        print(f"error: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    frame = analysis.results
    if args.output:
        frame.write_parquet(args.output)
    if args.write_verdicts:
        with Store(args.dsn) as store:
            store.init()
            save_verdicts(store, analysis)
    with pl.Config(tbl_rows=50, tbl_cols=20, tbl_width_chars=200, tbl_hide_dataframe_shape=True,
                   float_precision=3, tbl_hide_column_data_types=True):
        print(f"{frame.height} lookups ({path.value} path)")
        if run is not None:
            began = f"the snapshot at {run.started_at_ns}" if run.started_at_ns else "the first event"
            print(f"range [{run.since_ns}, {run.until_ns}): read {run.events_read:,} events from {began}; "
                  f"snapshots left: {run.snapshots_saved}" + (f" ({run.note})" if run.note else ""))
        print(_funnel_table(funnel(frame, by, bucket_ns=args.bucket_s * 10**9)))
        if frame.height:
            print("\ngap between logical and recoverable, by reason")
            print(reasons(frame, by).head(20))
            cost = preemption(frame, by)
            if cost.height and int(cost["readmissions"].sum()):
                print("\npreemption: requests admitted again, apart from the rates above as the engine counts them "
                      "(tokens; computed again: what they had computed, evicted before they came back)")
                print(cost)
        if args.fleet and frame.height:
            print("\nfleet: where each prompt token went (tokens; routing regret: recoverable on another instance)")
            print(fleet_funnel(frame, by))
            pairs = regret_pairs(frame)
            if pairs.height:
                print("\nrouting regret by instance pair (sent to -> best)")
                print(pairs.head(20))
        _print_joined(analysis, args.joined_output)
        _print_probes(analysis)
    if args.output:
        print(f"per-lookup results: {args.output}")
    return 0


def _print_joined(analysis: Analysis, output: str | None) -> None:
    """Engines with a KV store beside them (vLLM with LMCache): one picture per request."""
    from kvtrace.analysis.join import join_totals

    if output:
        analysis.joined.write_parquet(output)
        print(f"engine + store results: {output}")
    if not analysis.joined.height:
        return
    print("\nengine + KV store, per request (the engine's blocks and the store's chunks joined on positions)")
    print(join_totals(analysis.results, analysis.joined))


def _print_probes(analysis: Analysis) -> None:
    """What the engine canaries found: the reuse claims re-execution checked."""
    if not analysis.probes:
        return
    from collections import Counter

    from kvtrace.schema.verdicts import Agreement

    rows = analysis.verifications
    counts = Counter(r.agreement for r in rows)
    print(f"\ncanary: {analysis.probes} probes, {len(rows)} judged: "
          + (", ".join(f"{a.value} {counts[a]}" for a in Agreement if counts[a]) or "none"))
    for r in rows:
        if r.agreement in (Agreement.DIVERGED, Agreement.ALARM_CONFIRMED):
            print(f"  {r.instance} {r.request_id}: {r.agreement.value}: {r.detail}")


# -- costs, capacity, report: events and results from the store or from files ----------------

def _observations(args: argparse.Namespace, recipes: RecipeBook) -> Observations:
    from kvtrace.analysis.evaluate import Policy
    from kvtrace.analysis.run import read_observations
    from kvtrace.store.client import Store

    policy = Policy(fleet=getattr(args, "fleet", False))
    if args.parquet:
        return read_observations(recipes, files=args.parquet, policy=policy)
    with Store(args.dsn) as store:
        store.require_schema()
        return read_observations(recipes, store=store, policy=policy)


def _calibrations(args: argparse.Namespace) -> pl.DataFrame | None:
    """Calibrated timings from the store (none when reading event files only, or none stored)."""
    from kvtrace.analysis.planning import stored_calibrations
    from kvtrace.store.client import Store

    if args.parquet and not args.dsn:
        return None
    with Store(args.dsn) as store:
        return stored_calibrations(store)


def _table(frame: pl.DataFrame) -> str:
    import polars as pl

    with pl.Config(tbl_rows=60, tbl_cols=20, tbl_width_chars=200, tbl_hide_dataframe_shape=True, float_precision=3,
                   tbl_hide_column_data_types=True):
        return str(frame) if frame.height else "  (none)"


def _transfers(frame: pl.DataFrame) -> pl.DataFrame:
    """The transfer table with bandwidth in GiB/s, the CLI's one size unit (the analysis gives GB/s)."""
    import polars as pl

    if "GB_per_s" not in frame.columns:
        return frame
    scale = 1e9 / 2**30

    def ci(text: str) -> str:
        lo, _, hi = text.partition("..")
        return f"{float(lo) * scale:.3f}..{float(hi) * scale:.3f}"

    return frame.with_columns((pl.col("GB_per_s") * scale).alias("GB_per_s"),
                              pl.col("GB_per_s_ci95").map_elements(ci, return_dtype=pl.Utf8)).rename(
        {"GB_per_s": "GiB_per_s", "GB_per_s_ci95": "GiB_per_s_ci95"})


def cmd_costs(args: argparse.Namespace) -> int:
    from kvtrace.analysis.planning import cost_report
    from kvtrace.schema.recipes import RecipeBook, RecipeError, UnknownModel

    try:
        recipes = RecipeBook.parse(args.recipe)
        starts = int_list(args.starts, "--starts")
        observed = _observations(args, recipes)
    except (RecipeError, UnknownModel, ValueError) as exc:
        print(f"error: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    report = cost_report(observed.events, observed.results, starts, calibrations=_calibrations(args))
    print("transfers (seconds = latency + bytes / bandwidth), from timed loads")
    print(_table(_transfers(report.transfer_table())))
    print("\nprefill (seconds = fixed + per token + per token pair of attention), from timed adopts")
    print(_table(report.prefill_table()))
    print("\ncrossover: tokens to restore above which loading beats recomputing, by context position")
    print(_table(report.crossovers))
    print("\nrestore decisions on lookups with recoverable state off the device")
    print(_table(report.lost()))
    if args.fleet:
        print("\nrouting regret in seconds, by instance pair (sent to -> best): serving on the best instance would "
              "have saved regret_s; exact: false where the best instance's restore is priced on the slowest path; "
              "unpriced: lookups whose model or restore path has no fitted cost)")
        print(_table(report.regret_by_pair()))
    if report.waiting.height:
        print("\nwaiting on loads still in flight at admission")
        print(_table(report.waiting))
    if not report.transfers or not report.prefills:
        print("\n(no fitted model for some paths: they need at least 8 timed loads of varying size, and adopts "
              "that report their recompute time; `kvtrace calibrate` measures them on this machine)")
    if args.output:
        report.decisions.write_parquet(args.output)
        print(f"per-lookup decisions: {args.output}")
    return 0


def cmd_capacity(args: argparse.Namespace) -> int:
    import polars as pl

    from kvtrace.analysis.planning import capacity_report, read_events
    from kvtrace.schema.recipes import RecipeBook, RecipeError
    from kvtrace.store.client import Store

    try:
        recipes = RecipeBook.parse(args.recipe)
        capacities = int_list(args.capacities, "--capacities")
        if not (0 < args.requests <= 1 and 0 < args.prefix <= 1):
            raise ValueError("--requests and --prefix are shares in (0, 1]")
        if args.parquet:
            events = read_events(files=args.parquet)
        else:
            with Store(args.dsn) as store:
                store.require_schema()
                events = read_events(store=store)
    except (RecipeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    reports = capacity_report(events, recipes, capacities, args.requests, args.prefix)
    if not reports:
        print("no lookups for the given recipes' models: nothing to size")
    for r in reports:
        print(f"model {r.model}: share of prompt tokens resumable, by each group's capacity (others unlimited)")
        print(_table(r.curve.with_columns((pl.col("hit_rate") * 100).round(2)).rename({"hit_rate": "hit %"})))
        for n in r.needs:
            size = r.block_bytes.get(n.group)
            gib = f" = {n.blocks * size / 2**30:.2f} GiB" if size else ""
            print(f"  group {n.group} ({n.component}): {n.blocks} blocks{gib} keep {n.prefix:.0%} of the reusable "
                  f"prefix for {n.requests:.0%} of requests")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from kvtrace.dashboards.report import write_analysis_report
    from kvtrace.schema.recipes import RecipeBook, RecipeError, UnknownModel

    try:
        recipes = RecipeBook.parse(args.recipe)
        observed = _observations(args, recipes)
    except (RecipeError, UnknownModel, ValueError) as exc:
        print(f"error: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    source = ", ".join(args.parquet) if args.parquet else str(args.dsn or "the default store")
    path = write_analysis_report(args.output, observed, recipes, source, bucket_ns=args.bucket_s * 10**9,
                                 calibrations=_calibrations(args))
    print(f"report: {path}")
    return 0


# -- calibrate --------------------------------------------------------------------------------

def cmd_calibrate(args: argparse.Namespace) -> int:
    from kvtrace.analysis.planning import calibration_report  # loads polars: a missing store extra is named first

    try:
        import torch
    except ImportError:
        print("error: calibrate needs torch: pip install 'kvtrace[torch]' (or use your engine's torch)",
              file=sys.stderr)
        return 1
    from kvtrace.analysis.calibrate import ModelShape, calibrate
    from kvtrace.store.client import Store

    try:
        shape = ModelShape(args.layers, args.hidden, args.heads, args.kv_heads, args.head_dim, args.intermediate,
                           args.dtype)
        starts, chunks = int_list(args.starts, "--starts"), int_list(args.chunks, "--chunks")
        sizes = [m << 20 for m in int_list(args.sizes_mib, "--sizes-mib")]
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: no CUDA device here")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    run = calibrate(shape, args.model, starts, chunks, sizes, args.device, args.repeats)
    with Store(args.dsn) as store:
        store.init()
        store.insert_calibrations(run.samples)
    report = calibration_report(run.samples)
    print(f"calibration {run.run_id} on {run.device}: {len(run.samples)} timings stored for model {args.model}")
    print(_table(report.prefill_table()))
    print(_table(_transfers(report.transfer_table())))
    print(f"KV bytes per token of this shape: {shape.kv_bytes_per_token()}")
    print(f"next: kvtrace costs --recipe {args.model}=RECIPE   (uses these where events carry no timings)")
    return 0
