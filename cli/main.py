"""The `kvtrace` command: one entry point, a subcommand per job."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any
from datetime import datetime, timezone

from kvtrace.cli.extras import missing_extra
from kvtrace.store.dsn import StoreError, default_dsn

EPILOG = """\
examples:
  kvtrace demo                          replay a real trace through a hybrid cache, analyze, write a report
  kvtrace db init                       create or migrate the tables (idempotent)
  kvtrace db status                     schema version, row counts, reported drops
  kvtrace ingest events.jsonl spool/*   load JSONL, Parquet or spool files
  kvtrace export -o events.parquet      write events out for DuckDB / polars
  kvtrace replay trace.jsonl --recipe mamba-hybrid   a request trace through the simulator
  kvtrace experiment trace.jsonl --limit 300          retention policies compared on one trace
  kvtrace analyze --recipe mamba-hybrid logical vs recoverable vs adopted, and why they differ
  kvtrace analyze --recipe llama=dense --recipe jamba=mamba-hybrid --path duckdb events.parquet
  kvtrace costs --recipe dense          load vs recompute: fitted costs, crossovers, seconds lost
  kvtrace capacity --recipe dense       hit rate against capacity per group; the capacity 99% need
  kvtrace report --recipe dense -o r.html   the HTML report, from the store or Parquet files
  kvtrace alerts --webhook URL          alert on divergence, unsafe reuse, gaps and drops
  kvtrace dashboard                     the web dashboard (and `kvtrace grafana` for Grafana)
  kvtrace collector --port 4318         the ingest service a fleet's shims point at
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


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
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

    demo = sub.add_parser("demo", help="replay a real trace through a hybrid multi-tier cache, analyze, report")
    demo.add_argument("--requests", type=_positive, default=200, help="requests of the bundled trace (1-400, default 200)")
    demo.add_argument("--report", help="HTML report path (default: $KVTRACE_HOME/demo-report.html)")

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

    def trace_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("trace", help="trace file: mooncake, qwen or kvtrace JSONL (.gz ok)")
        p.add_argument("--format", choices=["mooncake", "qwen", "kvtrace"], help="default: detected from line 1")
        p.add_argument("--limit", type=_non_negative, default=0, help="first N requests only (0 = all)")
        p.add_argument("--skip-bad", action="store_true", help="skip and count malformed lines instead of stopping")
        p.add_argument("--recipe", default="mamba-hybrid", help="built-in recipe or .json/.toml file")
        p.add_argument("--model", default="sim-model", help="model name the events carry")
        p.add_argument("--tiers-gib", default="4,16,64", help="device,host,disk capacity in GiB (0 = no tier)")
        p.add_argument("--bytes-per-token", type=_positive, default=4096, help="per cache group (default 4096)")

    replay_p = sub.add_parser("replay", help="replay a request trace through an engine into the store")
    trace_args(replay_p)
    replay_p.add_argument("--engine", choices=["sim", "vllm", "sglang", "lmcache"], default="sim",
                          help="sim: the reference simulator (default); vllm: vLLM's own KV-cache manager, no model "
                               "(run kvtrace from vLLM's environment); sglang: SGLang's own radix cache on CPU pools, "
                               "no model (run kvtrace from SGLang's environment); lmcache: a real LMCache engine "
                               "(CPU and disk backends) storing and retrieving each request's KV (run kvtrace from "
                               "LMCache's environment)")
    replay_p.add_argument("--vllm-layout", choices=["dense", "full+sliding", "full+mamba"], default="full+sliding",
                          help="vllm: cache groups to build (default full+sliding)")
    replay_p.add_argument("--vllm-blocks", type=_positive, default=16384, help="vllm: KV blocks of 16 tokens")
    replay_p.add_argument("--sglang-mix", choices=["full", "full+swa", "full+mamba", "full+swa+mamba"],
                          default="full", help="sglang: the cache's components (default full)")
    replay_p.add_argument("--sglang-core", choices=["rust", "python"], default="rust", help="sglang: tree core")
    replay_p.add_argument("--sglang-tokens", type=_positive, default=1 << 18, help="sglang: device KV slots")
    replay_p.add_argument("--lmcache-chunk", type=_positive, default=256, help="lmcache: tokens per chunk")
    replay_p.add_argument("--lmcache-cpu-gb", type=float, default=0.5, help="lmcache: CPU cache size, GB")
    replay_p.add_argument("--lmcache-disk-gb", type=float, default=4.0, help="lmcache: disk cache size, GB (0: none)")
    replay_p.add_argument("--lmcache-disk-dir", default="", help="lmcache: disk cache folder (default: a new temp one)")
    replay_p.add_argument("--recipe-out", help="vllm, sglang, lmcache: where to write the recipe derived from the engine "
                                               "(default MODEL.recipe.json)")
    replay_p.add_argument("--policy", default="lru", help="retention: lru, interval:N or branch")
    replay_p.add_argument("--speed", type=float, default=0.0, help="0 = as fast as possible, 1 = trace time")
    replay_p.add_argument("--tenant", default="default", help="tenant for requests whose trace names none")

    verify = sub.add_parser("verify", help="prove a sample of verdicts by re-executing prompts without the cache "
                                           "(run from the engine's environment)")
    verify.add_argument("model", help="model directory or name the engine loads")
    src = verify.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", help='JSONL, one {"prompt_token_ids": [...]} per line')
    src.add_argument("--trace", help="request trace (mooncake, qwen or kvtrace JSONL): tokens from its hash ids")
    verify.add_argument("--limit", type=_non_negative, default=0, help="--trace: first N requests only (0 = all)")
    verify.add_argument("--per-class", type=_positive, default=2, help="requests verified per verdict class")
    verify.add_argument("--n-gen", type=_positive, default=4, help="generated tokens compared per request")
    verify.add_argument("--top-k", type=_positive, default=5, help="log-probabilities kept per position")
    verify.add_argument("--noise-prompts", type=_positive, default=2, help="prompts run fresh twice for the floor")
    verify.add_argument("--floor-factor", type=float, default=4.0, help="divergence: above this many noise floors")
    verify.add_argument("--atol", type=float, default=1e-4, help="divergence: and above this absolute difference")
    verify.add_argument("--block-size", type=_positive, default=32, help="engine KV block size (CPU: multiple of 32)")
    verify.add_argument("--max-model-len", type=_positive, default=4096, help="prompts are cut to fit")
    verify.add_argument("--instance", default="verify", help="instance name the events carry")
    verify.add_argument("--no-store", action="store_true", help="print only; store nothing")

    experiment = sub.add_parser("experiment", help="compare retention policies on one trace (no store needed)")
    trace_args(experiment)
    experiment.add_argument("--policies", default="lru,interval:512,branch", help="comma-separated policies")
    experiment.add_argument("-o", "--output", help="also write the table to this Parquet file")

    analyze = sub.add_parser("analyze", help="hit funnel and gap reasons per lookup, by any of three paths")
    analyze.add_argument("parquet", nargs="*", help="event files for the duckdb path: Parquet exports, JSONL or "
                                                    "spool files")
    analyze.add_argument("--recipe", action="append", required=True, metavar="[[ENGINE:]MODEL=]RECIPE",
                         help="built-in recipe name or .json/.toml file; MODEL= (or ENGINE:MODEL=) scopes it to one model, an unscoped one serves every other model (repeatable)")
    analyze.add_argument("--path", choices=["clickhouse", "stream", "duckdb"], default="clickhouse",
                         help="where to compute: in the store (default), replayed in Python, or DuckDB on Parquet")
    analyze.add_argument("--by", default="", help="comma-separated dimensions: model,instance,tenant")
    analyze.add_argument("--bucket-s", type=_non_negative, default=0, help="also group by time buckets of N seconds")
    analyze.add_argument("--shared-tenant", action="append", default=[], help="namespace every tenant may reuse")
    analyze.add_argument("-o", "--output", help="write per-lookup results to this Parquet file")
    analyze.add_argument("--joined-output", help="write the engine + KV store picture per request (vLLM with "
                                                  "LMCache: instances X and X/lmcache) to this Parquet file")
    analyze.add_argument("--write-verdicts", action="store_true",
                         help="also store the per-lookup rows in the verdicts table (what dashboards and alerts read "
                              "when no collector reconstructs live)")

    costs = sub.add_parser("costs", help="load vs recompute: fitted costs, crossovers, seconds lost")
    costs.add_argument("parquet", nargs="*", help="Parquet exports to read instead of the store")
    costs.add_argument("--recipe", action="append", required=True, metavar="[[ENGINE:]MODEL=]RECIPE",
                       help="as for analyze: the verdicts say what each lookup could have restored")
    costs.add_argument("--starts", default="0,1024,8192,32768",
                       help="context positions (tokens) to give the crossover at (default 0,1024,8192,32768)")
    costs.add_argument("-o", "--output", help="write the per-lookup restore decisions to this Parquet file")

    dash = sub.add_parser("dashboard", help="serve the web dashboard over the store")
    dash.add_argument("--host", default="127.0.0.1")
    dash.add_argument("--port", type=_positive, default=8050)
    graf = sub.add_parser("grafana", help="write the Grafana dashboards (ClickHouse data source) as JSON")
    graf.add_argument("-o", "--output", default="grafana", help="directory (default ./grafana)")
    graf.add_argument("--database", default="", help="database the panels query (default: the store's)")

    al = sub.add_parser("alerts", help="evaluate alert rules on the store, deliver to a webhook")
    al.add_argument("--rules", help="YAML rule file (default: the built-in rules; see --show-default-rules)")
    al.add_argument("--show-default-rules", action="store_true", help="print the built-in rules and exit")
    al.add_argument("--recipe", action="append", default=[], metavar="[[ENGINE:]MODEL=]RECIPE",
                    help="compute verdicts from events with these recipes (default: the collector's live verdicts)")
    al.add_argument("--webhook", default="", help="Alertmanager-compatible webhook URL for firing/resolved alerts")
    al.add_argument("--interval-s", type=_positive, default=30, help="seconds between evaluations (default 30)")
    al.add_argument("--once", action="store_true", help="evaluate once and exit")
    al.add_argument("--metrics-port", type=_positive, help="also serve the rule values as Prometheus metrics here")

    rep = sub.add_parser("report", help="write the HTML report (funnel, reasons, crossover, capacity)")
    rep.add_argument("parquet", nargs="*", help="Parquet exports to read instead of the store")
    rep.add_argument("--recipe", action="append", required=True, metavar="[[ENGINE:]MODEL=]RECIPE")
    rep.add_argument("-o", "--output", default="kvtrace-report.html", help="where (default kvtrace-report.html)")
    rep.add_argument("--bucket-s", type=_positive, default=60, help="funnel time buckets (default 60 s)")

    cal = sub.add_parser("calibrate", help="measure prefill and copy costs on this machine (needs torch)")
    cal.add_argument("--model", required=True, help="the model name events carry (what cost models join on)")
    cal.add_argument("--layers", type=_positive, default=4)
    cal.add_argument("--hidden", type=_positive, default=512)
    cal.add_argument("--heads", type=_positive, default=8)
    cal.add_argument("--kv-heads", type=_positive, default=2)
    cal.add_argument("--head-dim", type=_positive, default=64)
    cal.add_argument("--intermediate", type=_positive, default=1408)
    cal.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    cal.add_argument("--device", default="cpu", help="cpu, or cuda[:N] when a GPU is present")
    cal.add_argument("--starts", default="0,512,1024,2048", help="cached tokens before each timed chunk")
    cal.add_argument("--chunks", default="64,128,256,512", help="tokens per timed chunk")
    cal.add_argument("--sizes-mib", default="1,2,4,8,16,32,64,128", help="copy sizes for tier bandwidth")
    cal.add_argument("--repeats", type=_positive, default=3)

    capacity = sub.add_parser("capacity", help="hit rate against cache capacity per group, from stack distances")
    capacity.add_argument("parquet", nargs="*", help="Parquet exports to read instead of the store")
    capacity.add_argument("--recipe", action="append", required=True, metavar="[[ENGINE:]MODEL=]RECIPE")
    capacity.add_argument("--capacities", default="64,256,1024,4096,16384,65536",
                          help="capacities to evaluate, in blocks of each group (comma-separated)")
    capacity.add_argument("--requests", type=float, default=0.99, help="share of requests to serve (default 0.99)")
    capacity.add_argument("--prefix", type=float, default=0.99, help="share of their reusable prefix (default 0.99)")

    col = sub.add_parser("collector", help="run the ingest service (HTTP: kvtrace batches and OTLP logs)")
    col.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    col.add_argument("--port", type=_positive, default=4318, help="port (default 4318)")
    col.add_argument("--spool-dir", help="durable spool (default: $KVTRACE_COLLECTOR_SPOOL_DIR, else under $KVTRACE_HOME)")
    col.add_argument("--max-spool-mib", type=_positive, default=1024, help="spool bound; 429 near it (default 1024)")
    col.add_argument("--tokens-file", help="bearer tokens: `token tenant[,tenant]` per line, `*` for all tenants "
                                           "(also $KVTRACE_COLLECTOR_TOKENS_FILE / $KVTRACE_COLLECTOR_TOKENS)")
    col.add_argument("--recipe", action="append", default=[], metavar="[[ENGINE:]MODEL=]RECIPE",
                     help="turn on live reconstruction with these recipes (repeatable, as for analyze)")
    col.add_argument("--lateness-ms", type=_non_negative, default=2000,
                     help="live reconstruction waits this long for out-of-order events (default 2000)")
    col.add_argument("--zmq", metavar="ENDPOINT", help="also subscribe to an engine's ZMQ KV-event stream "
                                                      "(vLLM / SGLang), e.g. tcp://engine:5557")
    col.add_argument("--zmq-replay", metavar="ENDPOINT", help="the publisher's replay socket, to fill sequence gaps")
    col.add_argument("--zmq-instance", default="", help="instance name for the stream's events (default: the endpoint)")
    col.add_argument("--zmq-model", default="", help="model the stream's engine serves")
    col.add_argument("--zmq-tenant", default="", help="tenant namespace for the stream's events")
    col.add_argument("--zmq-engine", default="", help="the publishing engine, e.g. vllm or sglang")
    col.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    schema = sub.add_parser("schema", help="print the event schema (JSON Schema, DDL or Arrow)")
    schema.add_argument("--format", choices=["json", "ddl", "arrow", "batch-json"], default="json")
    return parser


def _store(args: argparse.Namespace):  # noqa: ANN202 - imported lazily: `--help` stays fast
    from kvtrace.store.client import Store

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
    from kvtrace.store.ingest import ingest_file
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
    from kvtrace.store.export import EventFilter, ExportFormat, export_events

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


def _sim_config(args: argparse.Namespace):  # noqa: ANN202 - SimConfig, imported lazily
    from kvtrace.instrumentation.simulator import SimConfig
    from kvtrace.schema.recipes import load_recipe

    try:
        gib = [float(x) for x in args.tiers_gib.split(",")]
    except ValueError:
        gib = []
    if len(gib) != 3 or min(gib) < 0 or gib[0] <= 0:
        raise ValueError(f"--tiers-gib takes device,host,disk in GiB with a device > 0, not {args.tiers_gib!r}")
    capacity = tuple(int(g * 2**30) for g in gib)
    return SimConfig(recipe=load_recipe(args.recipe), model=args.model, bytes_per_token=args.bytes_per_token,
                     capacity_bytes=capacity)  # type: ignore[arg-type]


def _trace(args: argparse.Namespace):  # noqa: ANN202
    from kvtrace.instrumentation.traces import read_trace

    return read_trace(args.trace, args.format, skip_bad=args.skip_bad, limit=args.limit)


def cmd_replay(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from kvtrace.cli.experiment import PolicySpec
    from kvtrace.cli.progress import bar as progress_bar
    from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
    from kvtrace.instrumentation.replay import ReplayOptions, replay
    from kvtrace.instrumentation.simulator import CacheSimulator
    from kvtrace.instrumentation.sinks.store import StoreSink
    from kvtrace.instrumentation.traces import TraceError
    from kvtrace.schema.recipes import RecipeError, UnknownModel

    if args.engine in ("vllm", "sglang", "lmcache"):
        from kvtrace.cli.replay_engines import replay_lmcache, replay_sglang, replay_vllm

        run = {"vllm": replay_vllm, "sglang": replay_sglang, "lmcache": replay_lmcache}[args.engine]
        return run(args, _trace, _store)
    try:
        spec = PolicySpec.parse(args.policy)
        config = replace(_sim_config(args), checkpoints=spec.checkpoints, checkpoint_every=spec.checkpoint_every)
        reader = _trace(args)
        with _store(args) as store:
            store.init()
            emitter = BatchEmitter(StoreSink(store), BatchConfig(max_queue_size=1 << 20, shutdown_timeout_millis=600_000),
                                   instance=config.instance, engine="sim", register_atexit=False)
            sim = CacheSimulator(config, emitter)
            with progress_bar(desc="replay", unit="req", disable=None) as bar:
                report = replay(reader, sim, ReplayOptions(speed=args.speed, tenant=args.tenant),
                                progress=lambda _: bar.update())
            emitter.force_flush(timeout_millis=600_000)
            emitter.shutdown()
    except (TraceError, RecipeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stats = emitter.stats()
    print(f"replayed {report.requests} requests ({report.prompt_tokens} prompt tokens, {report.adopted_tokens} adopted) "
          f"in {report.seconds:.1f} s: {stats.exported} events stored, {stats.dropped} dropped")
    if reader.skipped:
        print(f"skipped {reader.skipped} malformed lines; first: {reader.errors[0]}", file=sys.stderr)
    print(f"next: kvtrace analyze --recipe {args.model}={args.recipe}")
    return 1 if stats.dropped else 0


def cmd_experiment(args: argparse.Namespace) -> int:
    import polars as pl

    from kvtrace.cli.experiment import PolicySpec, compare, display
    from kvtrace.cli.progress import bar as progress_bar
    from kvtrace.instrumentation.traces import TraceError
    from kvtrace.schema.recipes import RecipeError, UnknownModel

    try:
        specs = [PolicySpec.parse(p) for p in args.policies.split(",") if p]
        config = _sim_config(args)
        reader = _trace(args)
        trace = list(reader)
        with progress_bar(total=len(trace) * len(specs), desc="policies", unit="req", disable=None) as bar:
            table = compare(trace, config, specs, progress=lambda _s, _n: bar.update())
    except (TraceError, RecipeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.output:
        table.write_parquet(args.output)
    with pl.Config(tbl_hide_dataframe_shape=True, tbl_hide_column_data_types=True, tbl_width_chars=200,
                   tbl_cols=20):
        print(display(table))
    for row in table.iter_rows(named=True):
        print(f"{row['policy']:<13} {row['note']}")
    return 0


def _recipes(specs: list[str]):  # noqa: ANN202 - a RecipeBook, imported lazily
    from kvtrace.schema.recipes import RecipeBook

    return RecipeBook.parse(specs)


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
    from kvtrace.analysis.run import AnalysisPath, lookup_results
    from kvtrace.schema.recipes import RecipeError, UnknownModel

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
            import tempfile

            from kvtrace.analysis.planning import as_parquet

            with tempfile.TemporaryDirectory(prefix="kvtrace-") as tmp:
                frame = lookup_results(path, recipes, policy, parquet=as_parquet(args.parquet, tmp))
            probes: list = []
        else:
            with _store(args) as store:
                store.require_schema()
                frame = lookup_results(path, recipes, policy, store=store)
                probes = _probes(store)
    except (UnknownModel, ValueError) as exc:
        print(f"error: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    checked = _probe_rows(frame, probes)
    if args.output:
        frame.write_parquet(args.output)
    if args.write_verdicts:
        from kvtrace.schema.arrow import conform, to_arrow
        from kvtrace.schema.clickhouse import VERIFICATIONS
        from kvtrace.schema.verdicts import LookupResult, Verification

        with _store(args) as store:
            store.init()
            store.insert_arrow("verdicts", conform(frame.to_arrow(), LookupResult))
            if checked:
                store.insert_arrow(VERIFICATIONS.name, to_arrow(checked, Verification))
    with pl.Config(tbl_rows=50, tbl_cols=20, tbl_width_chars=200, tbl_hide_dataframe_shape=True,
                   float_precision=3, tbl_hide_column_data_types=True):
        print(f"{frame.height} lookups ({path.value} path)")
        print(_funnel_table(funnel(frame, by, bucket_ns=args.bucket_s * 10**9)))
        if frame.height:
            print("\ngap between logical and recoverable, by reason")
            print(reasons(frame, by).head(20))
        _print_joined(frame, args.joined_output)
        _print_probes(checked, len(probes))
    if args.output:
        print(f"per-lookup results: {args.output}")
    return 0


def _probes(store: Any) -> list:
    """The engine canaries' probe events (few: a small sample of requests)."""
    from kvtrace.schema.arrow import from_arrow

    return [e for table in store.iter_event_batches("kind = 'probe'") for e in from_arrow(table)]


def _probe_rows(frame: Any, probes: list) -> list:
    """Canary probes judged against their re-runs' verdicts."""
    if not probes:
        return []
    import polars as pl

    from kvtrace.analysis.funnel import frame_results
    from kvtrace.analysis.oracle import probe_verifications
    from kvtrace.schema.events import PROBE_PREFIX

    reruns = frame.filter(pl.col("request_id").str.starts_with(PROBE_PREFIX))
    return probe_verifications(probes, frame_results(reruns))


def _print_probes(rows: list, probes: int) -> None:
    """What the engine canaries found: the reuse claims re-execution checked."""
    if not probes:
        return
    from collections import Counter

    from kvtrace.schema.verdicts import Agreement

    counts = Counter(r.agreement for r in rows)
    print(f"\ncanary: {probes} probes, {len(rows)} judged: "
          + (", ".join(f"{a.value} {counts[a]}" for a in Agreement if counts[a]) or "none"))
    for r in rows:
        if r.agreement in (Agreement.DIVERGED, Agreement.ALARM_CONFIRMED):
            print(f"  {r.instance} {r.request_id}: {r.agreement.value}: {r.detail}")


def _print_joined(frame: Any, output: str | None) -> None:
    """Engines with a KV store beside them (vLLM with LMCache): one picture per request."""
    import polars as pl

    from kvtrace.analysis.join import join_frame

    joined = join_frame(frame)
    if output:
        joined.write_parquet(output)
        print(f"engine + store results: {output}")
    if not joined.height:
        return
    alone = frame.group_by("instance").agg(pl.col("unsafe_reuse").sum().alias("unsafe_engine_alone"))
    table = (joined.group_by("engine_instance", "store_instance")
             .agg(pl.len().alias("lookups"), pl.col("logical_hit_tokens").sum().alias("logical"),
                  pl.col("recoverable_hit_tokens").sum().alias("recoverable"),
                  pl.col("adopted_tokens").sum().alias("adopted"), pl.col("unsafe_reuse").sum().alias("unsafe"),
                  pl.col("missed_reuse").sum().alias("missed"))
             .join(alone, left_on="engine_instance", right_on="instance", how="left"))
    print("\nengine + KV store, per request (the engine's blocks and the store's chunks joined on positions)")
    print(table.sort("engine_instance"))


def _int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{name}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise ValueError(f"{name}: expected non-negative integers, got {text!r}")
    return values


def _events_and_results(args: argparse.Namespace, recipes):  # noqa: ANN001, ANN202
    import tempfile

    from kvtrace.analysis.planning import as_parquet, event_frame
    from kvtrace.analysis.run import AnalysisPath, lookup_results

    if args.parquet:
        with tempfile.TemporaryDirectory(prefix="kvtrace-") as tmp:
            files = as_parquet(args.parquet, tmp)
            return event_frame(parquet=files), lookup_results(AnalysisPath.DUCKDB, recipes, parquet=files)
    with _store(args) as store:
        store.require_schema()
        return event_frame(store=store), lookup_results(AnalysisPath.CLICKHOUSE, recipes, store=store)


def _calibrations(args: argparse.Namespace):  # noqa: ANN202
    """Calibrated timings from the store (none when reading Parquet files only, or none stored)."""
    from kvtrace.schema.clickhouse import CALIBRATIONS

    if args.parquet and not args.dsn:
        return None
    with _store(args) as store:
        if store.stored_schema_version() is None:
            return None
        frame = store.query_polars(f"SELECT * FROM {store.db}.{CALIBRATIONS.name}")
    return frame if frame.height else None


def _table(frame) -> str:  # noqa: ANN001
    import polars as pl

    with pl.Config(tbl_rows=60, tbl_cols=20, tbl_width_chars=200, tbl_hide_dataframe_shape=True, float_precision=3,
                   tbl_hide_column_data_types=True):
        return str(frame) if frame.height else "  (none)"


def cmd_costs(args: argparse.Namespace) -> int:
    from kvtrace.analysis.planning import cost_report
    from kvtrace.schema.recipes import RecipeError, UnknownModel

    try:
        recipes = _recipes(args.recipe)
        starts = _int_list(args.starts, "--starts")
        events, results = _events_and_results(args, recipes)
    except (RecipeError, UnknownModel, ValueError) as exc:
        print(f"error: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    report = cost_report(events, results, starts, calibrations=_calibrations(args))
    print("transfers (seconds = latency + bytes / bandwidth), from timed loads")
    print(_table(report.transfer_table()))
    print("\nprefill (seconds = fixed + per token + per token pair of attention), from timed adopts")
    print(_table(report.prefill_table()))
    print("\ncrossover: tokens to restore above which loading beats recomputing, by context position")
    print(_table(report.crossovers))
    print("\nrestore decisions on lookups with recoverable state off the device")
    print(_table(report.lost()))
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


def cmd_dashboard(args: argparse.Namespace) -> int:
    import uvicorn

    from kvtrace.dashboards.web import create_dashboard_app

    store = _store(args)
    store.require_schema()
    print(f"dashboard on http://{args.host}:{args.port}/ over {store.dsn}")
    uvicorn.run(create_dashboard_app(store), host=args.host, port=args.port, log_level="warning")
    return 0


def cmd_grafana(args: argparse.Namespace) -> int:
    from kvtrace.store.dsn import parse_dsn
    from kvtrace.dashboards.grafana import write_dashboards

    db = args.database or parse_dsn(args.dsn or default_dsn()).database
    for path in write_dashboards(args.output, db):
        print(f"wrote {path} (import it in Grafana with the ClickHouse data source)")
    return 0


def cmd_alerts(args: argparse.Namespace) -> int:
    from kvtrace.dashboards.alerts import (
        DEFAULT_RULES,
        AlertLoop,
        Evaluator,
        RuleError,
        computed_verdicts,
        rules_from_path,
    )
    from kvtrace.schema.recipes import RecipeError, UnknownModel

    if args.show_default_rules:
        print(DEFAULT_RULES, end="")
        return 0
    try:
        rules = rules_from_path(args.rules)
        recipes = _recipes(args.recipe) if args.recipe else None
    except (RuleError, RecipeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    store = _store(args)
    store.require_schema()
    loop = AlertLoop(Evaluator(store, rules, computed_verdicts(store, recipes) if recipes else None), args.webhook)
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, registry=loop.registry)
    if args.once:
        loop.cycle()
        firing = loop.state.firing()
        print(f"{len(rules)} rules evaluated; {len(firing)} firing")
        return 0
    print(f"evaluating {len(rules)} rules every {args.interval_s} s (Ctrl-C to stop)")
    loop.run(args.interval_s)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from kvtrace.analysis.funnel import funnel
    from kvtrace.analysis.planning import capacity_report, cost_report
    from kvtrace.dashboards.report import write_report
    from kvtrace.schema.recipes import RecipeError, UnknownModel

    try:
        recipes = _recipes(args.recipe)
        events, results = _events_and_results(args, recipes)
    except (RecipeError, UnknownModel, ValueError) as exc:
        print(f"error: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    costs = cost_report(events, results, calibrations=_calibrations(args))
    capacity = capacity_report(events, recipes, [16, 64, 256, 1024, 4096, 16384, 65536, 262144])
    totals = funnel(results).row(0, named=True) if results.height else {}
    source = ", ".join(args.parquet) if args.parquet else str(args.dsn or "the default store")
    summary = [("source", source), ("events", f"{events.height:,}"), ("lookups", f"{results.height:,}")]
    summary += [(f"{name} rate", f"{totals[f'{name}_token_rate']:.1%}") for name in
                ("logical", "recoverable", "resident", "adopted") if f"{name}_token_rate" in totals]
    lost = costs.lost()
    if lost.height:
        summary.append(("seconds lost to the wrong restore choice",
                        f"{lost['lost_restoring_s'].sum() + lost['lost_recomputing_s'].sum():.3f}"))
    path = write_report(args.output, "kvtrace report", summary, results, bucket_ns=args.bucket_s * 10**9,
                        crossovers=costs.crossovers, capacity=[(r.model, r.curve) for r in capacity])
    print(f"report: {path}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    import uuid

    import polars as pl

    try:
        import torch
    except ImportError:
        print("error: calibrate needs torch: pip install 'kvtrace[torch]' (or use your engine's torch)",
              file=sys.stderr)
        return 2
    from kvtrace.analysis.calibrate import ModelShape, calibrate_prefill, calibrate_transfers
    from kvtrace.analysis.costs import fit_prefill, fit_transfers
    from kvtrace.analysis.planning import CostReport, empty_events
    from kvtrace.schema.arrow import to_arrow
    from kvtrace.schema.clickhouse import CALIBRATIONS
    from kvtrace.schema.records import CalibrationSample

    try:
        shape = ModelShape(args.layers, args.hidden, args.heads, args.kv_heads, args.head_dim, args.intermediate,
                           args.dtype)
        starts, chunks = _int_list(args.starts, "--starts"), _int_list(args.chunks, "--chunks")
        sizes = [m << 20 for m in _int_list(args.sizes_mib, "--sizes-mib")]
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: no CUDA device here")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    run_id = uuid.uuid4().hex[:12]
    samples = [*calibrate_prefill(shape, args.model, starts, chunks, args.device, args.repeats, run_id),
               *calibrate_transfers(args.model, sizes, args.device, args.repeats, run_id)]
    table = to_arrow(samples, CalibrationSample)
    with _store(args) as store:
        store.init()
        store.insert_arrow(CALIBRATIONS.name, table)
    measured = pl.from_arrow(table)
    assert isinstance(measured, pl.DataFrame)
    none = empty_events()
    report = CostReport(fit_transfers(none, min_samples=3, calibrations=measured),
                        fit_prefill(none, min_samples=4, calibrations=measured),
                        pl.DataFrame(), pl.DataFrame(), pl.DataFrame())
    print(f"calibration {run_id} on {samples[0].device}: {len(samples)} timings stored for model {args.model}")
    print(_table(report.prefill_table()))
    print(_table(report.transfer_table()))
    print(f"KV bytes per token of this shape: {shape.kv_bytes_per_token()}")
    print(f"next: kvtrace costs --recipe {args.model}=RECIPE   (uses these where events carry no timings)")
    return 0


def cmd_capacity(args: argparse.Namespace) -> int:
    from kvtrace.analysis.planning import capacity_report, event_frame
    from kvtrace.schema.recipes import RecipeError, UnknownModel

    try:
        recipes = _recipes(args.recipe)
        capacities = _int_list(args.capacities, "--capacities")
        if not (0 < args.requests <= 1 and 0 < args.prefix <= 1):
            raise ValueError("--requests and --prefix are shares in (0, 1]")
        if args.parquet:
            import tempfile

            from kvtrace.analysis.planning import as_parquet

            with tempfile.TemporaryDirectory(prefix="kvtrace-") as tmp:
                events = event_frame(parquet=as_parquet(args.parquet, tmp))
        else:
            with _store(args) as store:
                store.require_schema()
                events = event_frame(store=store)
    except (RecipeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    reports = capacity_report(events, recipes, capacities, args.requests, args.prefix)
    if not reports:
        print("no lookups for the given recipes' models: nothing to size")
    for r in reports:
        print(f"model {r.model}: share of prompt tokens resumable, by each group's capacity (others unlimited)")
        print(_table(r.curve))
        for n in r.needs:
            size = r.block_bytes.get(n.group)
            gib = f" = {n.blocks * size / 2**30:.2f} GiB" if size else ""
            print(f"  group {n.group} ({n.component}): {n.blocks} blocks{gib} keep {n.prefix:.0%} of the reusable "
                  f"prefix for {n.requests:.0%} of requests")
    return 0


def cmd_collector(args: argparse.Namespace) -> int:
    from kvtrace.collector.auth import AuthConfigError, TokenTable
    from kvtrace.collector.serve import serve
    from kvtrace.collector.service import config_from_env
    from kvtrace.collector.subscribe import KvEventSource
    from kvtrace.schema.recipes import RecipeError, UnknownModel

    try:
        config = config_from_env(
            dsn=args.dsn, spool_dir=args.spool_dir, max_spool_bytes=args.max_spool_mib << 20,
            tokens=TokenTable.from_env(path=args.tokens_file),
            recipes=_recipes(args.recipe) if args.recipe else None, lateness_ns=args.lateness_ms * 10**6,
            kv_event_sources=(KvEventSource(args.zmq, args.zmq_replay, args.zmq_instance, args.zmq_model,
                                            args.zmq_tenant, engine=args.zmq_engine),) if args.zmq else None)
    except (AuthConfigError, RecipeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return serve(config, host=args.host, port=args.port, log_level=args.log_level)


def cmd_verify(args: argparse.Namespace) -> int:
    from kvtrace.cli.verify import run_verify

    return run_verify(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from kvtrace.cli.demo import run_demo

    return run_demo(args.dsn, requests=args.requests, report=args.report)


COMMANDS = {
    "db": cmd_db,
    "ingest": cmd_ingest,
    "export": cmd_export,
    "analyze": cmd_analyze,
    "replay": cmd_replay,
    "experiment": cmd_experiment,
    "schema": cmd_schema,
    "demo": cmd_demo,
    "collector": cmd_collector,
    "costs": cmd_costs,
    "capacity": cmd_capacity,
    "calibrate": cmd_calibrate,
    "report": cmd_report,
    "alerts": cmd_alerts,
    "dashboard": cmd_dashboard,
    "grafana": cmd_grafana,
    "verify": cmd_verify,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except StoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        if (line := missing_extra(exc)) is None:
            raise
        print(f"error: kvtrace {args.command}: {line}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
