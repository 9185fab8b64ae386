"""`kvtrace collector`, `dashboard`, `grafana` and `alerts`: the long-running services over the
store, and the dashboards written for Grafana."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from kvtrace.cli.arguments import RECIPE_METAVAR, add_recipe_option, gib_bytes, mib_bytes, non_negative, positive

if TYPE_CHECKING:
    from kvtrace.collector.service import CollectorConfig


def register(sub: argparse._SubParsersAction) -> None:
    col = sub.add_parser("collector", help="run the ingest service (HTTP: kvtrace batches and OTLP logs)")
    add_collector_options(col)
    col.set_defaults(handler=cmd_collector, extra="collector")

    dash = sub.add_parser("dashboard", help="serve the web dashboard over the store")
    dash.add_argument("--host", default="127.0.0.1")
    dash.add_argument("--port", type=positive, default=8050)
    dash.set_defaults(handler=cmd_dashboard, extra="dashboards")

    graf = sub.add_parser("grafana", help="write the Grafana dashboards (ClickHouse data source) as JSON")
    graf.add_argument("-o", "--output", default="grafana", help="directory (default ./grafana)")
    graf.add_argument("--database", default="", help="database the panels query (default: the store's)")
    graf.set_defaults(handler=cmd_grafana, extra="dashboards")

    al = sub.add_parser("alerts", help="evaluate alert rules on the store, deliver to Alertmanager or a webhook")
    al.add_argument("--rules", help="YAML rule file (default: the built-in rules; see --show-default-rules)")
    al.add_argument("--show-default-rules", action="store_true", help="print the built-in rules and exit")
    al.add_argument("--recipe", action="append", default=[], metavar=RECIPE_METAVAR,
                    help="compute verdicts from events with these recipes (default: the collector's live verdicts)")
    al.add_argument("--alertmanager", action="append", default=[], metavar="URL",
                    help="Alertmanager to push alerts to (its base URL, e.g. http://alertmanager:9093; "
                         "repeatable): firing alerts are re-sent every --resend-s, resolved ones sent with endsAt")
    al.add_argument("--webhook", action="append", default=[], metavar="URL",
                    help="Alertmanager-compatible webhook receiver for firing/resolved transitions (repeatable)")
    al.add_argument("--dashboard-url", default="http://127.0.0.1:8050",
                    help="the `kvtrace dashboard` each alert's generatorURL links to (default http://127.0.0.1:8050)")
    al.add_argument("--interval-s", type=positive, default=30, help="seconds between evaluations (default 30)")
    al.add_argument("--resend-s", type=positive, default=60,
                    help="re-send firing alerts to Alertmanagers this often (default 60; each stays valid 4x "
                         "the longer of this and --interval-s)")
    al.add_argument("--state", metavar="FILE",
                    help="keep pending/firing alerts and undelivered notifications here between runs, so a later "
                         "`--once` run (from cron) resolves what an earlier one fired")
    al.add_argument("--once", action="store_true",
                    help="evaluate once and exit (status 1 if a delivery failed after its retries)")
    al.add_argument("--metrics-port", type=positive, help="also serve the rule values as Prometheus metrics here")
    al.add_argument("--metrics-host", default="0.0.0.0", help="address for --metrics-port (default 0.0.0.0, all)")
    al.set_defaults(handler=cmd_alerts, extra="dashboards")


def add_collector_options(col: argparse.ArgumentParser) -> None:
    """The collector's options: `kvtrace collector` and `kvtrace serve` take the same ones."""
    col.add_argument("--host", default="127.0.0.1", help="address to listen on")
    col.add_argument("--port", type=positive, default=4318, help="port to listen on")
    col.add_argument("--spool-dir",
                     help="durable spool (default: $KVTRACE_COLLECTOR_SPOOL_DIR, else under $KVTRACE_HOME)")
    col.add_argument("--max-spool-gib", type=gib_bytes, default=1 << 30, dest="max_spool_bytes", metavar="GIB",
                     help="spool bound in GiB; 429 near it (default 1)")
    col.add_argument("--max-spool-mib", type=mib_bytes, dest="max_spool_bytes", help=argparse.SUPPRESS)  # before GiB
    col.add_argument("--tokens-file", help="bearer tokens: `token tenant[,tenant]` per line, `*` for all tenants "
                                           "(also $KVTRACE_COLLECTOR_TOKENS_FILE / $KVTRACE_COLLECTOR_TOKENS)")
    add_recipe_option(col, help="live verdicts judge each engine's lookups by the recipe it published when it "
                                "attached; this overrides it, as for analyze (repeatable)")
    col.add_argument("--no-live", action="store_true",
                     help="store only: no live verdicts (then `kvtrace analyze --write-verdicts` fills them)")
    col.add_argument("--live-in-process", action="store_true",
                     help="judge live verdicts in the collector's own process, not in a process of their own (the "
                          "default, which keeps judging off the request threads' interpreter)")
    col.add_argument("--fleet", action="store_true",
                     help="live verdicts with the fleet view: every instance judged in one order against the others "
                          "(seen and recoverable anywhere, routing regret); needs the whole fleet on this collector")
    col.add_argument("--lateness-ms", type=non_negative, default=2000,
                     help="live reconstruction waits this long for out-of-order events (default 2000)")
    col.add_argument("--live-max-held", type=positive, default=200_000,
                     help="events one instance's reorder buffer holds at most; beyond it the oldest are used "
                          "early and counted (default 200000)")
    col.add_argument("--zmq", metavar="ENDPOINT", help="also subscribe to an engine's ZMQ KV-event stream "
                                                      "(vLLM / SGLang), e.g. tcp://engine:5557")
    col.add_argument("--zmq-replay", metavar="ENDPOINT", help="the publisher's replay socket, to fill sequence gaps")
    col.add_argument("--zmq-instance", default="", help="instance name for the stream's events (default: the endpoint)")
    col.add_argument("--zmq-model", default="", help="model the stream's engine serves")
    col.add_argument("--zmq-tenant", default="", help="tenant namespace for the stream's events")
    col.add_argument("--zmq-engine", default="", help="the publishing engine, e.g. vllm or sglang")
    col.add_argument("--max-event-age-days", type=non_negative, default=30,
                     help="quarantine rows stamped more than this before they arrive (default 30; 0: no bound)")
    col.add_argument("--max-clock-ahead-s", type=non_negative, default=600,
                     help="quarantine rows stamped more than this after they arrive (default 600)")
    col.add_argument("--public-metrics", action="store_true",
                     help="serve /metrics (which names tenants) without an operator token")
    col.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                     help="the service's JSON log lines on stderr from this level up")


def collector_config(args: argparse.Namespace) -> CollectorConfig:
    """The collector's settings from its options (and $KVTRACE_COLLECTOR_*); a ValueError names
    a bad one. `kvtrace serve` builds its collector from the same."""
    from kvtrace.analysis.evaluate import Policy
    from kvtrace.collector.auth import TokenTable
    from kvtrace.collector.intake import TimeWindow
    from kvtrace.collector.service import config_from_env
    from kvtrace.collector.subscribe import KvEventSource
    from kvtrace.schema.recipes import RecipeBook

    return config_from_env(
        dsn=args.dsn, spool_dir=args.spool_dir, max_spool_bytes=args.max_spool_bytes,
        tokens=TokenTable.from_env(path=args.tokens_file),
        recipes=None if args.no_live else RecipeBook.parse(args.recipe), policy=Policy(fleet=args.fleet),
        lateness_ns=args.lateness_ms * 10**6, live_max_held=args.live_max_held, public_metrics=args.public_metrics,
        live_process=not args.live_in_process,
        time_window=TimeWindow(max_age_s=args.max_event_age_days * 86400 or float("inf"),
                               max_ahead_s=args.max_clock_ahead_s),
        kv_event_sources=(KvEventSource(args.zmq, args.zmq_replay, args.zmq_instance, args.zmq_model,
                                        args.zmq_tenant, engine=args.zmq_engine),) if args.zmq else None)


def cmd_collector(args: argparse.Namespace) -> int:
    from kvtrace.cli.running import holding
    from kvtrace.collector.serve import serve
    from kvtrace.store.client import Store

    try:
        config = collector_config(args)
    except ValueError as exc:  # a token file, recipe or option the collector cannot use
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with Store(config.dsn) as store, holding(store, "kvtrace collector", f"http://{args.host}:{args.port}"):
        return serve(config, host=args.host, port=args.port, log_level=args.log_level)


def cmd_dashboard(args: argparse.Namespace) -> int:
    import uvicorn

    from kvtrace.cli.running import holding
    from kvtrace.dashboards.web import create_dashboard_app
    from kvtrace.store.client import Store

    store = Store(args.dsn)
    store.require_schema()
    url = f"http://{args.host}:{args.port}"
    print(f"dashboard on {url}/ over {store.dsn}", flush=True)
    with holding(store, "kvtrace dashboard", url):
        uvicorn.run(create_dashboard_app(store), host=args.host, port=args.port, log_level="warning")
    return 0


def cmd_grafana(args: argparse.Namespace) -> int:
    from kvtrace.dashboards.grafana import write_dashboards
    from kvtrace.store.dsn import default_dsn, parse_dsn

    db = args.database or parse_dsn(args.dsn or default_dsn()).database
    for path in write_dashboards(args.output, db):
        print(f"wrote {path} (import it in Grafana with the ClickHouse data source)")
    return 0


def cmd_alerts(args: argparse.Namespace) -> int:
    import logging

    from kvtrace.dashboards.alerts import DEFAULT_RULES, RuleError, alert_loop, rules_from_path
    from kvtrace.schema.recipes import RecipeBook, RecipeError
    from kvtrace.store.client import Store

    if args.show_default_rules:
        print(DEFAULT_RULES, end="")
        return 0
    bad = next((u for u in [*args.alertmanager, *args.webhook, args.dashboard_url]
                if not u.startswith(("http://", "https://"))), None)
    if bad is not None:
        print(f"error: {bad!r}: expected an http:// or https:// URL", file=sys.stderr)
        return 2
    try:
        rules = rules_from_path(args.rules)
        recipes = RecipeBook.parse(args.recipe) if args.recipe else None
    except (RuleError, RecipeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    handler = logging.StreamHandler(sys.stderr)  # failed deliveries: one line each, receiver and cause
    handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    logging.getLogger("kvtrace.alerts").addHandler(handler)
    store = Store(args.dsn)
    store.require_schema()
    try:
        loop = alert_loop(store, rules=rules, recipes=recipes, alertmanagers=args.alertmanager, webhooks=args.webhook,
                          dashboard_url=args.dashboard_url, interval_s=args.interval_s, resend_s=args.resend_s,
                          state_path=args.state)
    except ValueError as exc:  # an unreadable --state file
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.metrics_host, registry=loop.registry)
    if args.once:
        loop.cycle()
        firing, failures = loop.state.firing(), loop.last_failures
        failed = f"; {len(failures)} deliveries failed" if failures else ""
        print(f"{len(rules)} rules evaluated; {len(firing)} firing{failed}")
        return 1 if failures else 0
    from kvtrace.cli.running import holding

    metrics = f"http://{args.metrics_host}:{args.metrics_port}/metrics" if args.metrics_port else ""
    with holding(store, "kvtrace alerts", metrics):  # named to a second command on an embedded store
        print(f"evaluating {len(rules)} rules every {args.interval_s} s (Ctrl-C to stop)")
        loop.run(args.interval_s)
    return 0
