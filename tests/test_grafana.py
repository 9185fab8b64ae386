"""The Grafana dashboard as built by grafana-foundation-sdk: a grid where no panel covers another,
a unit on every chart and tile, variables that query the store for their values, stat tiles
matching the web page's, and the file `kvtrace grafana` writes."""

from __future__ import annotations

import json
import subprocess
import sys
from itertools import combinations
from pathlib import Path

from dashboard_fill import replay
from grafana_foundation_sdk.models.dashboard import Dashboard

from kvtrace.dashboards.grafana import UNITS, build, dashboard
from kvtrace.dashboards.queries import ALL, PAGES, PANELS, PanelKind, by_key, substitute
from kvtrace.store.client import Store


def rectangles(board: dict) -> list[tuple[str, int, int, int, int]]:
    return [(p["title"], p["gridPos"]["x"], p["gridPos"]["y"], p["gridPos"]["w"], p["gridPos"]["h"])
            for p in board["panels"]]


def test_no_two_panels_overlap_and_all_fit_the_grid() -> None:
    board = dashboard("kvtrace")
    boxes = rectangles(board)
    for title, x, y, w, h in boxes:
        assert 0 <= x and x + w <= 24 and w > 0 and h > 0 and y >= 0, title
    for (a, ax, ay, aw, ah), (b, bx, by, bw, bh) in combinations(boxes, 2):
        overlap = ax < bx + bw and bx < ax + aw and ay < by + bh and by < ay + ah
        assert not overlap, f"{a!r} overlaps {b!r}"
    # a row per web page, in the web page's order, each followed by that page's panels
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows == [title for title, _ in PAGES.values()]


def test_every_chart_and_tile_carries_its_unit() -> None:
    board = dashboard("kvtrace")
    charts = [p for p in board["panels"] if p["type"] in ("timeseries", "barchart", "stat")]
    assert len(charts) >= 5 + sum(1 for p in PANELS if p.kind in (PanelKind.TIMESERIES, PanelKind.BARS))
    for p in charts:
        assert p["fieldConfig"]["defaults"].get("unit") in UNITS.values(), p["title"]
    by_ref = {p["targets"][0]["refId"]: p for p in charts if p["type"] != "stat"}
    assert by_ref["funnel"]["fieldConfig"]["defaults"]["unit"] == "percentunit"
    assert by_ref["funnel"]["fieldConfig"]["defaults"]["custom"]["axisLabel"] == "share of prompt tokens (%)"
    assert by_ref["tiers"]["fieldConfig"]["defaults"]["unit"] == "gbytes"
    assert by_ref["residency"]["fieldConfig"]["defaults"]["unit"] == "s"
    assert by_ref["transfers"]["fieldConfig"]["defaults"]["unit"] == "ms"
    assert by_ref["loadcost"]["fieldConfig"]["defaults"]["unit"] == "µs"
    assert by_ref["reasons"]["fieldConfig"]["defaults"]["unit"] == "suffix: tokens"
    # the bytes on the restore panel's second axis are GiB
    (gib,) = [o for o in by_ref["restore"]["fieldConfig"]["overrides"] if o["matcher"]["options"] == "gib"]
    assert {"id": "unit", "value": "gbytes"} in gib["properties"]
    # the funnel's five lines differ in style, so equal ones stay visible; their legend names are human
    styles = [next(v["value"] for v in o["properties"] if v["id"] == "custom.lineStyle")
              for o in by_ref["funnel"]["fieldConfig"]["overrides"]]
    assert len({json.dumps(s, sort_keys=True) for s in styles}) == 5
    names = {o["matcher"]["options"]: next(v["value"] for v in o["properties"] if v["id"] == "displayName")
             for o in by_ref["funnel"]["fieldConfig"]["overrides"]}
    assert names["logical"] == "logical (hash hit)" and names["adopted"] == "adopted (engine reused)"


def test_stat_tiles_match_the_web_tiles() -> None:
    board = dashboard("kvtrace")
    headline = by_key("headline")
    stats = [p for p in board["panels"] if p["type"] == "stat"]
    assert [p["title"] for p in stats] == [headline.label(c) for c in headline.series]
    assert [p["options"]["reduceOptions"]["fields"] for p in stats] == [f"/^{c}$/" for c in headline.series]
    assert {p["targets"][0]["rawSql"] for p in stats} == {headline.sql.replace("{db}", "kvtrace")}
    units = [p["fieldConfig"]["defaults"]["unit"] for p in stats]
    assert units == ["percentunit"] * 3 + ["suffix: tokens", "short", "short"]
    # zero unsafe reuses reads "none", in green
    mappings = stats[headline.series.index("unsafe_reuses")]["fieldConfig"]["defaults"]["mappings"]
    assert mappings == [{"type": "value", "options": {"0": {"text": "none", "color": "green"}}}]


def test_variables_query_the_store_for_their_values(store: Store) -> None:
    replay(store)
    board = dashboard(store.db)
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "grafana-clickhouse-datasource"
    values = {}
    for name in ("model", "instance", "tenant", "engine"):
        v = variables[name]
        assert v["type"] == "query" and v["includeAll"] and v["allValue"] == ALL, name
        assert v["datasource"]["type"] == "grafana-clickhouse-datasource"
        values[name] = [r[name] for r in store.query_polars(v["query"]).to_dicts()]
    assert values == {"model": ["jamba"], "instance": ["engine-a", "engine-b"], "tenant": ["t0", "t1"],
                      "engine": ["sim"]}
    # "All" in every variable filters nothing
    headline = by_key("headline")
    everything = store.query_polars(substitute(headline.sql, store.db, 0, 2**31)).to_dicts()
    all_of_them = store.query_polars(substitute(headline.sql, store.db, 0, 2**31, variables={
        n: ALL for n in values})).to_dicts()
    assert everything == all_of_them and everything[0]["lookups"] == 160


def test_built_with_the_sdk_and_written_by_the_cli(tmp_path: Path) -> None:
    assert isinstance(build("kvtrace"), Dashboard)
    done = subprocess.run([sys.executable, "-m", "kvtrace.cli.main", "--dsn", f"chdb://{tmp_path / 'db'}", "grafana",
                           "-o", str(tmp_path / "out"), "--database", "kvx"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    written = json.loads((tmp_path / "out" / "kvtrace-overview.json").read_text())
    assert written == dashboard("kvx")
    assert all("kvx.events" in t["rawSql"] or "kvx.verdicts" in t["rawSql"] or "kvx.verifications" in t["rawSql"]
               for p in written["panels"] for t in p.get("targets", []))
