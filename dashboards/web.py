"""The web dashboard (`kvtrace dashboard`): FastAPI pages of plotly charts over the store.

Every chart is a panel from `queries` (the Grafana dashboard runs the same SQL), aggregated
inside the store; the page only draws what comes back. Each page opens with the headline tiles
(the `headline` panel), then its charts, each axis titled with its unit. Filters (a relative or
explicit time range, model, instance, tenant, engine, auto-refresh) are query parameters, so a
view is a link; links, the form and plotly.js are addressed under the app's root path, so the
app works mounted under a prefix. An empty panel says why it is empty and what fills it. plotly.js
is served from the installed plotly package: the dashboard works without internet access. Each
chart records how many points it drew in `data-points` once drawn, which the browser tests read.
"""

from __future__ import annotations

import functools
import html
import json
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import msgspec
import polars as pl
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, JSONResponse, Response

from kvtrace.dashboards.figures import figures
from kvtrace.dashboards.queries import (
    PAGES,
    PANELS,
    Panel,
    PanelKind,
    Source,
    by_key,
    coverage_sql,
    filters,
    render,
    substitute,
)
from kvtrace.dashboards.timerange import (
    CUSTOM,
    RANGE_NAMES,
    REFRESH,
    BadInput,
    Window,
    iso,
    parse_choice,
    parse_positive,
    resolve,
)
from kvtrace.store.client import Store

VARIABLE_NAMES = ("model", "instance", "tenant", "engine")


@dataclass(frozen=True, slots=True)
class View:
    """What a page shows: a time range (unix seconds), equality filters, and how it was asked for."""

    from_s: int
    to_s: int
    interval_s: int
    variables: dict[str, str]
    range_key: str = CUSTOM  # a relative range stays relative in links; CUSTOM links carry from/to
    refresh: str = "off"
    explicit_interval: bool = False

    def query(self) -> str:
        """The view as a query string, escaped for an HTML attribute."""
        items: dict[str, object] = ({"from": self.from_s, "to": self.to_s} if self.range_key == CUSTOM
                                    else {"range": self.range_key})
        items |= {k: v for k, v in self.variables.items() if v}
        if self.explicit_interval:
            items["interval_s"] = self.interval_s
        if self.refresh != "off":
            items["refresh"] = self.refresh
        return html.escape(urlencode(items))


@dataclass(frozen=True, slots=True)
class Coverage:
    """What the store holds for a view (`queries.coverage_sql`): why a panel is empty."""

    events: int
    verdicts: int
    timed: int
    usage: int
    verifications: int
    events_stored: int


# Panels in the emitters' own clock (wall time; an end can come long after the last event, and a
# replay's events are in its trace's time): their pages default to the range of the emitters' stats.
_EMITTER_CLOCK = frozenset({"endings"})


def _bounds(store: Store, keys: tuple[str, ...] = ()) -> tuple[int, int]:
    """The range of everything stored, for a page showing these panels."""
    if keys and _EMITTER_CLOCK.issuperset(keys):
        sql = f"SELECT min(ts_ns) AS lo, max(greatest(ts_ns, ended_ns)) AS hi FROM {store.db}.emitter_stats"
    else:
        sql = f"SELECT min(ts_ns) AS lo, max(ts_ns) AS hi FROM {store.db}.events"
    row = store.query_arrow(sql).to_pylist()[0]
    lo, hi = row["lo"] or 0, row["hi"] or 0
    return int(lo // 10**9), (int(hi // 10**9) + 1 if hi else 0)


def panel_rows(store: Store, panel: Panel, view: View) -> pl.DataFrame:
    sql = render(panel, store.db, view.from_s, view.to_s, view.interval_s, view.variables)
    return store.query_polars(sql)


def coverage(store: Store, view: View) -> Coverage:
    sql = substitute(coverage_sql(), store.db, view.from_s, view.to_s, view.interval_s, view.variables)
    return Coverage(**{k: int(v or 0) for k, v in store.query_arrow(sql).to_pylist()[0].items()})


# -- empty states: the cause and the fix ------------------------------------------------------

_NO_EVENTS = ("The store holds no events yet. Send some: run an engine with the kvtrace shim "
              "(<code>KVTRACE_ENABLED=1</code>) pointed at <code>kvtrace collector</code>, load recorded events with "
              "<code>kvtrace ingest FILE</code>, or try <code>kvtrace demo</code>.")
_NO_VERDICTS = ("There are events in this range but no verdicts: nothing has judged these lookups yet. Run "
                "<code>kvtrace analyze --write-verdicts</code> over the store, or run <code>kvtrace collector</code> "
                "with live verdicts (without <code>--no-live</code>).")
_NO_TIMED = ("No timed loads, offloads or recomputes in this range: they are load, offload and adopt events that "
             "carry a duration, which shims emit when the engine times its KV transfers and recompute "
             "(<code>kvtrace replay</code> and <code>kvtrace demo</code> do). <code>kvtrace calibrate</code> measures "
             "these costs on this machine instead.")
_NO_USAGE = ("No usage samples in this range: engines report each tier's locked, evictable and free bytes in "
             "<code>usage</code> events, and this one sends none. The occupancy chart computes residency from "
             "lifecycle events instead.")
_NO_VERIFICATIONS = ("No verifications in this range: run <code>kvtrace verify</code>, or set "
                     "<code>KVTRACE_VERIFY_RATE</code> on an engine to re-run a sample of requests without the cache.")


def empty_state(panel: Panel, cov: Coverage) -> tuple[str, str]:
    """(css class, message) for a panel that drew nothing: "none" is good news, "empty" names a
    cause and its fix."""
    if cov.events_stored == 0 and panel.source is not Source.EMITTERS:
        return "empty", _NO_EVENTS
    if cov.events == 0 and panel.source is not Source.EMITTERS:
        return "empty", (f"No events match these filters in this time range (the store holds "
                         f"{cov.events_stored:,}): choose a wider range (all) or clear a filter.")
    missing = {Source.VERDICTS: (cov.verdicts, _NO_VERDICTS), Source.TIMED: (cov.timed, _NO_TIMED),
               Source.USAGE: (cov.usage, _NO_USAGE), Source.VERIFICATIONS: (cov.verifications, _NO_VERIFICATIONS)}
    count, message = missing.get(panel.source, (1, ""))
    if not count:
        return "empty", message
    if panel.zero_is_good:
        return "none", (f"<b>None.</b> No request adopted more than was recoverable in this range "
                        f"({cov.verdicts:,} lookups judged).")
    if panel.when_empty:
        return "none", html.escape(panel.when_empty)
    return "empty", "No rows for these filters in this time range."


# -- headline tiles ----------------------------------------------------------------------------

_TILE_HINTS = {"logical_rate": "prompt tokens whose hash was found",
               "recoverable_rate": "prompt tokens backed by valid state",
               "adopted_rate": "prompt tokens the engine reused",
               "tokens_lost": "hash hits without valid state: recomputed",
               "unsafe_reuses": "lookups that adopted beyond recoverable",
               "readmissions": "preempted requests admitted again, counted apart"}


def _tile_text(column: str, value: Any) -> tuple[str, str]:
    """(text, css class) of one headline value."""
    if value is None:
        return "n/a", "na"
    if column.endswith("_rate"):
        return f"{value:.1%}", ""
    if column == "unsafe_reuses":
        return ("none", "good") if value == 0 else (f"{value:,}", "bad")
    return f"{value:,}", ""


def judged(rows: pl.DataFrame) -> int:
    """How many lookups the headline row adds up."""
    return int(rows["lookups"][0] or 0) if rows.height else 0


def tiles(panel: Panel, rows: pl.DataFrame, base: str, view: View, why_empty: tuple[str, str] | None) -> str:
    """The headline tiles; `why_empty` (css class, message) says what is missing when no lookup
    was judged, once, above every panel."""
    row = rows.row(0, named=True) if rows.height else {}
    judged = why_empty is None
    cells = []
    for column in panel.series:
        value = row.get(column) if judged else None
        text, css = _tile_text(column, value)
        link = (f" <a href='{base}/unsafe?{view.query()}'>which</a>" if column == "unsafe_reuses" and css == "bad"
                else f" <a href='{base}/preemption?{view.query()}'>what they cost</a>"
                if column == "readmissions" and value else "")
        cells.append(f"<div class='tile {css}' data-stat='{column}' data-value='{'' if value is None else value}'>"
                     f"<div class='v'>{text}</div><div class='l'>{html.escape(panel.label(column))}{link}</div>"
                     f"<div class='h'>{html.escape(_TILE_HINTS.get(column, ''))}</div></div>")
    if why_empty is None:
        note = (f"<p class='note'>{row['lookups']:,} requests judged in this range, each at its first admission "
                "as the engine counts it.</p>")
    else:
        note = f"<div class='{why_empty[0]}' id='why-empty'>{why_empty[1]}</div>"
    return f"<div class='tiles' data-lookups='{row.get('lookups', 0) or 0}'>{''.join(cells)}</div>{note}"


# -- the page ----------------------------------------------------------------------------------

_STYLE = ("body{font-family:system-ui,sans-serif;margin:1.2em 1.5em;max-width:1250px;color:#222}"
          "nav a{margin-right:1.1em}nav a.here{font-weight:bold;text-decoration:none;color:#222}"
          "h1{margin:.4em 0 .3em}h2{font-size:1.1em;margin:1.4em 0 .3em}"
          "table{border-collapse:collapse;margin:1em 0}th,td{border:1px solid #ccc;padding:3px 6px;text-align:left;"
          "font-size:13px}.empty{padding:1em;background:#fff8e6;border:1px dashed #d9a400;margin:1em 0}"
          ".none{padding:1em;background:#eefbea;border:1px solid #5cb85c;margin:1em 0}"
          "form{background:#f4f6f8;padding:.6em .8em;border-radius:6px}form label{margin-right:.8em;white-space:nowrap}"
          "form input,form select{margin-left:.3em}.clock{color:#555;font-size:13px;margin:.4em 0}"
          ".tiles{display:flex;gap:.8em;flex-wrap:wrap;margin:1em 0 .2em}.tile{flex:1 1 170px;border:1px solid #d0d7de;"
          "border-radius:8px;padding:.6em .8em;background:#fff}.tile .v{font-size:2em;font-weight:600}"
          ".tile .l{font-size:14px;font-weight:600}.tile .h{font-size:12px;color:#666}.tile.good .v{color:#2e7d32}"
          ".tile.bad .v{color:#c62828}.tile.na .v{color:#999}.note{color:#555;font-size:13px;margin:.2em 0 1em}"
          ".desc{color:#444;font-size:14px;max-width:1100px}")

_FROM_TO_JS = ("document.querySelectorAll('input[name=from],input[name=to]').forEach(function(i){"
               "i.addEventListener('input',function(){document.querySelector('select[name=range]').value='custom';});});")


def _select(name: str, options: list[tuple[str, str]], current: str) -> str:
    body = "".join(f"<option value='{html.escape(v)}'{' selected' if v == current else ''}>{html.escape(t)}</option>"
                   for v, t in options)
    return f"<select name='{name}'>{body}</select>"


def _page(title: str, path: str, base: str, view: View, window: Window | None, choices: dict[str, list[str]],
          body: str) -> str:
    nav = "".join(f"<a href='{base}/{p}?{view.query()}'{' class=here' if p == path else ''}>{html.escape(name)}</a>"
                  for p, (name, _) in PAGES.items())
    ranges = [(CUSTOM, "custom (from / to)"), *((k, v) for k, v in RANGE_NAMES.items())]
    fields = [f"<label>range {_select('range', ranges, view.range_key)}</label>",
              f"<label>from <input name='from' value='{iso(view.from_s)}' size='21' title='ISO-8601 "
              "(2025-06-15T12:00:00Z, 2025-06-15) or Unix seconds; UTC unless a zone is given'></label>",
              f"<label>to <input name='to' value='{iso(view.to_s)}' size='21'></label>"]
    for name in VARIABLE_NAMES:
        options = [("", "all"), *((v, v) for v in choices.get(name, []))]
        fields.append(f"<label>{name} {_select(name, options, view.variables.get(name, ''))}</label>")
    fields.append(f"<label>refresh {_select('refresh', [(k, k) for k in REFRESH], view.refresh)}</label>")
    if view.explicit_interval:
        fields.append(f"<input type='hidden' name='interval_s' value='{view.interval_s}'>")
    refresh_s = REFRESH[view.refresh]
    meta = f"<meta http-equiv='refresh' content='{refresh_s}'>" if refresh_s else ""
    clock = window.describe(int(time.time())) if window else ""
    return (f"<!doctype html><html><head><meta charset='utf-8'>{meta}<title>kvtrace: {html.escape(title)}</title>"
            f"<style>{_STYLE}</style><script src='{base}/static/plotly.min.js'></script></head><body>"
            f"<nav>{nav}</nav><h1>{html.escape(title)}</h1>"
            f"<form method='get' action='{base}/{path}'>{''.join(fields)}<button>apply</button></form>"
            f"<p class='clock'>{html.escape(clock)} Times are UTC.</p>{body}"
            f"<script>{_FROM_TO_JS}document.body.dataset.ready = '1';</script></body></html>")


def _chart(div: str, figure: dict[str, Any]) -> str:
    spec = json.dumps(figure, default=str)
    return (f"<div id='{div}' class='chart'></div><script>(function(){{const f={spec};"
            f"const el=document.getElementById('{div}');Plotly.newPlot(el,f.data,f.layout,{{responsive:true}})"
            ".then(function(){el.dataset.points=String(f.data.reduce(function(n,t){return n+(t.x?t.x.length:0)},0));"
            "});})();</script>")


def _table(rows: pl.DataFrame) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows.columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in r) + "</tr>" for r in rows.iter_rows())
    return f"<table class='rows' data-points='{rows.height}'><tr>{head}</tr>{body}</table>"


def _error_page(base: str, message: str) -> HTMLResponse:
    return HTMLResponse(
        f"<!doctype html><html><head><meta charset='utf-8'><title>kvtrace: bad request</title><style>{_STYLE}</style>"
        f"</head><body><h1>Bad request</h1><p class='empty' id='error'>{html.escape(message)}</p>"
        f"<p><a href='{base}/'>Back to the dashboard</a> (times: ISO-8601 such as 2025-06-15T12:00:00Z, or Unix "
        "seconds)</p></body></html>", status_code=400)


def _base(request: Request) -> str:
    """The prefix the app is served under (a mount, or a proxy's --root-path), for absolute links."""
    return html.escape(str(request.scope.get("root_path", "")).rstrip("/"))


def create_dashboard_app(store: Store) -> FastAPI:
    app = FastAPI(title="kvtrace dashboard", docs_url=None, redoc_url=None)

    def view_of(request: Request, keys: tuple[str, ...]) -> tuple[View, Window]:
        params = request.query_params
        window = resolve(params.get("range", ""), params.get("from", ""), params.get("to", ""),
                         _bounds(store, keys), int(time.time()))
        refresh = parse_choice("refresh", params.get("refresh", "off") or "off", REFRESH)
        interval = parse_positive("interval_s", params.get("interval_s", ""))
        step = interval or max(1, (window.to_s - window.from_s) // 120)  # about 120 points across the range
        variables = {name: params.get(name, "") for name in VARIABLE_NAMES}
        view = View(window.from_s, window.to_s, step, variables, window.range_key, refresh, interval is not None)
        return view, window

    def choices() -> dict[str, list[str]]:
        out = {}
        for name in VARIABLE_NAMES:
            rows = store.query_arrow(f"SELECT DISTINCT {name} AS v FROM {store.db}.events WHERE {name} != '' "
                                     "ORDER BY v LIMIT 200").to_pylist()
            out[name] = [r["v"] for r in rows]
        return out

    def page(path: str, base: str, view: View, window: Window) -> str:
        title, keys = PAGES[path]
        cov = functools.cache(lambda: coverage(store, view))  # read only when something is empty
        headline = by_key("headline")
        summary = panel_rows(store, headline, view)
        why_empty = None if judged(summary) else empty_state(headline, cov())
        parts = [tiles(headline, summary, base, view, why_empty)]
        # the cause the tiles already explain is named once, above; panels with the same one point to it
        said = why_empty[1] if why_empty else ""
        for i, key in enumerate(keys):
            panel = by_key(key)
            rows = panel_rows(store, panel, view)
            parts.append(f"<section data-panel='{key}'><h2>{html.escape(panel.title)}</h2>")
            if panel.description:
                parts.append(f"<p class='desc'>{html.escape(panel.description)}</p>")
            if not rows.height:
                css, message = empty_state(panel, cov())
                if message == said:
                    message = "Nothing to draw, for the reason in the note above."
                parts.append(f"<div class='{css}' data-points='0'>{message}</div>")
            elif panel.kind is PanelKind.TABLE:
                parts.append(_table(rows))
            else:
                charts = figures(panel, rows)
                wrap = "facets" if len(charts) > 1 else "single"
                parts.append(f"<div class='{wrap}'>" + "".join(_chart(f"chart{i}_{j}", fig)
                                                              for j, (_, fig) in enumerate(charts)) + "</div>")
            parts.append("</section>")
        if path == "costs":
            parts.append(_costs(store, view))
        if path == "fleet":
            parts.append(_regret_seconds(store, view))
        return _page(title, path, base, view, window, choices(), "".join(parts))

    def route(path: str) -> Any:
        async def handler(request: Request) -> HTMLResponse:
            try:
                view, window = view_of(request, PAGES[path][1])
            except BadInput as e:
                return _error_page(_base(request), str(e))
            return HTMLResponse(await run_in_threadpool(page, path, _base(request), view, window))

        return handler

    for path in PAGES:
        app.add_api_route(f"/{path}", route(path), methods=["GET"], response_class=HTMLResponse)

    @app.get("/api/panels/{key}")
    async def panel_data(key: str, request: Request) -> Response:
        """A panel's rows as JSON: what the chart draws, for scripts and tests. Takes the pages'
        parameters (from, to, range, interval_s, model, instance, tenant, engine)."""
        try:
            panel = by_key(key)
        except KeyError:
            return JSONResponse({"error": f"no panel {key!r}; panels: {', '.join(p.key for p in PANELS)}"}, 404)
        try:
            view, _ = view_of(request, (key,))
        except BadInput as e:
            return JSONResponse({"error": str(e)}, 400)
        rows = await run_in_threadpool(panel_rows, store, panel, view)
        return Response(msgspec.json.encode(rows.to_dicts()), media_type="application/json")

    @app.get("/static/plotly.min.js")
    async def plotly_js() -> Response:
        from plotly.offline import get_plotlyjs

        return Response(get_plotlyjs(), media_type="application/javascript",
                        headers={"Cache-Control": "max-age=86400"})

    return app


def _timed_events(store: Store, view: View) -> pl.DataFrame:
    """What the cost models are fitted to: the timed loads and adopts in range (and the commits,
    for bytes per token)."""
    where = substitute(filters("events"), store.db, view.from_s, view.to_s, view.interval_s, view.variables)
    return store.query_polars(
        f"SELECT * FROM {store.db}.events FINAL WHERE {where} AND (kind IN ('load', 'adopt') AND duration_ns > 0 "
        "OR kind = 'commit')")


def _regret_seconds(store: Store, view: View) -> str:
    """Routing regret in seconds by instance pair, priced by the cost models fitted in range
    (a table only the web page has: Grafana's SQL cannot fit them)."""
    from kvtrace.analysis.costs import fit_prefill, fit_transfers, regret_by_pair, routing_regret_seconds

    title = "Routing regret in seconds, by instance pair (fitted cost models)"
    where = substitute(filters("verdicts"), store.db, view.from_s, view.to_s, view.interval_s, view.variables)
    rows = store.query_polars(f"SELECT * FROM {store.db}.verdicts FINAL WHERE {where} AND routing_regret_tokens > 0")
    if not rows.height:
        return (f"<section data-panel='regret_seconds'><h2>{title}</h2><div class='empty' data-points='0'>No "
                "routing regret in range.</div></section>")
    events = _timed_events(store, view)
    pairs = regret_by_pair(routing_regret_seconds(rows, fit_transfers(events), fit_prefill(events)))
    note = ("<p class='desc'>Serving each regretted request where it was sent against on the best instance: "
            "restore plus recompute, by the fitted load and prefill costs. exact is false where the best instance's "
            "restore is priced on the slowest fitted path (the seconds are then a lower bound); unpriced counts "
            f"requests whose model or restore path has no fitted cost. {_NO_TIMED}</p>")
    return f"<section data-panel='regret_seconds'><h2>{title}</h2>{note}{_table(pairs)}</section>"


def _costs(store: Store, view: View) -> str:
    """The crossover chart from the cost models fitted to the timed loads and adopts in range."""
    from kvtrace.analysis.costs import crossover_curve, fit_prefill, fit_transfers
    from kvtrace.analysis.planning import bytes_per_token

    title = "Restore beats recompute above this many tokens (fitted cost models)"
    events = _timed_events(store, view)
    transfers, prefills = fit_transfers(events), fit_prefill(events)
    curve = crossover_curve(transfers, prefills, bytes_per_token(events), [0, 1024, 4096, 16384, 65536])
    if not curve.height:
        return (f"<section data-panel='crossover'><h2>{title}</h2><div class='empty' data-points='0'>No fitted cost "
                "models for these filters: fitting needs at least 8 timed loads per tier path and 8 adopts that "
                f"report their recompute time, of varying sizes. {_NO_TIMED}</div></section>")
    figure = {"data": [{"type": "scatter", "mode": "lines+markers", "name": f"{m}: {src} -> device",
                        "x": part["start"].to_list(), "y": part["crossover_tokens"].to_list(),
                        "line": {"dash": ("solid", "dash", "dot")[i % 3]}}
                       for i, ((m, src), part) in enumerate(curve.group_by(["model", "src_tier"],
                                                                           maintain_order=True))],
              "layout": {"height": 420, "margin": {"t": 30},
                         "xaxis": {"title": {"text": "context position (tokens cached before)"}},
                         "yaxis": {"title": {"text": "smallest restore that pays (tokens)"}, "rangemode": "tozero"}}}
    return f"<section data-panel='crossover'><h2>{title}</h2>{_chart('costs', figure)}</section>"
