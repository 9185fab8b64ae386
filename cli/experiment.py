"""Cache-policy experiments: the same trace, recipe and tier capacities, one run per policy.

Each run replays the trace through the reference simulator and reconstructs every lookup as
the events stream out of the emitter (no store needed), then sums what a policy really bought:
tokens that were both adopted and recoverable, next to the object (hash) hits it raised.

It lives beside the commands because it joins the two sides of the house that may not import
each other: the simulator (`kvtrace.instrumentation`) and the reconstructor (`kvtrace.analysis`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import polars as pl

from kvtrace.analysis.funnel import results_frame
from kvtrace.analysis.reconstruct import Reconstructor
from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.replay import ReplayOptions, replay
from kvtrace.instrumentation.simulator import CacheSimulator, PolicySpec, SimConfig
from kvtrace.instrumentation.sinks.base import OK, ExportResult
from kvtrace.instrumentation.traces import TraceRequest
from kvtrace.schema.kinds import Tier
from kvtrace.schema.verdicts import LookupResult
from kvtrace.schema.wire import Batch


class ReconstructingSink:
    """An emitter sink that reconstructs lookups as batches arrive (events come in order)."""

    def __init__(self, reconstructor: Reconstructor) -> None:
        self.reconstructor = reconstructor
        self.results: list[LookupResult] = []
        self.events = 0

    def export(self, batch: Batch) -> ExportResult:
        feed = self.reconstructor.feed
        for event in batch.events:
            self.results.extend(feed(event))
        self.events += len(batch.events)
        return OK

    def shutdown(self) -> None:
        self.results.extend(self.reconstructor.finish())


def run_policy(
    trace: Sequence[TraceRequest], config: SimConfig, spec: PolicySpec, progress: Callable[[int], None] | None = None
) -> tuple[pl.DataFrame, CacheSimulator]:
    """Per-lookup results of one policy's replay, and the simulator (for its counters)."""
    sink = ReconstructingSink(Reconstructor(config.recipe))
    emitter = BatchEmitter(sink, BatchConfig(max_queue_size=1 << 20, shutdown_timeout_millis=600_000),
                           register_atexit=False)
    sim = CacheSimulator(spec.apply(config), emitter)
    replay(trace, sim, ReplayOptions(tenant="default"), progress=progress)
    emitter.force_flush(timeout_millis=600_000)
    emitter.shutdown()
    if sink.events != sim.events:
        raise RuntimeError(f"policy {spec.name}: {sim.events - sink.events} events lost between simulator and analysis")
    return results_frame(sink.results), sim


def summarize(name: str, frame: pl.DataFrame, sim: CacheSimulator) -> dict[str, object]:
    prompt = max(int(frame["prompt_tokens"].sum()), 1)
    logical = int(frame["logical_hit_tokens"].sum())
    recoverable = int(frame["recoverable_hit_tokens"].sum())
    useful = int(frame.select(pl.min_horizontal("adopted_tokens", "recoverable_hit_tokens")).to_series().sum())
    restore = sum(int(frame[f"restore_{t}_bytes"].sum()) for t in ("host", "disk", "remote"))
    return {
        "policy": name,
        "requests": frame.height,
        "object_hit_rate": logical / prompt,
        "recoverable_rate": recoverable / prompt,
        "recoverable_tokens": recoverable,
        "adopted_recoverable_tokens": useful,
        "coverage": recoverable / logical if logical else 0.0,  # share of hash hits that are complete
        "recompute_tokens": int(frame["recomputed_tokens"].sum()),
        "device_write_bytes": sim.bytes_written[Tier.DEVICE],
        "host_write_bytes": sim.bytes_written[Tier.HOST],
        "disk_write_bytes": sim.bytes_written[Tier.DISK],
        "restore_bytes": restore,
        "unsafe_reuse": int(frame["unsafe_reuse"].sum()),
    }


def compare(
    trace: Sequence[TraceRequest], config: SimConfig, specs: Sequence[PolicySpec],
    progress: Callable[[str, int], None] | None = None,
) -> pl.DataFrame:
    """One summary row per policy, in the order given; the first is the baseline for `notes`."""
    rows = []
    for spec in specs:
        frame, sim = run_policy(trace, config, spec, (lambda n, s=spec: progress(s.name, n)) if progress else None)
        rows.append(summarize(spec.name, frame, sim))
    table = pl.DataFrame(rows)
    return table.with_columns(pl.Series("note", [_note(row, rows[0]) for row in rows]))


def _note(row: dict[str, object], base: dict[str, object]) -> str:
    """How a policy moved object hits and recoverable tokens against the first one, in points
    of prompt tokens, and in plain words when it loses recoverable tokens: a policy can raise
    hash hits while the state behind them is incomplete, which is the trap this table is for."""
    if row is base:
        return "baseline"
    d_obj = 100 * (float(row["object_hit_rate"]) - float(base["object_hit_rate"]))  # type: ignore[arg-type]
    d_rec = 100 * (float(row["recoverable_rate"]) - float(base["recoverable_rate"]))  # type: ignore[arg-type]
    lost = int(base["recoverable_tokens"]) - int(row["recoverable_tokens"])  # type: ignore[call-overload]
    text = f"vs {base['policy']}: object hits {d_obj:+.2f} pt, recoverable {d_rec:+.2f} pt"
    if lost > 0 and d_rec < -0.005:
        text += f": LOSES {lost} recoverable tokens"
        if d_obj > 0.005:
            text += " despite more object hits"
    elif d_obj > 0.005 and d_rec <= 0.005:
        text += ": more object hits, no more recoverable tokens"
    elif lost < 0 and d_rec > 0.005:
        text += f": gains {-lost} recoverable tokens"
    return text


_SHORT = {
    "object_hit_rate": "obj hit %",
    "recoverable_rate": "recov %",
    "coverage": "cover %",
    "adopted_recoverable_tokens": "reused ok tok",
    "recompute_tokens": "recompute tok",
    "device_write_bytes": "dev wr GiB",
    "host_write_bytes": "host wr GiB",
    "disk_write_bytes": "disk wr GiB",
    "restore_bytes": "restore GiB",
    "unsafe_reuse": "unsafe",
}


def display(table: pl.DataFrame) -> pl.DataFrame:
    """The policy table for a terminal: rates in %, bytes in GiB, short headers."""
    cols = []
    for name, short in _SHORT.items():
        col = pl.col(name)
        if name.endswith("_rate") or name == "coverage":
            col = (col * 100).round(1)
        elif name.endswith("_bytes"):
            col = (col / 2**30).round(2)
        cols.append(col.alias(short))
    return table.select("policy", *cols)
