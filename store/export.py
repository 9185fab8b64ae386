"""Writes stored events out for offline work: Parquet (for DuckDB, polars) or JSONL."""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import msgspec
import pyarrow.parquet as pq

from kvtrace.schema.arrow import arrow_schema, from_arrow
from kvtrace.store.client import Store


class ExportFormat(StrEnum):
    PARQUET = "parquet"
    JSONL = "jsonl"


@dataclass(frozen=True, slots=True)
class EventFilter:
    """Which events to export; empty means no restriction."""

    since_ns: int = 0
    until_ns: int = 0
    instance: str = ""
    model: str = ""
    tenant: str = ""

    def sql(self) -> tuple[str, dict[str, object]]:
        clauses, params = ["1"], {}
        if self.since_ns:
            clauses.append("ts_ns >= {since:Int64}")
            params["since"] = self.since_ns
        if self.until_ns:
            clauses.append("ts_ns < {until:Int64}")
            params["until"] = self.until_ns
        for name in ("instance", "model", "tenant"):
            if value := getattr(self, name):
                clauses.append(f"{name} = {{{name}:String}}")
                params[name] = value
        return " AND ".join(clauses), params


def export_events(
    store: Store,
    out: str | os.PathLike[str],
    fmt: ExportFormat = ExportFormat.PARQUET,
    flt: EventFilter = EventFilter(),
) -> int:
    """Stream de-duplicated events, in stream order, into one file; returns the row count."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    where, params = flt.sql()
    rows = 0
    tmp = path.with_name(path.name + ".partial")
    if fmt is ExportFormat.PARQUET:
        with pq.ParquetWriter(tmp, arrow_schema(), compression="zstd") as writer:
            for table in store.iter_event_batches(where, params):
                writer.write_table(table)
                rows += table.num_rows
            if rows == 0:
                writer.write_table(arrow_schema().empty_table())
    else:
        encoder = msgspec.json.Encoder()
        with open(tmp, "wb") as f:
            for table in store.iter_event_batches(where, params):
                for event in from_arrow(table):
                    f.write(encoder.encode(event) + b"\n")
                rows += table.num_rows
    os.replace(tmp, path)  # readers never see a half-written export
    return rows
