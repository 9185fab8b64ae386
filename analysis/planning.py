"""The money questions, from one event source (the store or Parquet files): what loading and
recomputing cost and which the fleet should have done, and how much capacity each group needs."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from kvtrace.analysis.capacity import CapacityNeed, capacity_curve, capacity_needed, request_distances
from kvtrace.analysis.costs import (
    PrefillModel,
    TransferModel,
    crossover_curve,
    fit_prefill,
    fit_transfers,
    regret_by_pair,
    restore_decisions,
    routing_regret_seconds,
    waiting_seconds,
)
from kvtrace.schema.arrow import arrow_schema, conform, from_arrow, to_arrow
from kvtrace.schema.clickhouse import CALIBRATIONS
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import EventKind
from kvtrace.schema.recipes import Recipe, RecipeBook, recipe_from_json
from kvtrace.schema.records import CalibrationSample
from kvtrace.store.client import Store

ORDER = ["ts_ns", "source_id", "seq"]


def as_parquet(paths: Sequence[str | Path], workdir: str | Path) -> list[Path]:
    """The inputs as Parquet files: Parquet as given, JSONL and spool files converted (their
    valid rows) into `workdir`, so offline analysis takes what `kvtrace ingest` takes."""
    from kvtrace.store.ingest import FileFormat, detect_format, iter_file_events

    out = []
    for i, path in enumerate(map(Path, paths)):
        if not path.is_file():
            raise ValueError(f"{path}: no such file")
        if detect_format(path) is FileFormat.PARQUET:
            out.append(path)
            continue
        target = Path(workdir) / f"{i:04d}-{path.name}.parquet"
        pq.write_table(to_arrow(list(iter_file_events(path))), target)
        out.append(target)
    return out


def event_frame(store: Store | None = None, parquet: Sequence[str | Path] = ()) -> pl.DataFrame:
    """Every event in stream order, as one frame (Parquet files win over the store when given)."""
    if parquet:
        tables = [conform(pq.read_table(p)) for p in parquet]
        frame = pl.from_arrow(pa.concat_tables(tables))
    elif store is not None:
        frame = store.query_polars(store.events_sql())
    else:
        raise ValueError("give a store or Parquet files")
    assert isinstance(frame, pl.DataFrame)
    return frame.sort(ORDER)


def read_events(store: Store | None = None, files: Sequence[str | Path] = ()) -> pl.DataFrame:
    """Every event of the event files (Parquet, JSONL or spool, as `kvtrace ingest` takes them)
    when any are given, else of the store, in stream order."""
    if files:
        with tempfile.TemporaryDirectory(prefix="kvtrace-") as tmp:
            return event_frame(parquet=as_parquet(files, tmp))
    return event_frame(store=store)


def stored_calibrations(store: Store) -> pl.DataFrame | None:
    """The timings `kvtrace calibrate` stored (None when the store has no tables or no timings)."""
    if store.stored_schema_version() is None:
        return None
    frame = store.query_polars(f"SELECT * FROM {store.db}.{CALIBRATIONS.name}")
    return frame if frame.height else None


def empty_events() -> pl.DataFrame:
    frame = pl.from_arrow(arrow_schema().empty_table())
    assert isinstance(frame, pl.DataFrame)
    return frame


def iter_events(frame: pl.DataFrame, batch_rows: int = 65536) -> Iterator[Event]:
    for start in range(0, frame.height, batch_rows):
        yield from from_arrow(frame.slice(start, batch_rows).to_arrow())


def bytes_per_token(events: pl.DataFrame) -> dict[str, float]:
    """What restoring one token moves, per model: over its groups, a committed block's typical
    size over the group's block size."""
    commits = events.filter((pl.col("kind") == "commit") & (pl.col("nbytes") > 0) & (pl.col("block_size") > 0))
    per_group = commits.group_by("model", "group_id").agg(
        (pl.col("nbytes") / pl.col("block_size")).median().alias("bpt"))
    return {str(m): float(v) for m, v in per_group.group_by("model").agg(pl.col("bpt").sum()).iter_rows()}


@dataclass(frozen=True, slots=True)
class CostReport:
    transfers: list[TransferModel]
    prefills: list[PrefillModel]
    crossovers: pl.DataFrame
    decisions: pl.DataFrame
    waiting: pl.DataFrame
    regret: pl.DataFrame  # routing regret in seconds, per lookup (results with the fleet view)

    def transfer_table(self) -> pl.DataFrame:
        rows = []
        for t in self.transfers:
            lo, hi = t.fit.ci95("latency_s")
            blo, bhi = t.bandwidth_ci95()
            rows.append({"model": t.model, "path": f"{t.src.value}->{t.dst.value}", "samples": t.fit.n,
                         "latency_ms": t.latency_s * 1e3, "latency_ms_ci95": f"{lo * 1e3:.3f}..{hi * 1e3:.3f}",
                         "GB_per_s": t.bytes_per_s / 1e9, "GB_per_s_ci95": f"{blo / 1e9:.3f}..{bhi / 1e9:.3f}"})
        return pl.DataFrame(rows)

    def prefill_table(self) -> pl.DataFrame:
        rows = []
        for p in self.prefills:
            f = p.fit
            lo, hi = f.ci95("per_pair_s")
            rows.append({"model": p.model, "samples": f.n, "fixed_ms": f["fixed_s"] * 1e3,
                         "us_per_token": f["per_token_s"] * 1e6, "ns_per_token_pair": f["per_pair_s"] * 1e9,
                         "ns_per_pair_ci95": f"{lo * 1e9:.3f}..{hi * 1e9:.3f}", "r2": f.r2})
        return pl.DataFrame(rows)

    def lost(self) -> pl.DataFrame:
        """Seconds the fleet lost, per model: restoring what was cheaper to recompute, and the reverse."""
        d = self.decisions
        return d.group_by("model").agg(
            pl.len().alias("lookups_with_a_choice"),
            pl.col("restore_cheaper").sum().alias("restore_was_cheaper"),
            pl.col("lost_s").filter(pl.col("restored")).sum().alias("lost_restoring_s"),
            pl.col("lost_s").filter(~pl.col("restored")).sum().alias("lost_recomputing_s"),
        ).sort("model")

    def regret_by_pair(self) -> pl.DataFrame:
        return regret_by_pair(self.regret)


def cost_report(events: pl.DataFrame, results: pl.DataFrame, starts: Sequence[int] = (0, 1024, 8192, 32768),
                calibrations: pl.DataFrame | None = None) -> CostReport:
    transfers = fit_transfers(events, calibrations=calibrations)
    prefills = fit_prefill(events, calibrations=calibrations)
    return CostReport(transfers, prefills, crossover_curve(transfers, prefills, bytes_per_token(events), starts),
                      restore_decisions(results, transfers, prefills), waiting_seconds(events),
                      routing_regret_seconds(results, transfers, prefills))


def calibration_report(samples: Sequence[CalibrationSample]) -> CostReport:
    """The cost models fitted to a calibration's timings alone, with no events: transfers and
    prefill only (no crossovers or decisions: those need lookups)."""
    measured = pl.from_arrow(to_arrow(samples, CalibrationSample))
    assert isinstance(measured, pl.DataFrame)
    none = empty_events()
    return CostReport(fit_transfers(none, min_samples=3, calibrations=measured),
                      fit_prefill(none, min_samples=4, calibrations=measured),
                      pl.DataFrame(), pl.DataFrame(), pl.DataFrame(), pl.DataFrame())


@dataclass(frozen=True, slots=True)
class CapacityReport:
    model: str  # the recipe's key: MODEL, or ENGINE:MODEL where the engine's lookups had their own recipe
    curve: pl.DataFrame
    needs: list[CapacityNeed]
    block_bytes: dict[int, float]  # group -> bytes per block


def capacity_report(events: pl.DataFrame, recipes: RecipeBook | Recipe | None = None,
                    capacities: Sequence[int] = (), requests: float = 0.99,
                    prefix: float = 0.99) -> list[CapacityReport]:
    """A curve per model and recipe: the lookups of one model share a cache, unless an engine
    has a recipe of its own for the model (an engine and the KV store behind it). With no recipe
    given, each engine's own (from its attach events); models with neither are left out."""
    book = book_for(events, recipes)
    members: dict[tuple[str, Recipe], list[str]] = {}  # (label, recipe) -> "source\x00engine\x00model"
    for src, engine, model in events.select("source_id", "engine", "model").unique(maintain_order=True).iter_rows():
        recipe = book.get(str(model), str(engine), int(src))
        if recipe is not None:  # named by the key, without the publishing process
            label = book.key(str(model), str(engine), int(src)).partition("@")[0]
            members.setdefault((label, recipe), []).append(f"{src}\x00{engine}\x00{model}")
    source = pl.concat_str(pl.col("source_id").cast(pl.Utf8), "engine", "model", separator="\x00")
    out = []
    for (label, recipe), triples in members.items():
        part = events.filter(source.is_in(triples))
        if not part.filter(pl.col("kind") == "lookup").height:
            continue
        distances = request_distances(iter_events(part.sort(ORDER)), recipe)
        commits = part.filter((pl.col("kind") == "commit") & (pl.col("nbytes") > 0))
        block_bytes = {int(g): float(v) for g, v in
                       commits.group_by("group_id").agg(pl.col("nbytes").median()).iter_rows()}
        out.append(CapacityReport(label, capacity_curve(distances, recipe, capacities),
                                  capacity_needed(distances, recipe, requests, prefix), block_bytes))
    return out


def book_for(events: pl.DataFrame, recipes: RecipeBook | Recipe | None = None) -> RecipeBook:
    """The book the events are judged by: the one given, with each engine's own recipe from its
    attach events; a given recipe the events contradict is refused (`RecipeMismatch`), as the
    streaming and SQL paths refuse it."""
    book = RecipeBook.of(recipes)
    attach = events.filter(pl.col("kind") == EventKind.ATTACH.value).sort(ORDER)
    for src, engine, model, instance, text in attach.select("source_id", "engine", "model", "instance",
                                                           "recipe").iter_rows():
        book = book.publish(int(src), str(engine), str(model), recipe_from_json(text), str(instance))
    if book.scoped or book.default is not None:
        blocks = 1 + pl.col("more_keys").list.len()
        spans = (events.filter(pl.col("kind") == EventKind.COMMIT.value)
                 .group_by("engine", "model", "group_id")
                 .agg(((pl.col("token_end") - pl.col("token_start")) // blocks).max().alias("span"),
                      pl.len().alias("n"))
                 .sort("engine", "model", "group_id"))
        for engine, model, group_id, span, n in spans.iter_rows():
            book.check_commits(str(engine), str(model), int(group_id), int(span), int(n))
    return book
