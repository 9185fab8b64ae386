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
from dashboard_fill import replay, store_says

from kvtrace.dashboards.grafana import dashboard
from kvtrace.dashboards.queries import ALL, PANELS, PanelKind, by_key, substitute
from kvtrace.dashboards.web import PAGES, create_dashboard_app
from kvtrace.store.client import Store

ARTIFACTS = Path(os.environ.get("KVTRACE_TEST_ARTIFACTS", Path(__file__).resolve().parents[1] / "test-artifacts"))
S = 10**9


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


def grafana_targets(board: dict) -> dict[str, str]:
    """Each queries panel's SQL as the Grafana dashboard holds it (its target's refId is the key);
    the headline is one stat panel per tile, all with the same SQL."""
    out: dict[str, str] = {}
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            assert out.setdefault(target["refId"], target["rawSql"]) == target["rawSql"], target["refId"]
    return out


def test_grafana_panels_run_and_match_the_web_dashboard(store: Store) -> None:
    replay(store)
    lo, hi = bounds(store)
    board = dashboard(store.db)
    targets = grafana_targets(board)
    assert set(targets) == {p.key for p in PANELS}
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "model", "instance", "tenant", "engine"}
    app = create_dashboard_app(store)
    from starlette.testclient import TestClient

    client = TestClient(app)
    for variables in ({}, {"instance": "engine-b"}, {"tenant": "t1", "model": "jamba"}, {"engine": "sim"},
                      {"model": ALL, "instance": ALL, "tenant": ALL, "engine": ALL}):
        for panel in PANELS:
            raw = targets[panel.key]
            assert "$__fromTime" in raw and "${instance}" in raw and "{db}" not in raw
            expected = grafana_rows(store, raw, lo, hi, 30, variables)
            got = client.get(f"/api/panels/{panel.key}",
                             params={"from": lo, "to": hi, "interval_s": 30, **variables}).json()
            assert msgspec.json.decode(msgspec.json.encode(expected)) == got, (panel.key, variables)
            if not variables and panel.key not in ("endings", "inflight"):  # the replay fills every other panel
                assert got, panel.key  # (emitters end in wall-clock time, outside the replay's range)
    # "All" in Grafana filters nothing, as an empty value does on the web page
    every = {"from": lo, "to": hi, "interval_s": 30}
    assert (client.get("/api/panels/funnel", params={**every, "instance": ALL}).json()
            == client.get("/api/panels/funnel", params=every).json())
    # the headline is what the verdict rows add up to
    (headline,) = client.get("/api/panels/headline", params=every).json()
    says = store_says(store)
    for column in ("lookups", "tokens_lost", "unsafe_reuses"):
        assert headline[column] == says[column], column
    for column in ("logical_rate", "recoverable_rate", "adopted_rate"):
        assert headline[column] == pytest.approx(says[column]), column
    verdicts = {r["verdict"]: r["lookups"] for r in client.get("/api/panels/verdicts", params=every).json()}
    assert verdicts == {"HIT": 0, "PARTIAL": 0, "MISS": 0} | says["verdicts"]
    # the load-vs-recompute panel: loads from host, recomputes, by context position; the simulator
    # restores a token for less than recomputing it
    costs = client.get("/api/panels/loadcost", params=every).json()
    assert {r["path"] for r in costs} == {"restore from host", "recompute"}
    by_path = {(r["position"], r["path"]): r["us_per_token"] for r in costs}
    assert all(by_path[(pos, "restore from host")] < us for (pos, path), us in by_path.items()
               if path == "recompute" and (pos, "restore from host") in by_path)
    # the replay has what each panel shows
    rows = {p.key: client.get(f"/api/panels/{p.key}", params=every).json() for p in PANELS}
    assert len(rows["funnel"]) > 10 and any(r["divergence"] > 0 for r in rows["funnel"])
    assert {r["instance"] for r in rows["unsafe"]} == {"engine-b"}
    # the fleet page: the stages add up to the prompt tokens, and engine-b (whose unsafe reuse spoils
    # its checkpoints) was sent requests engine-a could have resumed further
    stages = {r["stage"]: r["tokens"] for r in rows["fleet"]}
    verdict_rows = store.query_polars(f"SELECT * FROM {store.db}.verdicts FINAL")
    first = verdict_rows.filter(pl.col("preemptions") == 0)  # what the rates count: first admissions
    assert sum(stages.values()) == first["prompt_tokens"].sum() < verdict_rows["prompt_tokens"].sum()
    assert stages["routing regret"] == first["routing_regret_tokens"].sum() > 0
    # the requests preempted and admitted again, apart: how many, reused and computed again
    assert sum(r["readmissions"] for r in rows["preemption"]) == says["readmissions"] > 0
    assert sum(r["recomputed_tokens"] for r in rows["preemption"]) == says["recomputed_on_resume"]
    assert headline["readmissions"] == says["readmissions"]
    assert [(r["pair"], r["regret_tokens"]) for r in rows["regret_pairs"]] == [
        ("engine-b -> engine-a", stages["routing regret"])]
    assert any(r["routing_regret"] > 0 for r in rows["regret"])
    # and, on the web page only, that regret in seconds by the cost models fitted in range
    from kvtrace.analysis.costs import fit_prefill, fit_transfers, routing_regret_seconds

    events = store.query_polars(f"SELECT * FROM {store.db}.events FINAL")
    priced = routing_regret_seconds(first, fit_transfers(events), fit_prefill(events))
    assert priced["regret_s"].null_count() == 0 and priced["regret_s"].sum() > 0
    page = client.get("/fleet", params={"from": lo, "to": hi}).text
    section = re.search(r"<section data-panel='regret_seconds'>(.*?)</section>", page, re.S).group(1)
    cells = re.findall(r"<td>(.*?)</td>", section)
    assert cells[:4] == ["engine-b", "engine-a", str(priced.height), str(stages["routing regret"])], cells
    assert float(cells[4]) == pytest.approx(priced["regret_s"].sum()) and cells[5] == "0"
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
    # the correct engine reused nothing unsafely: the page says so as good news, not as missing data
    page = client.get("/unsafe", params={"instance": "engine-a"}).text
    assert "class='none' data-points='0'><b>None.</b> No request adopted more than was recoverable" in page
    assert "data-stat='unsafe_reuses' data-value='0'><div class='v'>none</div>" in page
    # a filter that matches nothing says so, and how to widen it
    page = client.get("/", params={"instance": "nobody"}).text
    assert "No events match these filters in this time range" in page


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "headless Chromium is needed (Debian's `chromium`; scripts/test.sh installs it)"
    return path


def expected_points(store: Store, panel_key: str, lo: int, hi: int, interval: int) -> int:
    panel = by_key(panel_key)
    rows = pl.DataFrame(grafana_rows(store, panel.sql, lo, hi, interval, {}))
    return rows.height if panel.kind is PanelKind.TABLE else rows.height * len(panel.series)


def drawn_points(dom: str) -> dict[str, int]:
    """Points drawn per panel section (a faceted panel draws several charts)."""
    sections = re.findall(r'<section data-panel="(\w+)">(.*?)</section>', dom, re.S)
    return {key: sum(int(n) for n in re.findall(r'data-points="(\d+)"', body)) for key, body in sections}


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
            drawn = drawn_points(dom.stdout)
            want = {k: expected_points(store, k, lo, hi, interval) for k in keys}
            if path == "costs":
                assert drawn.pop("crossover") > 0, "the crossover chart drew nothing"
            if path == "fleet":
                assert drawn.pop("regret_seconds") == 1, "one instance pair had regret"
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
        assert page.status_code == 200 and "The store holds no events yet" in page.text, path
    assert client.get("/api/panels/nope").status_code == 404


def test_links_keep_filters_with_any_characters(store: Store) -> None:
    from starlette.testclient import TestClient

    page = TestClient(create_dashboard_app(store)).get("/", params={"model": "a&b c", "from": 1, "to": 2}).text
    assert "href='/gaps?from=1&amp;to=2&amp;model=a%26b+c'" in page
