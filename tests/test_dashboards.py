"""The dashboards over a store filled by replays: the web pages and the Grafana panels run the same
queries and give the same numbers, and headless Chromium draws every page without console
errors, with the expected number of points, saving a screenshot of each."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import msgspec
import polars as pl
import pytest
import uvicorn

from kvtrace.analysis.sql import clickhouse_results
from kvtrace.dashboards.grafana import dashboard
from kvtrace.dashboards.queries import PANELS, PanelKind, substitute
from kvtrace.dashboards.web import PAGES, create_dashboard_app
from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.simulator import AdoptPolicy, CacheSimulator, Fault, SimConfig, SimRequest
from kvtrace.instrumentation.sinks.store import StoreSink
from kvtrace.schema.arrow import conform, to_arrow
from kvtrace.schema.recipes import BUILTIN
from kvtrace.schema.verdicts import Agreement, LookupResult, Verdict, Verification
from kvtrace.store.client import Store

ARTIFACTS = Path(os.environ.get("KVTRACE_TEST_ARTIFACTS", Path(__file__).resolve().parents[1] / "test-artifacts"))
S = 10**9


def replay(store: Store) -> None:
    """Two engines over ten minutes: a correct one, and one that adopts whatever the hash
    matched (unsafe reuse) while checkpoints go missing; both offload and reload."""
    recipe = BUILTIN["mamba-hybrid"]
    for instance, adopt in (("engine-a", AdoptPolicy.COMPLETE), ("engine-b", AdoptPolicy.LOGICAL)):
        emitter = BatchEmitter(StoreSink(store), BatchConfig(max_queue_size=1 << 20), register_atexit=False,
                               instance=instance)
        sim = CacheSimulator(SimConfig(recipe=recipe, model="jamba", instance=instance, adopt=adopt,
                                       capacity_bytes=(12 << 20, 1 << 30, 0), load_latency_ns=(40_000, 0),
                                       prefill_ns_per_token=30_000, prefill_ns_per_token_pair=3), emitter)
        docs = [list(range(d * 10_000, d * 10_000 + 512 * (1 + d % 3))) for d in range(8)]
        for i in range(80):
            doc = docs[i % len(docs)]
            request = SimRequest(f"{instance}-{i}", [*doc, i, i, i], tenant=f"t{i % 2}",
                                 arrival_ns=sim.config.start_ns + i * 7 * S)
            if i % 9 == 4:
                sim.inject(Fault.SKIP_CHECKPOINT, request, len(doc) // 256 * 256)
            sim.serve(request)
        assert emitter.shutdown()
    verdicts = clickhouse_results(store, recipe)
    store.insert_arrow("verdicts", conform(verdicts.to_arrow(), LookupResult))
    # What `kvtrace verify` would store for a few of them (its engine side runs in the vLLM suite).
    checks = [Verification(ts_ns=r["ts_ns"], run_id="t", instance=r["instance"], request_id=r["request_id"],
                           model=r["model"], tenant=r["tenant"], verdict=Verdict(r["verdict"]),
                           unsafe_reuse=r["unsafe_reuse"], adopted_tokens=r["adopted_tokens"],
                           max_abs_diff=2.5 if r["unsafe_reuse"] else 0.0,
                           agreement=Agreement.ALARM_CONFIRMED if r["unsafe_reuse"] else Agreement.IDENTICAL)
              for inst in ("engine-a", "engine-b")
              for r in verdicts.filter((pl.col("instance") == inst)
                                       & (pl.col("adopted_tokens") > 0)).head(2).to_dicts()]
    store.insert_arrow("verifications", to_arrow(checks, Verification))


class Served:
    def __init__(self, store: Store) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(create_dashboard_app(store), host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Served:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def bounds(store: Store) -> tuple[int, int]:
    lo, hi = store.query_arrow(
        f"SELECT min(ts_ns) AS lo, max(ts_ns) AS hi FROM {store.db}.events").to_pylist()[0].values()
    return lo // S, hi // S + 1


def grafana_rows(store: Store, raw_sql: str, lo: int, hi: int, interval: int, variables: dict[str, str]) -> list:
    """A Grafana panel's SQL with the macros expanded as the ClickHouse plugin expands them."""
    sql = substitute(raw_sql, store.db, lo, hi, interval, variables)
    return store.query_polars(sql).to_dicts()


def test_grafana_panels_run_and_match_the_web_dashboard(store: Store) -> None:
    replay(store)
    lo, hi = bounds(store)
    board = dashboard(store.db)
    assert [p["title"] for p in board["panels"]] == [p.title for p in PANELS]
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "model", "instance", "tenant", "engine"}
    app = create_dashboard_app(store)
    from starlette.testclient import TestClient

    client = TestClient(app)
    for variables in ({}, {"instance": "engine-b"}, {"tenant": "t1", "model": "jamba"}, {"engine": "sim"}):
        for grafana_panel, panel in zip(board["panels"], PANELS, strict=True):
            raw = grafana_panel["targets"][0]["rawSql"]
            assert "$__fromTime" in raw and "${instance}" in raw
            expected = grafana_rows(store, raw, lo, hi, 30, variables)
            got = client.get(f"/api/panels/{panel.key}",
                             params={"from": lo, "to": hi, "interval_s": 30, **variables}).json()
            assert msgspec.json.decode(msgspec.json.encode(expected)) == got, (panel.key, variables)
    # the replay has what each panel shows
    rows = {p.key: client.get(f"/api/panels/{p.key}", params={"from": lo, "to": hi, "interval_s": 30}).json()
            for p in PANELS}
    assert len(rows["funnel"]) > 10 and any(r["divergence"] > 0 for r in rows["funnel"])
    assert {r["instance"] for r in rows["unsafe"]} == {"engine-b"}
    assert any(r["reason"] == "no_checkpoint_at_boundary" for r in rows["reasons"])
    assert {r["tier"] for r in rows["tiers"]} >= {"device", "host"}
    one = client.get("/api/panels/tiers",
                     params={"from": lo, "to": hi, "interval_s": 30, "instance": "engine-a"}).json()
    device = [r["resident_gib"] for r in one if r["tier"] == "device"]
    assert max(device) == pytest.approx(12 / 1024)  # one engine's device tier fills to its 12 MiB and stays there
    both = [r["resident_gib"] for r in rows["tiers"] if r["tier"] == "device"]
    assert max(both) == pytest.approx(2 * 12 / 1024)
    assert rows["transfers"] and rows["residency"]
    # both replays' emitters shut down, clean, nothing missing; an emitter ends in wall-clock time,
    # not in the replay's, which is the panel's default range
    ended = client.get("/api/panels/endings").json()
    assert {(r["instance"], r["ended"], r["missing"]) for r in ended} == {
        ("engine-a", "clean", 0), ("engine-b", "clean", 0)}
    assert {(r["instance"], r["agreement"]) for r in rows["verify"]} >= {("engine-a", "recoverable_identical")}
    assert {r["tier"] for r in rows["restore"]} == {"host"} and rows["restore"][0]["tokens"] > 0
    usage = [r for r in rows["usage"] if r["tier"] == "device"]
    # two engines, each with a 12 MiB device tier: what is held plus what is free is the capacity
    assert usage and all(r["evictable_gib"] + r["free_gib"] + r["locked_gib"] == pytest.approx(24 / 1024)
                         for r in usage[1:])
    # a filter that matches nothing says so
    page = client.get("/unsafe", params={"instance": "engine-a"}).text
    assert "No data for these filters" in page


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "headless Chromium is needed (Debian's `chromium`; scripts/test.sh installs it)"
    return path


def expected_points(store: Store, panel_key: str, lo: int, hi: int, interval: int) -> int:
    panel = next(p for p in PANELS if p.key == panel_key)
    rows = pl.DataFrame(grafana_rows(store, panel.sql, lo, hi, interval, {}))
    return rows.height if panel.kind is PanelKind.TABLE else rows.height * len(panel.series)


def test_every_page_draws_in_headless_chromium(store: Store) -> None:
    replay(store)
    lo, hi = bounds(store)
    interval = max(1, (hi - lo) // 120)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with Served(store) as served:
        for path, (_title, keys) in PAGES.items():
            url = f"{served.url}/{path}?from={lo}&to={hi}"
            args = [chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    "--enable-logging=stderr", "--v=0", "--virtual-time-budget=15000"]
            dom = subprocess.run([*args, "--dump-dom", url], capture_output=True, text=True, timeout=120)
            assert dom.returncode == 0, dom.stderr[-2000:]
            console = [line for line in dom.stderr.splitlines() if "CONSOLE" in line]
            assert not [line for line in console if "rror" in line or "Uncaught" in line], console
            assert 'data-ready="1"' in dom.stdout, path
            drawn = [int(n) for n in re.findall(r'data-points="(\d+)"', dom.stdout)]
            want = [expected_points(store, k, lo, hi, interval) for k in keys]
            if path == "costs":
                assert drawn and drawn[0] > 0, "the crossover chart drew nothing"
            else:
                assert drawn == want, (path, drawn, want)
            shot = ARTIFACTS / f"dashboard-{path or 'funnel'}.png"
            subprocess.run([*args, "--window-size=1300,1800", f"--screenshot={shot}", url], capture_output=True,
                           timeout=120, check=True)
            assert shot.stat().st_size > 10_000, shot


def test_an_empty_store_says_there_is_no_data(store: Store) -> None:
    from starlette.testclient import TestClient

    client = TestClient(create_dashboard_app(store))
    for path in PAGES:
        page = client.get(f"/{path}")
        assert page.status_code == 200 and ("No data" in page.text or "No fitted" in page.text), path
    assert client.get("/api/panels/nope").status_code == 404


def test_links_keep_filters_with_any_characters(store: Store) -> None:
    from starlette.testclient import TestClient

    page = TestClient(create_dashboard_app(store)).get("/", params={"model": "a&b c", "from": 1, "to": 2}).text
    assert "href='/gaps?from=1&amp;to=2&amp;model=a%26b+c'" in page
