"""plotly figure specs (plain JSON) for the web dashboard's panels: titled axes with units,
shares drawn as percents, human legend names, and a distinct dash and marker per series so
that equal lines stay visible (the funnel's adopted line often lies on recoverable)."""

from __future__ import annotations

from typing import Any

import polars as pl

from kvtrace.dashboards.queries import Panel, PanelKind, Unit

_DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
_SYMBOLS = ("circle", "square", "diamond", "triangle-up", "x", "cross")
_WIDTHS = (4, 3, 2.5, 2, 2, 2)  # wider first: a later, thinner line drawn on top leaves the earlier visible


def _axis(title: str, unit: Unit, log: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {"title": {"text": title}, "rangemode": "tozero", "automargin": True}
    if unit is Unit.SHARE:
        spec["tickformat"] = ".0%"
    if log:  # a label per power of ten: plotly's default also labels the 2s and 5s between them
        spec = {**spec, "type": "log", "dtick": 1}
        del spec["rangemode"]
    return spec


def _hover(unit: Unit) -> str:
    return {Unit.SHARE: "%{y:.1%}", Unit.TOKENS: "%{y:,.0f} tokens", Unit.GIB: "%{y:.3~g} GiB",
            Unit.SECONDS: "%{y:.3~g} s", Unit.MILLISECONDS: "%{y:.3~g} ms", Unit.MICROSECONDS: "%{y:.3~g} µs",
            Unit.COUNT: "%{y:,.0f}"}[unit]


def _group_name(panel: Panel, value: object) -> str:
    text = str(value)
    return f"{panel.group_by} {text}" if text.lstrip("-").isdigit() else text


def _x(panel: Panel, part: pl.DataFrame) -> list[str]:
    xs = part[panel.x]
    if panel.x == "time" and xs.dtype.is_integer():  # DateTime arrives as Unix seconds
        xs = pl.from_epoch(xs, time_unit="s")
    labels = dict(panel.labels)
    return [v.isoformat() if hasattr(v, "isoformat") else labels.get(str(v), str(v)).replace(": ", "<br>", 1)
            for v in xs.to_list()]


def figures(panel: Panel, rows: pl.DataFrame) -> list[tuple[str, dict[str, Any]]]:
    """(caption, figure) per chart: one, or one per group value where the panel is faceted."""
    if panel.facet and panel.group_by and rows.height:
        return [(caption, figure(panel, part, caption, height=340))
                for key, part in rows.partition_by(panel.group_by, as_dict=True, maintain_order=True).items()
                for caption in [f"{panel.group_by}: {key[0]}"]]
    return [("", figure(panel, rows))]  # the page's heading titles a single chart


def figure(panel: Panel, rows: pl.DataFrame, title: str = "", height: int = 420) -> dict[str, Any]:
    bars = panel.kind is PanelKind.BARS
    split = panel.group_by and not panel.facet and rows.height
    groups = (rows.partition_by(panel.group_by, as_dict=True, maintain_order=True).items() if split
              else [((None,), rows)])
    traces: list[dict[str, Any]] = []
    for key, part in groups:
        x = _x(panel, part)
        for column in panel.series:
            right = column in panel.right_axis
            unit = panel.right_unit if right else panel.unit
            name = panel.label(column)
            if key[0] is not None:
                name = _group_name(panel, key[0]) if len(panel.series) == 1 else f"{name}: {_group_name(panel, key[0])}"
            i = len(traces)
            trace: dict[str, Any] = {"type": "bar" if bars else "scatter", "name": name, "x": x,
                                     "y": part[column].to_list(),
                                     "hovertemplate": f"{name}<br>%{{x}}: {_hover(unit)}<extra></extra>"}
            if bars:
                trace["texttemplate"] = _hover(unit)
                trace["textposition"] = "outside"
                trace["cliponaxis"] = False
            elif panel.stacked:
                trace["stackgroup"] = "total"
                trace["mode"] = "lines"
            else:
                trace["mode"] = "lines+markers"
                trace["line"] = {"dash": _DASHES[i % len(_DASHES)], "width": _WIDTHS[i % len(_WIDTHS)]}
                trace["marker"] = {"symbol": _SYMBOLS[i % len(_SYMBOLS)], "size": 7}
            if panel.right_axis:
                trace.update({"yaxis": "y2", "offsetgroup": "right"} if right else {"offsetgroup": "left"})
            traces.append(trace)
    layout: dict[str, Any] = {
        "title": {"text": title}, "height": height, "margin": {"l": 70, "r": 70, "t": 50 if title else 30, "b": 70},
        "barmode": "group", "hovermode": "x unified" if not bars else "closest",
        "legend": {"orientation": "h", "y": -0.22},
        "showlegend": bool(split) or len(traces) > 1,  # a split names its group even when there is one
        "xaxis": {"title": {"text": panel.x_title or panel.x}, "automargin": True,
                  **({"type": "category"} if bars else {})},
        "yaxis": _axis(panel.y_axis(), panel.unit, panel.log_scale),
    }
    if panel.right_axis:
        layout["yaxis2"] = {**_axis(panel.right_y_axis(), panel.right_unit),
                            "overlaying": "y", "side": "right"}
    return {"data": traces, "layout": layout}
