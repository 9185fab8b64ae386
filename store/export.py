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


class ExportError(ValueError):
    """An output path that cannot take the export; the message names it and why."""


def _target(out: str | os.PathLike[str]) -> tuple[Path, bool]:
    """Where to write, and whether through a partial file renamed over it at the end. Only a
    regular file (or a new one) is ever replaced that way; a symlink is followed to its file,
    so the link stays; a device or a pipe is written in place; a directory is refused."""
    path = Path(out)
    real = path.resolve() if path.is_symlink() else path
    if real.is_dir():
        raise ExportError(f"{path} is a directory: give the export a file name, e.g. {path / 'events.parquet'}")
    if real.exists() and not real.is_file():
        return real, False
    if not real.parent.is_dir():
        try:
            real.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ExportError(f"cannot create {real.parent}: {exc.strerror}") from None
    if not os.access(real.parent, os.W_OK) or (real.exists() and not os.access(real, os.W_OK)):
        raise ExportError(f"cannot write {path}: permission denied")
    return real, True


def export_events(
    store: Store,
    out: str | os.PathLike[str],
    fmt: ExportFormat = ExportFormat.PARQUET,
    flt: EventFilter = EventFilter(),
) -> int:
    """Stream de-duplicated events, in stream order, into one file; returns the row count.
    Raises ExportError for an output path it cannot write."""
    path, replace = _target(out)
    where, params = flt.sql()
    rows = 0
    tmp = path.with_name(path.name + ".partial") if replace else path
    try:
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
    except OSError as exc:
        if replace:
            tmp.unlink(missing_ok=True)
        raise ExportError(f"cannot write {out}: {exc.strerror or exc}") from None
    if replace:
        os.replace(tmp, path)  # readers never see a half-written export
    return rows
