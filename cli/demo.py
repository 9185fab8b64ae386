"""`kvtrace demo`: a real trace through a hybrid multi-tier cache, end to end, in minutes.

Three retention policies are first compared on the bundled slice of a Mooncake production
trace; the trace is then replayed with the policy that kept the most reusable tokens, through
the reference simulator (a Mamba-hybrid recipe over device, host and disk tiers, with timed
loads and prefills) and the real emitter into the store; every lookup is reconstructed inside
the store and its verdict stored, so the dashboards, alerts and `kvtrace costs` all have data;
and a self-contained HTML report is written. Each run resets its own database, so running it
twice neither fails nor double-counts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import quote

import polars as pl

from kvtrace.analysis.funnel import funnel, reasons
from kvtrace.analysis.sql import clickhouse_results
from kvtrace.cli.experiment import compare, display
from kvtrace.cli.progress import bar
from kvtrace.dashboards.report import write_report
from kvtrace.instrumentation.recording import record_replay
from kvtrace.instrumentation.replay import ReplayOptions
from kvtrace.instrumentation.simulator import PolicySpec, SimConfig, gpu_timed
from kvtrace.instrumentation.traces import TraceRequest, read_trace
from kvtrace.schema.paths import data_dir
from kvtrace.schema.recipes import BUILTIN, RecipeBook
from kvtrace.schema.verdicts import Verdict
from kvtrace.store.client import Store
from kvtrace.store.dsn import default_dsn, parse_dsn

DEMO_DATABASE = "kvtrace_demo"
RECIPE = "mamba-hybrid"
POLICIES = ("lru", "interval:512", "branch")
DASHBOARD_PORT = 8050  # `kvtrace dashboard`'s default


@dataclass(frozen=True, slots=True)
class DemoSummary:
    requests: int
    events: int
    logical: float
    recoverable: float
    resident: float
    adopted: float
    unsafe: int
    policy: str
    verdicts: int
    report: Path


def bundled_trace(limit: int) -> list[TraceRequest]:
    source = resources.files("kvtrace.cli") / "data" / "mooncake_conversation_head.jsonl.gz"
    with resources.as_file(source) as path:
        return list(read_trace(path, "mooncake", limit=limit))


def demo_config() -> SimConfig:
    """Small tiers so that a few hundred requests already offload, reload and evict; loads and
    prefills timed like a mid-size model on one GPU (`gpu_timed`)."""
    return gpu_timed(SimConfig(recipe=BUILTIN[RECIPE], model="demo-jamba", instance="demo-0", bytes_per_token=4096,
                               capacity_bytes=(1 << 30, 3 << 30, 12 << 30), lease_ns=3600 * 10**9))


def best_policy(policies: pl.DataFrame) -> str:
    """The policy whose replay reused the most tokens that were really recoverable (ties: the
    fewest bytes written to the device); a policy with unsafe reuse is never chosen."""
    safe = policies.filter(pl.col("unsafe_reuse") == 0)
    ranked = (safe if safe.height else policies).sort(
        ["adopted_recoverable_tokens", "device_write_bytes"], descending=[True, False], maintain_order=True)
    return str(ranked["policy"][0])


def _demo_dsn(dsn: str | None) -> str:
    base = parse_dsn(dsn or default_dsn())
    if base.embedded:
        return f"chdb://{base.path}?database={DEMO_DATABASE}"
    auth = f"{quote(base.username, safe='')}:{quote(base.password, safe='')}"
    return f"{base.scheme}://{auth}@{base.host}:{base.port}/{DEMO_DATABASE}"


def _bar(total: int, desc: str) -> Any:
    return bar(total=total, desc=desc, unit="req", leave=False, dynamic_ncols=True,
               disable=None)  # None: only on a terminal


def run_demo(dsn: str | None = None, requests: int = 200, report: str | None = None) -> int:
    started = time.monotonic()
    trace = bundled_trace(requests)
    report_path = Path(report) if report else data_dir() / "demo-report.html"

    print(f"[1/5] comparing retention policies on {len(trace)} requests of a Mooncake production trace: "
          f"{', '.join(POLICIES)}")
    with _bar(len(trace) * len(POLICIES), "policies") as bar:
        policies = compare(trace, demo_config(), [PolicySpec.parse(p) for p in POLICIES],
                           progress=lambda _n, _i: bar.update())
    chosen = best_policy(policies)
    config = PolicySpec.parse(chosen).apply(demo_config())
    with Store(_demo_dsn(dsn)) as store:
        print(f"[2/5] store {store.dsn}: resetting the demo database")
        store.command(f"DROP DATABASE IF EXISTS {DEMO_DATABASE}")
        store.init()

        print(f"[3/5] replaying the trace through a {RECIPE} cache (device 1 GiB, host 3 GiB, disk 12 GiB; "
              f"Mamba checkpoints: {chosen}, the policy that kept the most reusable tokens) into the store")
        with _bar(len(trace), "replay") as bar:
            recorded = record_replay(store, trace, config, ReplayOptions(tenant="default"),
                                     progress=lambda _: bar.update())
        replayed, stats = recorded.report, recorded.stats

        print("[4/5] reconstructing every lookup inside ClickHouse and storing its verdict")
        results = clickhouse_results(store, RecipeBook({config.model: config.recipe}))
        verdicts = store.insert_verdicts(results)
        stored = store.count_events()
        shown = str(store.dsn)  # never the password

    rates = funnel(results).row(0, named=True)
    top = reasons(results).head(3)
    summary = DemoSummary(
        requests=replayed.requests, events=stored, logical=rates["logical_token_rate"],
        recoverable=rates["recoverable_token_rate"], resident=rates["resident_token_rate"],
        adopted=rates["adopted_token_rate"], unsafe=int(rates["unsafe_reuse"]), policy=chosen, verdicts=verdicts,
        report=report_path,
    )
    counts = dict(results.group_by("verdict").len().iter_rows())
    lines = [
        ("requests", f"{summary.requests}"),
        ("events stored", f"{summary.events} (emitted {stats.emitted}, dropped {stats.dropped})"),
        ("logical hit rate", f"{summary.logical:.1%} of prompt tokens (what the hash lookup matched)"),
        ("recoverable rate", f"{summary.recoverable:.1%} (every component complete and valid)"),
        ("resident rate", f"{summary.resident:.1%} (recoverable without loading from host or disk)"),
        ("adopted hit rate", f"{summary.adopted:.1%} (what the engine reused)"),
        ("unsafe reuse", f"{summary.unsafe} lookups (adopted more than was recoverable)"),
        ("verdicts", ", ".join(f"{counts.get(v.value, 0)} {v.value}" for v in Verdict)
         + " (HIT: the whole hash hit usable as is; PARTIAL: needs a restore or a recompute; MISS: no hash hit)"),
    ]
    for row in top.iter_rows(named=True):
        lines.append((f"gap: {row['reason']}", f"{row['tokens_lost']} tokens in {row['lookups']} lookups"))
    print("[5/5] writing the report")
    write_report(report_path, f"kvtrace demo: {RECIPE} on a Mooncake trace slice", lines, results,
                 replayed.occupancy, policies)

    print()
    for key, value in lines:
        print(f"{key:<20} {value}")
    print()
    with pl.Config(tbl_hide_dataframe_shape=True, tbl_hide_column_data_types=True, tbl_width_chars=200,
                   tbl_cols=12):
        print(display(policies))
    for row in policies.iter_rows(named=True):
        print(f"{row['policy']:<13} {row['note']}")
    print()
    print(f"policy     {chosen}: the replay above used the policy that kept the most reusable tokens")
    print(f"report     {report_path}")
    print(f"data       {shown}: {summary.verdicts} verdicts stored   [{time.monotonic() - started:.0f} s]")
    print(f"more       kvtrace --dsn '{shown}' analyze --by instance   # by the recipe the engine attached with")
    print(f"           kvtrace --dsn '{shown}' costs   # load vs recompute, fitted from the timed loads and prefills")
    print(f"           kvtrace --dsn '{shown}' export -o demo.parquet && kvtrace analyze --path duckdb demo.parquet")
    print(f"dashboard  kvtrace --dsn '{shown}' dashboard   # then open http://127.0.0.1:{DASHBOARD_PORT}/")
    return 0
