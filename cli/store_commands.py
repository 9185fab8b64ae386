"""`kvtrace db`, `ingest`, `export` and `schema`: the store's tables, the ways in and out of them,
and the event schema they hold."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone

from kvtrace.cli.arguments import gib_text, non_negative, time_ns


def register(sub: argparse._SubParsersAction) -> None:
    db = sub.add_parser("db", help="create, migrate and inspect the store")
    dbsub = db.add_subparsers(dest="db_command", metavar="ACTION", required=True)
    init = dbsub.add_parser("init", help="create or migrate tables (idempotent)")
    init.add_argument("--ttl-days", type=non_negative, default=0, help="drop data older than N days (0 = keep)")
    init.add_argument("--cluster", default="", help="ClickHouse cluster: replicated tables + Distributed")
    init.set_defaults(handler=cmd_db_init, extra="store")
    status = dbsub.add_parser("status", help="schema version, row counts, disk use, reported drops")
    status.set_defaults(handler=cmd_db_status, extra="store")
    ddl = dbsub.add_parser("ddl", help="print the DDL without running it")
    ddl.add_argument("--ttl-days", type=non_negative, default=0, help="drop data older than N days (0 = keep)")
    ddl.add_argument("--cluster", default="", help="ClickHouse cluster: replicated tables + Distributed")
    ddl.add_argument("--database", default="kvtrace", help="database the statements create")
    ddl.set_defaults(handler=cmd_db_ddl)

    ingest = sub.add_parser("ingest", help="load events from JSONL, Parquet or spool files")
    ingest.add_argument("files", nargs="+", help="files to load (format detected from content)")
    ingest.set_defaults(handler=cmd_ingest, extra="store")

    export = sub.add_parser("export", help="write stored events to Parquet or JSONL")
    export.add_argument("-o", "--output", required=True, help="output file")
    export.add_argument("--format", choices=["parquet", "jsonl"], default="parquet", help="file format")
    export.add_argument("--since", type=time_ns, default=0, help="ISO time or ns; inclusive")
    export.add_argument("--until", type=time_ns, default=0, help="ISO time or ns; exclusive")
    export.add_argument("--instance", default="", help="only this instance's events (default: all)")
    export.add_argument("--model", default="", help="only this model's events (default: all)")
    export.add_argument("--tenant", default="", help="only this tenant's events (default: all)")
    export.set_defaults(handler=cmd_export, extra="store")

    schema = sub.add_parser("schema", help="print the event schema (JSON Schema, DDL or Arrow)")
    schema.add_argument("--format", choices=["json", "ddl", "arrow", "batch-json"], default="json",
                        help="json: an event's JSON Schema; batch-json: a batch's; ddl: ClickHouse tables; "
                             "arrow: the Arrow schema")
    schema.set_defaults(handler=cmd_schema, extra="arrow")


def cmd_db_ddl(args: argparse.Namespace) -> int:
    from kvtrace.schema.clickhouse import DdlOptions, schema_statements

    opts = DdlOptions(database=args.database, ttl_days=args.ttl_days, cluster=args.cluster)
    print(";\n\n".join(schema_statements(opts)) + ";")
    return 0


def cmd_db_init(args: argparse.Namespace) -> int:
    from kvtrace.store.client import Store

    with Store(args.dsn) as store:
        changed = store.init(ttl_days=args.ttl_days, cluster=args.cluster)
        print(f"store {store.dsn}: schema version {store.stored_schema_version()}")
    for line in changed:
        print(f"  applied: {line.splitlines()[0]}")
    if not changed:
        print("  already up to date")
    return 0


def cmd_db_status(args: argparse.Namespace) -> int:
    from kvtrace.store.client import Store

    with Store(args.dsn) as store:
        status = store.status()
        engines = store.engines() if status.schema_version is not None else []
    print(f"store:           {status.dsn}")
    print(f"server:          ClickHouse {status.server_version}")
    if status.schema_version is None:
        print("schema:          none (run `kvtrace db init`)")
        return 1
    print(f"schema version:  {status.schema_version} (this kvtrace: {status.code_schema_version})")
    for t in status.tables:
        print(f"  {t.name:<14} {t.rows:>12,} rows {gib_text(t.bytes_on_disk):>14}  {t.partitions} partitions")
    print(f"event sources:   {status.sources}")
    print(f"dropped events:  {status.dropped_events} (reported by emitters)")
    print(f"engines:         {len(engines)} attached (each instance's latest)")
    for e in engines:
        groups = ", ".join(f"{g.component.value}/{g.block_size}" + (f" w{g.window}" if g.window else "")
                           for g in e.recipe.groups)
        version = f" {e.engine_version}" if e.engine_version else ""
        limit = f", max_model_len {e.max_model_len}" if e.max_model_len else ""
        print(f"  {e.instance:<24} {e.engine}{version}  {e.model}  [{groups}]{limit}")
    print(f"ended unclean:   {len(status.unclean)} emitters (their process died before they shut down)")
    for end in status.unclean:
        when = datetime.fromtimestamp(end.ended_ns / 1e9, timezone.utc).isoformat(sep=" ", timespec="seconds")
        lost = f"{end.missing:,} missing" if end.missing else "nothing missing"
        if end.missing:
            lost += f" ({end.dropped:,} dropped as counted, {end.unaccounted:,} unaccounted)"
        print(f"  {end.instance or '?'} ({end.engine or '?'}, source {end.source_id:016x}): ended {when}; "
              f"{end.emitted:,} emitted, {end.stored:,} stored, {lost}; "
              f"{end.recovered:,} shipped from its journal after it died")
    return 0


def cmd_ingest(args: argparse.Namespace) -> int:
    from kvtrace.schema.wire import WireError
    from kvtrace.store.client import Store
    from kvtrace.store.ingest import ingest_file

    failed = False
    with Store(args.dsn) as store:
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
    from kvtrace.store.client import Store
    from kvtrace.store.export import EventFilter, ExportError, ExportFormat, export_events

    flt = EventFilter(args.since, args.until, args.instance, args.model, args.tenant)
    with Store(args.dsn) as store:
        store.require_schema()
        try:
            rows = export_events(store, args.output, ExportFormat(args.format), flt)
        except ExportError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
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
