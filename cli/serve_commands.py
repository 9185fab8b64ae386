"""`kvtrace serve`: one process that owns the embedded store and serves everything over it.

chDB lets one process open an embedded store, so the collector, the dashboard and the alert
rules cannot each run as their own `kvtrace` process on it. `serve` runs all three in one: the
collector's ingest app at `/`, the web dashboard under `/dashboard/`, the alert rules evaluated
on a background thread. SIGTERM (or Ctrl-C) stops them in order: alerts, then the web server,
then the collector, which drains its spool into the store as `kvtrace collector` does.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from typing import TYPE_CHECKING

from kvtrace.cli.arguments import positive
from kvtrace.cli.service_commands import add_collector_options, collector_config

if TYPE_CHECKING:
    from fastapi import FastAPI

    from kvtrace.collector.service import Collector
    from kvtrace.dashboards.alerts import AlertLoop, Rule
    from kvtrace.store.client import Store

DASHBOARD_PREFIX = "/dashboard"
log = logging.getLogger("kvtrace.serve")


def register(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="collector, web dashboard and alert rules in one process over one store")
    add_collector_options(serve)
    serve.add_argument("--rules", help="YAML alert rule file (default: the built-in rules; see "
                                       "`kvtrace alerts --show-default-rules`)")
    serve.add_argument("--alertmanager", action="append", default=[], metavar="URL",
                       help="an Alertmanager to push alerts to (its /api/v2/alerts; repeatable)")
    serve.add_argument("--webhook", action="append", default=[], metavar="URL",
                       help="an Alertmanager-compatible webhook for firing/resolved transitions (repeatable; "
                            "with neither, alerts are only logged)")
    serve.add_argument("--alert-interval-s", type=positive, default=30, help="seconds between rule evaluations")
    serve.add_argument("--no-alerts", action="store_true", help="evaluate no alert rules")
    serve.set_defaults(handler=cmd_serve, extra="all")


class AlertThread:
    """The alert loop on a thread of its own until `stop()`: the loop's `run` installs no signal
    handler and returns within a second of its stop event, retries included."""

    def __init__(self, loop: AlertLoop, interval_s: float) -> None:
        self.loop = loop
        self._stop = threading.Event()
        self._thread = threading.Thread(target=loop.run, args=(interval_s, self._stop), name="kvtrace-alerts",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def alert_rules(args: argparse.Namespace) -> list[Rule] | None:
    """The rules to evaluate (None with --no-alerts); a RuleError (a ValueError) names a bad file."""
    if args.no_alerts:
        return None
    from kvtrace.dashboards.alerts import rules_from_path

    return rules_from_path(args.rules)


def alert_thread(store: Store, rules: list[Rule] | None, args: argparse.Namespace) -> AlertThread | None:
    """The alert rules over the store the collector writes (its live verdicts), pushed to the
    Alertmanagers and webhooks named and logged either way; their links open this process's
    own dashboard."""
    if rules is None:
        return None
    from kvtrace.dashboards.alerts import alert_loop

    host = "127.0.0.1" if args.host in ("", "0.0.0.0", "::") else args.host
    loop = alert_loop(store, rules=rules, alertmanagers=args.alertmanager, webhooks=args.webhook,
                      dashboard_url=f"http://{host}:{args.port}{DASHBOARD_PREFIX}", interval_s=args.alert_interval_s,
                      out=logging.getLogger("kvtrace.alerts").warning)
    return AlertThread(loop, args.alert_interval_s)


def serve_app(collector: Collector, alerts: AlertThread | None) -> FastAPI:
    """The collector's app at `/` and the dashboard's under `/dashboard/`, with one lifespan
    that starts the collector then the alerts, and stops them in the reverse order."""
    import contextlib

    from fastapi import FastAPI
    from fastapi.concurrency import run_in_threadpool
    from fastapi.responses import RedirectResponse

    from kvtrace.collector.app import create_app
    from kvtrace.dashboards.web import create_dashboard_app

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):  # noqa: ANN202
        await run_in_threadpool(collector.start)
        if alerts is not None:
            alerts.start()
        try:
            yield
        finally:
            if alerts is not None:
                await run_in_threadpool(alerts.stop)
            await run_in_threadpool(collector.stop)

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.get(DASHBOARD_PREFIX, include_in_schema=False)
    async def dashboard_slash() -> RedirectResponse:
        return RedirectResponse(f"{DASHBOARD_PREFIX}/")

    app.mount(DASHBOARD_PREFIX, create_dashboard_app(collector.store))
    app.mount("/", create_app(collector, manage_lifecycle=False))
    return app


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from kvtrace.cli.running import holding
    from kvtrace.collector.serve import configure_logging, quiet_gc, short_gil_turns
    from kvtrace.collector.service import Collector
    from kvtrace.store.client import Store

    try:
        config = collector_config(args)
        rules = alert_rules(args)
    except ValueError as exc:  # a token file, recipe, rule file or option that cannot be used
        print(f"error: {exc}", file=sys.stderr)
        return 2
    url = f"http://{args.host}:{args.port}"
    # Ctrl-C still ends as KeyboardInterrupt: exit 130.
    with Store(config.dsn) as store, holding(store, "kvtrace serve", url):
        collector = Collector(config)
        alerts = alert_thread(collector.store, rules, args)
        configure_logging(args.log_level)
        log.info("serving on %s: ingest at /v1/batches, the dashboard at %s/, alerts %s; store %s", url,
                 url + DASHBOARD_PREFIX, "off" if alerts is None else f"every {args.alert_interval_s} s",
                 collector.store.dsn)
        quiet_gc()
        short_gil_turns()
        uvicorn.run(serve_app(collector, alerts), host=args.host, port=args.port, log_config=None,
                    access_log=False, log_level=args.log_level,
                    timeout_graceful_shutdown=int(config.drain_timeout_s))
    return 0
