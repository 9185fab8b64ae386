"""`kvtrace collector --fleet` in its own process: a fleet of reference engines sends to it over
HTTP, and its live verdicts carry the fleet view (every instance judged in one order against the
others), equal to the fleet's own truth per request and to the offline analysis of what it
stored; then it stops the way an operator stops it."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pyarrow.parquet as pq
from collector_proc import CollectorProcess
from test_fleet_sim import _requests

from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.fleet import FleetSimulator, RoutePolicy
from kvtrace.instrumentation.simulator import SimConfig
from kvtrace.instrumentation.sinks.http import HttpSink
from kvtrace.schema.kinds import Tier
from kvtrace.schema.recipes import BUILTIN

COLUMNS = ("instance", "seen_anywhere_tokens", "recoverable_anywhere_tokens", "best_instance",
           "recoverable_hit_tokens", "routing_regret_tokens", "adopted_tokens", "fleet_reason")


def test_a_fleet_collector_writes_the_fleet_view_live(tmp_path: Path) -> None:
    # A request every 100 ms of the engines' clock, so the default 2 s lateness window covers
    # how far one engine's sender may fall behind the others (they share this process's CPU).
    start = time.time_ns()
    requests = [replace(r, arrival_ns=start + i * 100_000_000)
                for i, r in enumerate(_requests(60, "mooncake_synthetic_trace.jsonl"))]
    proc = CollectorProcess(tmp_path, "--fleet")
    proc.start()
    try:
        emitters = [BatchEmitter(HttpSink(proc.url), BatchConfig(max_export_batch_size=512, schedule_delay_millis=20),
                                 register_atexit=False) for _ in range(3)]
        config = SimConfig(recipe=BUILTIN["dense"], instance="fleet", model="m", bytes_per_token=1024,
                           capacity_bytes=(48 << 20, 96 << 20, 0), fetch_tiers=(Tier.HOST,), start_ns=start)
        fleet = FleetSimulator(config, emitters, RoutePolicy.ROUND_ROBIN, seed=7)
        truths = {t.request_id: t for t in fleet.serve_all(requests)}
        for emitter in emitters:
            assert emitter.force_flush(60_000) and emitter.shutdown()
            assert not emitter.stats().dropped
        proc.wait_drained()
        deadline = time.monotonic() + 120  # the last events wait out the lateness, then a tick
        while len(live := httpx.get(proc.url + "/v1/verdicts", params={"limit": 1000}, timeout=30).json()) < 60:
            assert time.monotonic() < deadline, len(live)
            time.sleep(0.5)
        metrics = httpx.get(proc.url + "/metrics", timeout=30).text
        assert 'live_events_skipped_total{reason="late"}' not in metrics, metrics  # every event in time
        assert "live_events_released_early_total 0.0" in metrics
    finally:
        assert proc.stop()  # SIGTERM: drained, live state flushed
    assert len(live) == 60 and {r["instance"] for r in live} == {"fleet/0", "fleet/1", "fleet/2"}
    for row in live:
        t = truths[row["request_id"]]
        assert (row["seen_anywhere_tokens"], row["recoverable_anywhere_tokens"], row["best_instance"],
                row["recoverable_hit_tokens"], row["routing_regret_tokens"], row["adopted_tokens"]) == (
            t.seen_anywhere, t.recoverable_anywhere, t.best_instance, t.recoverable_here, t.regret, t.adopted), row
    assert sum(r["routing_regret_tokens"] for r in live) > 0
    # The offline fleet view of what the collector stored says the same, row by row.
    out = tmp_path / "offline.parquet"
    done = subprocess.run([sys.executable, "-m", "kvtrace.cli.main", "--dsn", proc.dsn, "analyze", "--fleet", "--path",
                           "stream", "-o", str(out)], env=proc.env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    offline = {r["request_id"]: r for r in pq.read_table(out).to_pylist()}
    assert len(offline) == 60
    for row in live:
        assert all(row[c] == offline[row["request_id"]][c] for c in COLUMNS), row
