"""Grafana dashboards for the ClickHouse data source plugin, built from the same panel
definitions as the web dashboard (`queries.PANELS`): one SQL per panel, in both places."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvtrace.dashboards.queries import PANELS, VARIABLES, Panel, PanelKind

DATASOURCE = {"type": "grafana-clickhouse-datasource", "uid": "${datasource}"}
_TYPES = {PanelKind.TIMESERIES: "timeseries", PanelKind.BARS: "barchart", PanelKind.TABLE: "table"}


def _panel(panel: Panel, db: str, index: int) -> dict[str, Any]:
    full = panel.kind is PanelKind.TABLE
    return {
        "id": index + 1,
        "type": _TYPES[panel.kind],
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": 9, "w": 24 if full else 12, "x": 0 if full else 12 * (index % 2), "y": 9 * (index // 2)},
        "targets": [{
            "refId": "A",
            "datasource": DATASOURCE,
            "editorType": "sql",
            "queryType": "timeseries" if panel.kind is PanelKind.TIMESERIES else "table",
            "format": 0 if panel.kind is PanelKind.TIMESERIES else 1,
            "rawSql": panel.sql.replace("{db}", db),
        }],
        "options": {"legend": {"showLegend": True}},
        "fieldConfig": {"defaults": {}, "overrides": []},
    }


def dashboard(db: str = "kvtrace") -> dict[str, Any]:
    """The dashboard JSON (importable in Grafana; pick the ClickHouse data source on import)."""
    variables: list[dict[str, Any]] = [{
        "name": "datasource", "type": "datasource", "query": "grafana-clickhouse-datasource", "label": "ClickHouse",
    }]
    for name in VARIABLES:
        variables.append({"name": name, "type": "textbox", "label": name, "query": "",
                          "current": {"text": "", "value": ""},
                          "description": f"only this {name} (empty: all)"})
    return {
        "title": "kvtrace: KV-cache hits, logical vs recoverable vs adopted",
        "uid": "kvtrace-overview",
        "schemaVersion": 39,
        "tags": ["kvtrace"],
        "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": variables},
        "panels": [_panel(p, db, i) for i, p in enumerate(PANELS)],
    }


def write_dashboards(directory: str | Path, db: str = "kvtrace") -> list[Path]:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "kvtrace-overview.json"
    path.write_text(json.dumps(dashboard(db), indent=2) + "\n")
    return [path]
