"""The Grafana dashboard for the ClickHouse data source plugin, built with Grafana's typed
builders (grafana-foundation-sdk) from the same panel definitions as the web dashboard
(`queries.PANELS`, laid out as `queries.PAGES`): one SQL per panel, in both places.

The headline panel becomes one stat panel per tile; each page becomes a row. Units travel in
each panel's fieldConfig; the model, instance, tenant and engine variables list the values the
events hold, with "All" sent as `queries.ALL`, which the filters read as "no filter". Panels are
placed explicitly on the 24-column grid, row by row, so none overlaps another.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import barchart, stat, table, timeseries
from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as builders
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model

from kvtrace.dashboards.queries import ALL, PAGES, VARIABLES, Panel, PanelKind, Unit, by_key

PLUGIN = "grafana-clickhouse-datasource"
DATASOURCE = model.DataSourceRef(type_val=PLUGIN, uid="${datasource}")
GRID_WIDTH = 24

# Grafana's unit ids; a share is a fraction 0..1 ("percentunit" draws 0.25 as 25 %).
UNITS = {Unit.SHARE: "percentunit", Unit.TOKENS: "suffix: tokens", Unit.GIB: "gbytes", Unit.SECONDS: "s",
         Unit.MILLISECONDS: "ms", Unit.MICROSECONDS: "µs", Unit.COUNT: "short"}
_DASHES = ((), (10, 6), (2, 4), (10, 4, 2, 4), (16, 6))  # solid, dash, dot, dash-dot, long dash
_WIDTHS = (4, 3, 2, 2, 2)


class ClickHouseQuery(cogvariants.Dataquery):
    """A raw-SQL target of the ClickHouse plugin (the SDK ships no builder for this plugin)."""

    def __init__(self, ref_id: str, raw_sql: str, timeseries_format: bool) -> None:
        self.ref_id = ref_id
        self.raw_sql = raw_sql
        self.timeseries_format = timeseries_format

    def to_json(self) -> dict[str, object]:
        return {"refId": self.ref_id, "datasource": DATASOURCE.to_json(), "editorType": "sql",
                "queryType": "timeseries" if self.timeseries_format else "table",
                "format": 0 if self.timeseries_format else 1, "rawSql": self.raw_sql}


class ClickHouseQueryBuilder(cogbuilder.Builder[ClickHouseQuery]):
    def __init__(self, ref_id: str, raw_sql: str, timeseries_format: bool) -> None:
        self._query = ClickHouseQuery(ref_id, raw_sql, timeseries_format)

    def build(self) -> ClickHouseQuery:
        return self._query


def _override(name: str, **properties: object) -> tuple[model.MatcherConfig, list[model.DynamicConfigValue]]:
    return (model.MatcherConfig(id_val="byName", options=name),
            [model.DynamicConfigValue(id_val=k, value=v) for k, v in properties.items()])


def _display(panel: Panel, column: str) -> str:
    """The legend name: a human label, with the group's value where the rows are split by one
    (the plugin turns a long result into one series per value, labelled with it)."""
    if not panel.group_by:
        return panel.label(column)
    group = f"${{__field.labels.{panel.group_by}}}"
    return group if len(panel.series) == 1 else f"{panel.label(column)}: {group}"


def _target(panel: Panel, db: str) -> ClickHouseQueryBuilder:
    return ClickHouseQueryBuilder(panel.key, panel.sql.replace("{db}", db), panel.kind is PanelKind.TIMESERIES)


def _common(builder: Any, panel: Panel, db: str, title: str) -> Any:
    return (builder.title(title).description(panel.description).datasource(DATASOURCE)
            .with_target(_target(panel, db)))


def _timeseries(panel: Panel, db: str) -> timeseries.Panel:
    out = _common(timeseries.Panel(), panel, db, panel.title)
    out = (out.unit(UNITS[panel.unit]).axis_label(panel.y_axis()).min(0)
           .show_points(common.VisibilityMode.ALWAYS).point_size(5)
           .legend(common_builders.VizLegendOptions().show_legend(True)
                   .display_mode(common.LegendDisplayMode.LIST).placement(common.LegendPlacement.BOTTOM)))
    for i, column in enumerate(panel.series):
        dash = _DASHES[i % len(_DASHES)]
        style = {"fill": "dash", "dash": list(dash)} if dash else {"fill": "solid"}
        out = out.with_override(*_override(column, displayName=_display(panel, column), **{
            "custom.lineStyle": style, "custom.lineWidth": _WIDTHS[i % len(_WIDTHS)]}))
    return out


def _bars(panel: Panel, db: str) -> barchart.Panel:
    out = _common(barchart.Panel(), panel, db, panel.title)
    keep = [panel.x, *([panel.group_by] if panel.group_by else []), *panel.series]
    out = out.with_transformation(model.DataTransformerConfig(id_val="filterFieldsByName",
                                                              options={"include": {"names": keep}}))
    x = panel.x
    if panel.group_by:  # long rows (x, group, value) to one column per group value
        out = out.with_transformation(model.DataTransformerConfig(id_val="groupingToMatrix", options={
            "rowField": panel.x, "columnField": panel.group_by, "valueField": panel.series[0]}))
        x = f"{panel.x}\\{panel.group_by}"
    out = (out.x_field(x).unit(UNITS[panel.unit]).axis_label(panel.y_axis())
           .show_value(common.VisibilityMode.AUTO)
           .legend(common_builders.VizLegendOptions().show_legend(True)
                   .display_mode(common.LegendDisplayMode.LIST).placement(common.LegendPlacement.BOTTOM)))
    if panel.log_scale:
        out = out.scale_distribution(common_builders.ScaleDistributionConfig()
                                     .type(common.ScaleDistribution.LOG).log(10))
    for column in panel.series:
        if panel.group_by:
            continue
        properties: dict[str, object] = {"displayName": panel.label(column)}
        if column in panel.right_axis:
            properties |= {"unit": UNITS[panel.right_unit], "custom.axisPlacement": "right",
                           "custom.axisLabel": panel.right_y_axis()}
        out = out.with_override(*_override(column, **properties))
    return out


def _table(panel: Panel, db: str) -> table.Panel:
    out = _common(table.Panel(), panel, db, panel.title)
    if panel.zero_is_good:
        out = out.no_value("None: no request adopted more than was recoverable")
    return out


def _stats(panel: Panel, db: str) -> list[stat.Panel]:
    """One stat panel per headline tile, each showing its column of the one-row result."""
    out = []
    for column in panel.series:
        unit = (Unit.SHARE if column.endswith("_rate") else Unit.TOKENS if column == "tokens_lost" else Unit.COUNT)
        tile = (_common(stat.Panel(), panel, db, panel.label(column))
                .unit(UNITS[unit]).decimals(1 if unit is Unit.SHARE else 0).no_value("no verdicts")
                .reduce_options(common_builders.ReduceDataOptions().values(False).calcs(["lastNotNull"])
                                .fields(f"/^{column}$/"))
                .graph_mode(common.BigValueGraphMode.NONE).color_mode(common.BigValueColorMode.VALUE))
        if column == "unsafe_reuses":  # zero is the good answer: say so, in green
            tile = (tile.mappings([model.ValueMap(options={"0": model.ValueMappingResult(text="none", color="green")})])
                    .thresholds(builders.ThresholdsConfig().mode(model.ThresholdsMode.ABSOLUTE).steps([
                        model.Threshold(value=None, color="green"), model.Threshold(value=1, color="red")])))
        else:
            tile = tile.thresholds(builders.ThresholdsConfig().mode(model.ThresholdsMode.ABSOLUTE).steps([
                model.Threshold(value=None, color="text")]))
        out.append(tile)
    return out


def _panel(panel: Panel, db: str) -> Any:
    return {PanelKind.TIMESERIES: _timeseries, PanelKind.BARS: _bars, PanelKind.TABLE: _table}[panel.kind](panel, db)


class _Grid:
    """Left-to-right, top-to-bottom placement on Grafana's 24-column grid."""

    def __init__(self) -> None:
        self.x = self.y = self.line = 0

    def place(self, w: int, h: int) -> model.GridPos:
        if self.x + w > GRID_WIDTH:
            self.newline()
        pos = model.GridPos(h=h, w=w, x=self.x, y=self.y)
        self.x += w
        self.line = max(self.line, h)
        return pos

    def newline(self) -> None:
        self.y += self.line
        self.x = self.line = 0


def _variables(db: str) -> list[Any]:
    out: list[Any] = [builders.DatasourceVariable("datasource").label("ClickHouse").type(PLUGIN)]
    for name in VARIABLES:
        out.append(builders.QueryVariable(name).label(name).datasource(DATASOURCE)
                   .query(f"SELECT DISTINCT {name} FROM {db}.events WHERE {name} != '' ORDER BY {name}")
                   .include_all(True).all_value(ALL)
                   .current(model.VariableOption(selected=True, text="All", value="$__all"))
                   .refresh(model.VariableRefresh.ON_DASHBOARD_LOAD).sort(model.VariableSort.ALPHABETICAL_ASC)
                   .description(f"only this {name} (All: every {name})"))
    return out


def build(db: str = "kvtrace") -> model.Dashboard:
    """The dashboard as the SDK's typed model."""
    board = (builders.Dashboard("kvtrace: KV-cache hits, logical vs recoverable vs adopted")
             .uid("kvtrace-overview").tags(["kvtrace"]).editable().time("now-6h", "now").timezone("utc")
             .timepicker(builders.TimePicker().refresh_intervals(["10s", "30s", "1m", "5m"]))
             .description("Relative ranges here follow Grafana's clock (now); a replayed trace is in its own time: "
                          "pick its absolute range. The web dashboard (`kvtrace dashboard`) shows the same panels.")
             .variables(_variables(db)))
    grid = _Grid()
    for tile, width in zip(_stats(by_key("headline"), db), (4, 4, 4, 4, 4, 4), strict=True):
        board = board.with_panel(tile.grid_pos(grid.place(width, 4)))
    for title, keys in PAGES.values():
        grid.newline()
        board = board.with_row(builders.Row(title).grid_pos(grid.place(GRID_WIDTH, 1)))
        grid.newline()
        for key in keys:
            panel = by_key(key)
            wide = panel.kind is PanelKind.TABLE or len(keys) == 1 or panel.facet
            board = board.with_panel(_panel(panel, db).grid_pos(grid.place(GRID_WIDTH if wide else 12,
                                                                           8 if panel.kind is PanelKind.TABLE else 9)))
    return board.build()


def dashboard(db: str = "kvtrace") -> dict[str, Any]:
    """The dashboard JSON (importable in Grafana; pick the ClickHouse data source on import)."""
    return json.loads(json.dumps(build(db), cls=JSONEncoder))


def write_dashboards(directory: str | Path, db: str = "kvtrace") -> list[Path]:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "kvtrace-overview.json"
    path.write_text(json.dumps(dashboard(db), indent=2) + "\n")
    return [path]
