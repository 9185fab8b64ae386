"""Which of kvtrace's extras brings a missing module, so a command run without it says how to get
it in one line instead of ending in an ImportError traceback."""

from __future__ import annotations

# Top-level module -> the smallest extra that installs it (see pyproject.toml).
EXTRA_OF = {
    "opentelemetry": "otlp",
    "pyarrow": "arrow",
    "numpy": "arrow",
    "clickhouse_connect": "store",
    "chdb": "store",
    "polars": "store",
    "duckdb": "analysis",
    "fastapi": "collector",
    "starlette": "collector",
    "pydantic": "collector",
    "uvicorn": "collector",
    "prometheus_client": "collector",
    "grafana_foundation_sdk": "dashboards",
    "google": "collector",
    "zmq": "collector",
    "plotly": "dashboards",
    "yaml": "dashboards",
    "torch": "torch",
}


def missing_extra(exc: ModuleNotFoundError, needs: str = "") -> str | None:
    """The line to print for a module one of kvtrace's extras provides; None for any other.

    `needs` is the extra the command declares (every command does, when it registers): naming
    it, rather than the extra of the first module found missing, sends the user to the install
    that makes the whole command work, not to the next missing module."""
    top = (exc.name or "").split(".")[0]
    if top not in EXTRA_OF:
        return None
    extra = needs or EXTRA_OF[top]
    return f"this command needs kvtrace's {extra!r} extra (no module {top!r} here): pip install 'kvtrace[{extra}]'"
