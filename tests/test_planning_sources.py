"""Where the cost and capacity questions read from (the store or event files, stored
calibrations), the cost models of a calibration alone, and the report built on them."""

from __future__ import annotations

from pathlib import Path

import pytest
from polars.testing import assert_frame_equal

from kvtrace.analysis.funnel import funnel
from kvtrace.analysis.planning import calibration_report, cost_report, read_events, stored_calibrations
from kvtrace.analysis.run import read_observations
from kvtrace.dashboards.report import report_summary, write_analysis_report
from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.simulator import CacheSimulator, SimConfig, SimRequest
from kvtrace.instrumentation.sinks.spool import SpoolSink
from kvtrace.instrumentation.sinks.store import StoreSink
from kvtrace.schema.recipes import BUILTIN, RecipeBook
from kvtrace.schema.records import CalibrationSample
from kvtrace.store.client import Store
from kvtrace.store.export import export_events

RUN = "r1"


def timed_workload(sink: object) -> None:
    """Dense lookups with reported load and prefill timings: host loads at 10 GB/s."""
    emitter = BatchEmitter(sink, BatchConfig(max_queue_size=1 << 18), register_atexit=False)  # type: ignore[arg-type]
    sim = CacheSimulator(SimConfig(recipe=BUILTIN["dense"], model="llama", capacity_bytes=(4 << 20, 64 << 20, 0),
                                   load_latency_ns=(50_000, 0), load_bytes_per_s=(10e9, 1e9),
                                   prefill_ns_per_token=40_000, prefill_ns_per_token_pair=4), emitter)
    docs = [[d * 10_000 + i for i in range(256 * (1 + d % 4))] for d in range(8)]
    for i in range(60):
        doc = docs[(i * 5) % len(docs)]
        sim.serve(SimRequest(f"r{i}", doc[: len(doc) - (i % 7) * 16] + [i] * (1 + i % 50)))
    assert emitter.shutdown()


def test_events_read_alike_from_the_store_its_export_and_a_spool(store: Store, tmp_path: Path) -> None:
    timed_workload(StoreSink(store))
    timed_workload(SpoolSink(str(tmp_path / "spool")))  # the same workload again, into files
    stored = read_events(store=store)
    assert stored.height == store.count_events() > 0
    export_events(store, tmp_path / "e.parquet")
    assert_frame_equal(read_events(files=[tmp_path / "e.parquet"]), stored, check_exact=True)
    spooled = read_events(files=sorted((tmp_path / "spool").iterdir()))
    assert spooled.height == stored.height  # the other run: its own source id and clock
    assert spooled["kind"].to_list() == stored["kind"].to_list()
    with pytest.raises(ValueError, match="no such file"):
        read_events(files=[tmp_path / "missing.parquet"])


def _samples() -> list[CalibrationSample]:
    """Copies at 50 us + 8 GB/s, prefill at 2 ms + 30 us a token + 5 ns a token pair: exactly."""
    out = [CalibrationSample(ts_ns=1, run_id=RUN, device="cpu: test", model="tiny", kind="transfer", src_tier="host",
                             dst_tier="device", nbytes=m << 20, seconds=50e-6 + (m << 20) / 8e9)
           for m in (1, 2, 3, 4, 6, 8, 12, 16)]
    for start in (0, 512, 2048):
        for n in (64, 256, 512):
            out.append(CalibrationSample(ts_ns=1, run_id=RUN, device="cpu: test", model="tiny", kind="prefill",
                                         start=start, tokens=n, seconds=2e-3 + 30e-6 * n + 5e-9 * n * (start + n / 2)))
    return out


def test_a_calibration_alone_fits_the_costs_it_measured() -> None:
    report = calibration_report(_samples())
    (transfer,) = report.transfers
    assert (transfer.src.value, transfer.dst.value) == ("host", "device")
    assert transfer.bytes_per_s == pytest.approx(8e9, rel=1e-6)
    assert transfer.latency_s == pytest.approx(50e-6, rel=1e-6)
    (prefill,) = report.prefills
    assert prefill.fit["per_token_s"] == pytest.approx(30e-6, rel=1e-6)
    assert prefill.fit["per_pair_s"] == pytest.approx(5e-9, rel=1e-6)
    assert report.transfer_table()["GB_per_s"].to_list() == pytest.approx([8.0])
    assert report.prefill_table()["samples"].to_list() == [9]
    assert report.decisions.height == report.crossovers.height == 0


def test_calibrations_are_read_back_from_the_store(store: Store, store_dsn: str) -> None:
    with Store(store_dsn.replace("database=", "database=none_")) as fresh:
        assert stored_calibrations(fresh) is None  # no tables yet
    assert stored_calibrations(store) is None  # tables, but nothing calibrated
    assert store.insert_calibrations(_samples()) == 17
    frame = stored_calibrations(store)
    assert frame is not None and frame.height == 17 and set(frame["run_id"]) == {RUN}
    # With no timed events, the calibrated costs are the models.
    costs = cost_report(read_events(store=store), read_observations(BUILTIN["dense"], store=store).results,
                        calibrations=frame)
    assert [t.bytes_per_s for t in costs.transfers] == pytest.approx([8e9], rel=1e-6)


def test_a_real_calibration_on_this_cpu() -> None:
    pytest.importorskip("torch")
    from kvtrace.analysis.calibrate import ModelShape, calibrate

    run = calibrate(ModelShape(layers=1, hidden=128, heads=2, kv_heads=1, head_dim=64, intermediate=256), "tiny",
                    starts=(0, 256), chunks=(16, 32), sizes=(1 << 20, 2 << 20), repeats=1)
    assert len(run.samples) == 2 * 2 + 2 and run.device.startswith("cpu")
    assert {s.run_id for s in run.samples} == {run.run_id}
    assert [s.kind for s in run.samples] == ["prefill"] * 4 + ["transfer"] * 2
    assert all(s.seconds > 0 for s in run.samples)


def test_the_report_summarizes_what_the_analysis_found(store: Store, tmp_path: Path) -> None:
    timed_workload(StoreSink(store))
    book = RecipeBook.parse(["llama=dense"])
    observed = read_observations(book, store=store)
    costs = cost_report(observed.events, observed.results)
    rows = dict(report_summary("the store", observed, costs))
    assert rows["source"] == "the store"
    assert rows["events"] == f"{store.count_events():,}" and rows["lookups"] == "60"
    rates = funnel(observed.results).row(0, named=True)
    for name in ("logical", "recoverable", "resident", "adopted"):
        assert rows[f"{name} rate"] == f"{rates[f'{name}_token_rate']:.1%}"
    lost = costs.lost()
    assert rows["seconds lost to the wrong restore choice"] == \
        f"{lost['lost_restoring_s'].sum() + lost['lost_recomputing_s'].sum():.3f}"

    path = write_analysis_report(tmp_path / "r" / "report.html", observed, book, "the store")
    text = path.read_text()
    for title in ("Hit funnel over time", "Load vs recompute", "against each group's capacity", "the store"):
        assert title in text, title
