"""The web dashboard (`kvtrace dashboard`): FastAPI pages of plotly charts over the store.

Every chart is a panel from `queries` (the Grafana dashboards run the same SQL), aggregated
inside the store; the page only draws what comes back. Filters (time range, model, instance,
tenant, engine) are query parameters, so a view is a link. plotly.js is served from the
installed plotly package: the dashboard works without internet access. Each chart records how
many points it drew in `data-points` once drawn, which the browser tests read.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlencode

import msgspec
import polars as pl
from fastapi import FastAPI, Query
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, JSONResponse, Response

from kvtrace.dashboards.queries import PANELS, Panel, PanelKind, by_key, filters, render, substitute
from kvtrace.store.client import Store

PAGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "": ("Hit funnel", ("funnel",)),
    "gaps": ("Why the gap", ("reasons", "restore")),
    "unsafe": ("Unsafe reuse", ("unsafe", "verify")),
    "tiers": ("Tiers", ("usage", "tiers")),
    "timings": ("Lifecycle timings", ("transfers", "residency")),
    "costs": ("Load vs recompute", ()),
    "health": ("Event streams", ("endings",)),
}


@dataclass(frozen=True, slots=True)
class View:
    """What a page shows: a time range (unix seconds) and equality filters."""

    from_s: int
    to_s: int
    interval_s: int
    variables: dict[str, str]

    def query(self) -> str:
        """The view as a query string, escaped for an HTML attribute."""
        items = {"from": self.from_s, "to": self.to_s, **{k: v for k, v in self.variables.items() if v}}
        return html.escape(urlencode(items))


# Panels in the emitters' own clock (wall time; an end can come long after the last event, and a
# replay's events are in its trace's time): their pages default to the range of the emitters' stats.
_EMITTER_CLOCK = frozenset({"endings"})


def _bounds(store: Store, keys: tuple[str, ...] = ()) -> tuple[int, int]:
    """The default time range of a page showing these panels: everything stored."""
    if keys and _EMITTER_CLOCK.issuperset(keys):
        sql = f"SELECT min(ts_ns) AS lo, max(greatest(ts_ns, ended_ns)) AS hi FROM {store.db}.emitter_stats"
    else:
        sql = f"SELECT min(ts_ns) AS lo, max(ts_ns) AS hi FROM {store.db}.events"
    row = store.query_arrow(sql).to_pylist()[0]
    lo, hi = row["lo"] or 0, row["hi"] or 0
    return int(lo // 10**9), int(hi // 10**9) + 1


def panel_rows(store: Store, panel: Panel, view: View) -> pl.DataFrame:
    sql = render(panel, store.db, view.from_s, view.to_s, view.interval_s, view.variables)
    return store.query_polars(sql)


def _figure(panel: Panel, rows: pl.DataFrame) -> dict[str, Any]:
    """A plotly figure spec (plain JSON) for a panel's rows."""
    traces: list[dict[str, Any]] = []
    kind = "bar" if panel.kind is PanelKind.BARS else "scatter"
    groups = (rows.partition_by(panel.group_by, as_dict=True, maintain_order=True).items()
              if panel.group_by and rows.height else [((None,), rows)])
    for key, part in groups:
        xs = part[panel.x]
        if panel.x == "time" and xs.dtype.is_integer():  # DateTime arrives as Unix seconds
            xs = pl.from_epoch(xs, time_unit="s")
        x = [v.isoformat() if hasattr(v, "isoformat") else str(v) for v in xs.to_list()]
        for column in panel.series:
            name = column if key[0] is None else f"{column} ({panel.group_by} {key[0]})"
            traces.append({"type": kind, "name": name, "x": x, "y": part[column].to_list(),
                           **({"mode": "lines+markers"} if kind == "scatter" else {}),
                           **({"yaxis": "y2", "offsetgroup": "right"} if column in panel.right_axis else
                              {"offsetgroup": "left"} if panel.right_axis else {})})
    layout: dict[str, Any] = {"title": {"text": panel.title}, "height": 420,
                              "margin": {"l": 60, "r": 60, "t": 60, "b": 80}, "barmode": "group"}
    if panel.right_axis:
        layout["yaxis"] = {"title": {"text": ", ".join(c for c in panel.series if c not in panel.right_axis)}}
        layout["yaxis2"] = {"title": {"text": ", ".join(panel.right_axis)}, "overlaying": "y", "side": "right"}
    return {"data": traces, "layout": layout}


def _table(panel: Panel, rows: pl.DataFrame) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows.columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in r) + "</tr>" for r in rows.iter_rows())
    return (f"<h2>{html.escape(panel.title)}</h2><table class='rows' data-points='{rows.height}'>"
            f"<tr>{head}</tr>{body}</table>")


_STYLE = ("body{font-family:system-ui,sans-serif;margin:1.5em;max-width:1200px}nav a{margin-right:1em}"
          "table{border-collapse:collapse;margin:1em 0}th,td{border:1px solid #ccc;padding:3px 6px;text-align:left;"
          "font-size:13px}.empty{padding:1em;background:#f6f6f6;border:1px dashed #bbb;margin:1em 0}"
          "form input,form select{margin-right:.6em}")


def _page(title: str, view: View, choices: dict[str, list[str]], body: str) -> str:
    nav = "".join(f"<a href='/{path}?{view.query()}'>{html.escape(name)}</a>" for path, (name, _) in PAGES.items())
    fields = [f"from <input name='from' value='{view.from_s}' size='11'> "
              f"to <input name='to' value='{view.to_s}' size='11'>"]
    for name in ("model", "instance", "tenant", "engine"):
        options = "".join(f"<option value='{html.escape(v)}'{' selected' if v == view.variables.get(name) else ''}>"
                          f"{html.escape(v) or 'all'}</option>" for v in ["", *choices.get(name, [])])
        fields.append(f"{name} <select name='{name}'>{options}</select>")
    span = (f"{datetime.fromtimestamp(view.from_s, timezone.utc):%Y-%m-%d %H:%M:%S} .. "
            f"{datetime.fromtimestamp(view.to_s, timezone.utc):%Y-%m-%d %H:%M:%S} UTC")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>kvtrace: {html.escape(title)}</title>"
            f"<style>{_STYLE}</style><script src='/static/plotly.min.js'></script></head><body>"
            f"<nav>{nav}</nav><h1>{html.escape(title)}</h1><form>{''.join(fields)}<button>apply</button></form>"
            f"<p>{span}</p>{body}"
            "<script>document.body.dataset.ready = '1';</script></body></html>")


def _chart(div: str, figure: dict[str, Any]) -> str:
    spec = json.dumps(figure, default=str)
    return (f"<div id='{div}' class='chart'></div><script>(function(){{const f={spec};"
            f"const el=document.getElementById('{div}');Plotly.newPlot(el,f.data,f.layout).then(function(){{"
            "el.dataset.points=String(f.data.reduce(function(n,t){return n+(t.x?t.x.length:0)},0));});})();</script>")


def create_dashboard_app(store: Store) -> FastAPI:
    app = FastAPI(title="kvtrace dashboard", docs_url=None, redoc_url=None)

    def view_of(keys: tuple[str, ...], start: int | None, end: int | None, model: str, instance: str, tenant: str,
                engine: str, interval_s: int | None) -> View:
        lo, hi = _bounds(store, keys)
        from_s, to_s = start if start is not None else lo, end if end is not None else hi
        step = interval_s or max(1, (to_s - from_s) // 120)  # about 120 points across the range
        return View(from_s, to_s, step, {"model": model, "instance": instance, "tenant": tenant, "engine": engine})

    def choices() -> dict[str, list[str]]:
        out = {}
        for name in ("model", "instance", "tenant", "engine"):
            rows = store.query_arrow(f"SELECT DISTINCT {name} AS v FROM {store.db}.events WHERE {name} != '' "
                                     "ORDER BY v LIMIT 200").to_pylist()
            out[name] = [r["v"] for r in rows]
        return out

    def page(path: str, view: View) -> str:
        title, keys = PAGES[path]
        parts = []
        if path == "costs":
            parts.append(_costs(store, view))
        for i, key in enumerate(keys):
            panel = by_key(key)
            rows = panel_rows(store, panel, view)
            if not rows.height:
                parts.append(f"<h2>{html.escape(panel.title)}</h2><div class='empty' data-points='0'>"
                             "No data for these filters and this time range.</div>")
            elif panel.kind is PanelKind.TABLE:
                parts.append(_table(panel, rows))
            else:
                if panel.description:
                    parts.append(f"<p>{html.escape(panel.description)}</p>")
                parts.append(_chart(f"chart{i}", _figure(panel, rows)))
        return _page(title, view, choices(), "".join(parts))

    def route(path: str) -> Any:
        async def handler(start: int | None = Query(None, alias="from", ge=0),
                          end: int | None = Query(None, alias="to", ge=0),
                          model: str = "", instance: str = "", tenant: str = "", engine: str = "",
                          interval_s: int | None = Query(None, ge=1)) -> HTMLResponse:
            view = view_of(PAGES[path][1], start, end, model, instance, tenant, engine, interval_s)
            return HTMLResponse(await run_in_threadpool(page, path, view))

        return handler

    for path in PAGES:
        app.add_api_route(f"/{path}", route(path), methods=["GET"], response_class=HTMLResponse)

    @app.get("/api/panels/{key}")
    async def panel_data(key: str, start: int | None = Query(None, alias="from", ge=0),
                         end: int | None = Query(None, alias="to", ge=0), model: str = "", instance: str = "",
                         tenant: str = "", engine: str = "", interval_s: int | None = Query(None, ge=1)) -> Response:
        """A panel's rows as JSON: what the chart draws, for scripts and tests."""
        try:
            panel = by_key(key)
        except KeyError:
            return JSONResponse({"error": f"no panel {key!r}; panels: {', '.join(p.key for p in PANELS)}"}, 404)
        view = view_of((key,), start, end, model, instance, tenant, engine, interval_s)
        rows = await run_in_threadpool(panel_rows, store, panel, view)
        return Response(msgspec.json.encode(rows.to_dicts()), media_type="application/json")

    @app.get("/static/plotly.min.js")
    async def plotly_js() -> Response:
        from plotly.offline import get_plotlyjs

        return Response(get_plotlyjs(), media_type="application/javascript",
                        headers={"Cache-Control": "max-age=86400"})

    return app


def _costs(store: Store, view: View) -> str:
    """The crossover chart from the timed loads and adopts in range (only those rows are read)."""
    from kvtrace.analysis.costs import crossover_curve, fit_prefill, fit_transfers
    from kvtrace.analysis.planning import bytes_per_token

    where = substitute(filters("events"), store.db, view.from_s, view.to_s, view.interval_s, view.variables)
    events = store.query_polars(
        f"SELECT * FROM {store.db}.events FINAL WHERE {where} AND (kind IN ('load', 'adopt') AND duration_ns > 0 "
        "OR kind = 'commit')")
    transfers, prefills = fit_transfers(events), fit_prefill(events)
    curve = crossover_curve(transfers, prefills, bytes_per_token(events), [0, 1024, 4096, 16384, 65536])
    if not curve.height:
        return ("<h2>Restore beats recompute above this many tokens</h2><div class='empty' data-points='0'>No fitted "
                "cost models for these filters: they need timed loads and adopts that report their recompute time "
                "(or a `kvtrace calibrate` run).</div>")
    figure = {"data": [{"type": "scatter", "mode": "lines+markers", "name": f"{m}: {src} -> device",
                        "x": part["start"].to_list(), "y": part["crossover_tokens"].to_list()}
                       for (m, src), part in curve.group_by(["model", "src_tier"], maintain_order=True)],
              "layout": {"title": {"text": "Restore beats recompute above this many tokens"},
                         "xaxis": {"title": {"text": "context position (tokens cached before)"}},
                         "yaxis": {"title": {"text": "tokens to restore"}}, "height": 420}}
    return _chart("costs", figure)
