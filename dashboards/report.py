"""A self-contained HTML report (plotly) of one analysis: open it anywhere, no server needed."""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path

import plotly.graph_objects as go
import polars as pl

from kvtrace.analysis.funnel import funnel, reasons
from kvtrace.analysis.planning import CostReport, capacity_report, cost_report
from kvtrace.analysis.run import Observations
from kvtrace.schema.recipes import Recipe, RecipeBook

_RATES = (
    ("logical_token_rate", "logical (hash hit)"),
    ("recoverable_token_rate", "recoverable"),
    ("resident_token_rate", "resident (no restore)"),
    ("adopted_token_rate", "adopted"),
)


def funnel_over_time(results: pl.DataFrame, bucket_ns: int) -> go.Figure:
    by_time = funnel(results, bucket_ns=bucket_ns)
    minutes = ((by_time["bucket_ns"] - by_time["bucket_ns"].min()) / 60e9).to_list() if by_time.height else []
    fig = go.Figure(
        [go.Scatter(x=minutes, y=(by_time[col] * 100).to_list(), name=label, mode="lines+markers")
         for col, label in _RATES]
    )
    fig.update_layout(title="Hit funnel over time (% of prompt tokens)", xaxis_title="minutes into the trace",
                      yaxis_title="% of prompt tokens")
    return fig


def reason_breakdown(results: pl.DataFrame) -> go.Figure:
    table = reasons(results)
    fig = go.Figure(go.Bar(x=table["tokens_lost"].to_list(), y=table["reason"].to_list(), orientation="h",
                           text=table["lookups"].to_list(), hovertemplate="%{y}: %{x} tokens, %{text} lookups"))
    fig.update_layout(title="Why recoverable falls short of logical (tokens lost, by reason)",
                      xaxis_title="tokens", yaxis={"autorange": "reversed"})
    return fig


def tier_occupancy(samples: Sequence[tuple[int, dict[str, int]]]) -> go.Figure:
    minutes = [ts / 60e9 for ts, _ in samples]
    tiers = sorted({t for _, used in samples for t in used})
    fig = go.Figure(
        [go.Scatter(x=minutes, y=[used.get(t, 0) / 2**30 for _, used in samples], name=t, stackgroup="tiers")
         for t in tiers]
    )
    fig.update_layout(title="Tier occupancy (GiB)", xaxis_title="minutes into the trace", yaxis_title="GiB")
    return fig


def policy_comparison(policies: pl.DataFrame) -> go.Figure:
    names = policies["policy"].to_list()
    fig = go.Figure(
        [
            go.Bar(x=names, y=(policies["object_hit_rate"] * 100).to_list(), name="object (hash) hits"),
            go.Bar(x=names, y=(policies["recoverable_rate"] * 100).to_list(), name="recoverable"),
        ]
    )
    fig.update_layout(title="Retention policies on the same trace and capacity (% of prompt tokens)",
                      barmode="group", yaxis_title="% of prompt tokens")
    return fig


def crossover_chart(crossovers: pl.DataFrame) -> go.Figure:
    fig = go.Figure()
    for (model, src), part in crossovers.sort("start").group_by(["model", "src_tier"], maintain_order=True):
        fig.add_trace(go.Scatter(x=part["start"].to_list(), y=part["crossover_tokens"].to_list(),
                                 name=f"{model}: {src} -> device", mode="lines+markers"))
    fig.update_layout(title="Load vs recompute: restore beats recompute above this many tokens",
                      xaxis_title="context position (tokens already cached)", yaxis_title="tokens to restore")
    return fig


def capacity_chart(curves: Sequence[tuple[str, pl.DataFrame]]) -> go.Figure:
    fig = go.Figure()
    for model, curve in curves:
        for (group, component), part in curve.group_by(["group", "component"], maintain_order=True):
            fig.add_trace(go.Scatter(x=part["capacity_blocks"].to_list(), y=(part["hit_rate"] * 100).to_list(),
                                     name=f"{model}: group {group} ({component})", mode="lines+markers"))
    fig.update_layout(title="Resumable share of prompt tokens against each group's capacity (LRU)",
                      xaxis={"title": "capacity (blocks of the group)", "type": "log"},
                      yaxis_title="% of prompt tokens")
    return fig


def write_report(
    path: str | Path,
    title: str,
    summary: Sequence[tuple[str, str]],
    results: pl.DataFrame,
    occupancy: Sequence[tuple[int, dict[str, int]]] = (),
    policies: pl.DataFrame | None = None,
    bucket_ns: int = 60 * 10**9,
    crossovers: pl.DataFrame | None = None,
    capacity: Sequence[tuple[str, pl.DataFrame]] = (),
) -> Path:
    """One HTML file with plotly.js inlined once; returns its path."""
    figures = [funnel_over_time(results, bucket_ns), reason_breakdown(results)]
    if crossovers is not None and crossovers.height:
        figures.append(crossover_chart(crossovers))
    if capacity:
        figures.append(capacity_chart(capacity))
    if occupancy:
        figures.append(tier_occupancy(occupancy))
    if policies is not None and policies.height:
        figures.append(policy_comparison(policies))
    parts = [fig.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, fig in enumerate(figures)]
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in summary)
    table = ""
    if policies is not None and policies.height:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in policies.columns)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(_cell(v))}</td>" for v in row) + "</tr>" for row in policies.iter_rows()
        )
        table = f"<h2>Policy comparison</h2><table><tr>{head}</tr>{body}</table>"
    doc = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        "<style>body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px}"
        "table{border-collapse:collapse;margin:1em 0}th,td{border:1px solid #ccc;padding:4px 8px;text-align:left}"
        "</style></head><body>"
        f"<h1>{html.escape(title)}</h1><table>{rows}</table>{''.join(parts)}{table}</body></html>"
    )
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(doc, encoding="utf-8")
    return out


REPORT_CAPACITIES = (16, 64, 256, 1024, 4096, 16384, 65536, 262144)  # blocks of each group, for the curves


def report_summary(source: str, observations: Observations, costs: CostReport) -> list[tuple[str, str]]:
    """The report's headline rows: where the events came from, how many, the token-weighted
    hit rates and the seconds lost to the wrong restore choice."""
    events, results = observations.events, observations.results
    totals = funnel(results).row(0, named=True) if results.height else {}
    summary = [("source", source), ("events", f"{events.height:,}"), ("lookups", f"{results.height:,}")]
    summary += [(f"{name} rate", f"{totals[f'{name}_token_rate']:.1%}") for name in
                ("logical", "recoverable", "resident", "adopted") if f"{name}_token_rate" in totals]
    lost = costs.lost()
    if lost.height:
        summary.append(("seconds lost to the wrong restore choice",
                        f"{lost['lost_restoring_s'].sum() + lost['lost_recomputing_s'].sum():.3f}"))
    return summary


def write_analysis_report(
    path: str | Path,
    observations: Observations,
    recipes: RecipeBook | Recipe,
    source: str,
    bucket_ns: int = 60 * 10**9,
    calibrations: pl.DataFrame | None = None,
) -> Path:
    """The HTML report of one event source: funnel over time, gap reasons, load-vs-recompute
    crossovers (with `calibrations` where events carry no timings) and capacity curves."""
    costs = cost_report(observations.events, observations.results, calibrations=calibrations)
    capacity = capacity_report(observations.events, recipes, REPORT_CAPACITIES)
    return write_report(path, "kvtrace report", report_summary(source, observations, costs), observations.results,
                        bucket_ns=bucket_ns, crossovers=costs.crossovers,
                        capacity=[(r.model, r.curve) for r in capacity])


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)
