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


def cmd_demo(args: argparse.Namespace) -> int:
    from kvtrace.cli.demo import run_demo

    return run_demo(args.dsn, requests=args.requests)


COMMANDS = {"db": cmd_db, "ingest": cmd_ingest, "export": cmd_export, "schema": cmd_schema, "demo": cmd_demo}


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
