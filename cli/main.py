"""The `kvtrace` command: one entry point, a subcommand per job."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from datetime import datetime, timezone

from kvtrace.collector.store import StoreError, default_dsn

EPILOG = """\
examples:
  kvtrace demo                          trace a small workload into the embedded store
  kvtrace db init                       create or migrate the tables (idempotent)
  kvtrace db status                     schema version, row counts, reported drops
  kvtrace ingest events.jsonl spool/*   load JSONL, Parquet or spool files
  kvtrace export -o events.parquet      write events out for DuckDB / polars
  kvtrace analyze --recipe mamba-hybrid logical vs recoverable vs adopted, and why they differ
  kvtrace analyze --recipe llama=dense --recipe jamba=mamba-hybrid --path duckdb events.parquet
  kvtrace schema --format ddl           print the ClickHouse DDL (or json, arrow)

The store is chosen by --dsn, else $KVTRACE_DSN, else an embedded ClickHouse (chDB) under
$KVTRACE_HOME (default ~/.local/share/kvtrace). A server: --dsn http://user:pass@host:8123/kvtrace
"""


def _time_ns(text: str) -> int:
    """ISO-8601 time (UTC if no zone) or integer nanoseconds since the epoch."""
    if text.isdigit():
        return int(text)
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither ISO-8601 time nor integer ns") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return int(dt.timestamp() * 1e9)


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtrace",
        description="KV-cache lifecycle tracing for LLM serving: logical vs recoverable vs adopted prefix hits.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dsn", help=f"store address (default: {default_dsn()})")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = sub.add_parser("demo", help="trace a small workload into the embedded store and summarize it")
    demo.add_argument("--requests", type=int, default=200, help="requests to simulate (default 200)")

    db = sub.add_parser("db", help="create, migrate and inspect the store")
    dbsub = db.add_subparsers(dest="db_command", metavar="ACTION", required=True)
    init = dbsub.add_parser("init", help="create or migrate tables (idempotent)")
    init.add_argument("--ttl-days", type=_non_negative, default=0, help="drop data older than N days (0 = keep)")
    init.add_argument("--cluster", default="", help="ClickHouse cluster: replicated tables + Distributed")
    dbsub.add_parser("status", help="schema version, row counts, disk use, reported drops")
    ddl = dbsub.add_parser("ddl", help="print the DDL without running it")
    ddl.add_argument("--ttl-days", type=_non_negative, default=0)
    ddl.add_argument("--cluster", default="")
    ddl.add_argument("--database", default="kvtrace")

    ingest = sub.add_parser("ingest", help="load events from JSONL, Parquet or spool files")
    ingest.add_argument("files", nargs="+", help="files to load (format detected from content)")

    export = sub.add_parser("export", help="write stored events to Parquet or JSONL")
    export.add_argument("-o", "--output", required=True, help="output file")
    export.add_argument("--format", choices=["parquet", "jsonl"], default="parquet")
    export.add_argument("--since", type=_time_ns, default=0, help="ISO time or ns; inclusive")
    export.add_argument("--until", type=_time_ns, default=0, help="ISO time or ns; exclusive")
    export.add_argument("--instance", default="")
    export.add_argument("--model", default="")
    export.add_argument("--tenant", default="")

    analyze = sub.add_parser("analyze", help="hit funnel and gap reasons per lookup, by any of three paths")
    analyze.add_argument("parquet", nargs="*", help="Parquet exports (the duckdb path reads these)")
    analyze.add_argument("--recipe", action="append", required=True, metavar="[MODEL=]RECIPE",
                         help="built-in recipe name or .json/.toml file; MODEL= scopes it to one model (repeatable)")
    analyze.add_argument("--path", choices=["clickhouse", "stream", "duckdb"], default="clickhouse",
                         help="where to compute: in the store (default), replayed in Python, or DuckDB on Parquet")
    analyze.add_argument("--by", default="", help="comma-separated dimensions: model,instance,tenant")
    analyze.add_argument("--bucket-s", type=_non_negative, default=0, help="also group by time buckets of N seconds")
    analyze.add_argument("--shared-tenant", action="append", default=[], help="namespace every tenant may reuse")
    analyze.add_argument("-o", "--output", help="write per-lookup results to this Parquet file")

    schema = sub.add_parser("schema", help="print the event schema (JSON Schema, DDL or Arrow)")
    schema.add_argument("--format", choices=["json", "ddl", "arrow", "batch-json"], default="json")
    return parser


def _store(args: argparse.Namespace):  # noqa: ANN202 - imported lazily: `--help` stays fast
    from kvtrace.collector.store import Store

    return Store(args.dsn)


def cmd_db(args: argparse.Namespace) -> int:
    from kvtrace.schema.clickhouse import DdlOptions, schema_statements

    if args.db_command == "ddl":
        opts = DdlOptions(database=args.database, ttl_days=args.ttl_days, cluster=args.cluster)
        print(";\n\n".join(schema_statements(opts)) + ";")
        return 0
    with _store(args) as store:
        if args.db_command == "init":
            changed = store.init(ttl_days=args.ttl_days, cluster=args.cluster)
            print(f"store {store.dsn}: schema version {store.stored_schema_version()}")
            for line in changed:
                print(f"  applied: {line.splitlines()[0]}")
            if not changed:
                print("  already up to date")
            return 0
        status = store.status()
        print(f"store:           {status.dsn}")
        print(f"server:          ClickHouse {status.server_version}")
        if status.schema_version is None:
            print("schema:          none (run `kvtrace db init`)")
            return 1
        print(f"schema version:  {status.schema_version} (this kvtrace: {status.code_schema_version})")
        for t in status.tables:
            print(f"  {t.name:<14} {t.rows:>12,} rows {t.bytes_on_disk / 1e6:>10.2f} MB  {t.partitions} partitions")
        print(f"event sources:   {status.sources}")
        print(f"dropped events:  {status.dropped_events} (reported by emitters)")
        return 0


def cmd_ingest(args: argparse.Namespace) -> int:
    from kvtrace.collector.ingest import ingest_file
    from kvtrace.schema.wire import WireError

    failed = False
    with _store(args) as store:
        store.init()
        for path in args.files:
            try:
                report = ingest_file(store, path)
            except (FileNotFoundError, WireError) as exc:
                print(f"error: {exc}", file=sys.stderr)
                failed = True
                continue
            except Exception as exc:  # noqa: BLE001 - one unloadable file must not stop the rest
                print(f"error: {path}: {type(exc).__name__}: {exc}", file=sys.stderr)
                failed = True
                continue
            torn = f", {report.torn_bytes} torn bytes at the end" if report.torn_bytes else ""
            print(f"{path}: {report.format.value}, {report.stored} stored, {report.rejected} quarantined{torn}")
            for r in report.first_rejections:
                print(f"  rejected {r.message()}", file=sys.stderr)
            if report.rejected > len(report.first_rejections):
                print(f"  ... and {report.rejected - len(report.first_rejections)} more "
                      f"(see table {store.db}.quarantine)", file=sys.stderr)
            failed |= report.rejected > 0
    return 1 if failed else 0


def cmd_export(args: argparse.Namespace) -> int:
    from kvtrace.collector.export import EventFilter, ExportFormat, export_events

    flt = EventFilter(args.since, args.until, args.instance, args.model, args.tenant)
    with _store(args) as store:
        store.require_schema()
        rows = export_events(store, args.output, ExportFormat(args.format), flt)
    print(f"wrote {rows} events to {args.output}")
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    if args.format == "ddl":
        from kvtrace.schema.clickhouse import schema_statements

        print(";\n\n".join(schema_statements()) + ";")
    elif args.format == "arrow":
        from kvtrace.schema.arrow import arrow_schema

        print(arrow_schema())
    else:
        from kvtrace.schema.jsonschema import batch_json_schema, event_json_schema

        print(json.dumps(batch_json_schema() if args.format == "batch-json" else event_json_schema(), indent=2))
    return 0


def _recipes(specs: list[str]):  # noqa: ANN202 - Recipe or {model: Recipe}
    from kvtrace.schema.recipes import load_recipe

    scoped = [spec.partition("=") for spec in specs]
    if len(specs) == 1 and not scoped[0][1]:
        return load_recipe(specs[0])
    if any(not sep for _, sep, _ in scoped):
        raise ValueError("with several --recipe options, scope each one: --recipe MODEL=RECIPE")
    return {model: load_recipe(name) for model, _, name in scoped}


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
}


def _funnel_table(table):  # noqa: ANN001, ANN202 - polars frames, imported lazily
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
    from kvtrace.analysis.funnel import funnel, reasons
    from kvtrace.analysis.reconstruct import UnknownModel
    from kvtrace.analysis.run import AnalysisPath, lookup_results
    from kvtrace.schema.recipes import RecipeError

    by = [d for d in args.by.split(",") if d]
    unknown = set(by) - {"model", "instance", "tenant"}
    if unknown:
        print(f"error: --by takes model, instance, tenant; not {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    try:
        recipes = _recipes(args.recipe)
    except (RecipeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    policy = Policy(shared_tenants=frozenset(args.shared_tenant))
    path = AnalysisPath(args.path)
    try:
        if path is AnalysisPath.DUCKDB:
            frame = lookup_results(path, recipes, policy, parquet=args.parquet)
        else:
            with _store(args) as store:
                store.require_schema()
                frame = lookup_results(path, recipes, policy, store=store)
    except (UnknownModel, ValueError) as exc:
        print(f"error: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    if args.output:
        frame.write_parquet(args.output)
    with pl.Config(tbl_rows=50, tbl_cols=20, tbl_width_chars=200, tbl_hide_dataframe_shape=True,
                   float_precision=3, tbl_hide_column_data_types=True):
        print(f"{frame.height} lookups ({path.value} path)")
        print(_funnel_table(funnel(frame, by, bucket_ns=args.bucket_s * 10**9)))
        if frame.height:
            print("\ngap between logical and recoverable, by reason")
            print(reasons(frame, by).head(20))
    if args.output:
        print(f"per-lookup results: {args.output}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from kvtrace.cli.demo import run_demo

    return run_demo(args.dsn, requests=args.requests)


COMMANDS = {
    "db": cmd_db,
    "ingest": cmd_ingest,
    "export": cmd_export,
    "analyze": cmd_analyze,
    "schema": cmd_schema,
    "demo": cmd_demo,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except StoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
