"""`kvtrace calibrate` measures real prefill and copy costs with torch on this CPU, and cost
models use them where the events carry no timings."""

from __future__ import annotations

import pytest

from kvtrace.analysis.calibrate import ModelShape, calibrate_prefill, calibrate_transfers
from kvtrace.analysis.costs import fit_prefill, fit_transfers
from kvtrace.analysis.planning import empty_events
from kvtrace.cli.main import main
from kvtrace.schema.arrow import to_arrow
from kvtrace.schema.records import CalibrationSample

TINY = ModelShape(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=704)


def test_prefill_on_cpu_grows_with_tokens_and_with_context() -> None:
    """Timings on a shared machine can stall; a run whose extremes come out inverted (a stall,
    not the model) is measured again, up to three times."""
    import math

    import polars as pl

    for _attempt in range(3):
        samples = calibrate_prefill(TINY, "tiny", starts=(0, 2048, 4096), chunks=(32, 128, 256), repeats=5)
        assert len(samples) == 9 and all(s.seconds > 0 and s.device.startswith("cpu") for s in samples)
        at = {(s.start, s.tokens): s.seconds for s in samples}
        (model,) = fit_prefill(empty_events(), min_samples=4,
                               calibrations=pl.from_arrow(to_arrow(samples, CalibrationSample)))
        f = model.fit
        assert all(math.isfinite(c) for c in f.coef)
        # 256 tokens after 4096 cached ones do ~8x the tokens and ~100x the attention of 32 after none
        if at[(4096, 256)] > at[(0, 32)] and f["per_pair_s"] > 0 and model.seconds(4096, 256) > model.seconds(0, 256):
            return
    raise AssertionError(f"prefill timings never grew with tokens and context: {at}, fit {f}")


def test_copies_on_cpu_give_a_bandwidth() -> None:
    import polars as pl

    # Timed on a shared machine: a run where a stall hit the small copies can fit a flat line
    # (infinite bandwidth), so, as for prefill above, one of three runs must come out right.
    seen = []
    for _ in range(3):
        samples = calibrate_transfers("tiny", sizes=(1 << 20, 8 << 20, 32 << 20))
        (t,) = fit_transfers(empty_events(), min_samples=3,
                             calibrations=pl.from_arrow(to_arrow(samples, CalibrationSample)))
        if 0.1e9 < t.bytes_per_s < 1e12:
            return
        seen.append(t.bytes_per_s)
    raise AssertionError(f"copy bandwidth never came out plausible: {seen} bytes/s")


def test_shape_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="kv_heads"):
        ModelShape(heads=6, kv_heads=4)
    with pytest.raises(ValueError, match="layers"):
        ModelShape(layers=0)


def test_calibrate_then_costs_uses_the_calibration(capsys, store) -> None:
    from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
    from kvtrace.instrumentation.simulator import CacheSimulator, SimConfig, SimRequest
    from kvtrace.instrumentation.sinks.store import StoreSink
    from kvtrace.schema.recipes import BUILTIN

    emitter = BatchEmitter(StoreSink(store), BatchConfig(max_queue_size=1 << 18), register_atexit=False)
    sim = CacheSimulator(SimConfig(recipe=BUILTIN["dense"], model="tiny"), emitter)  # no timings in the events
    for i in range(10):
        sim.serve(SimRequest(f"r{i}", list(range(256)) + [i] * 20))
    assert emitter.shutdown()
    code = main(["--dsn", str(store.dsn), "calibrate", "--model", "tiny", "--layers", "2", "--hidden", "256",
                 "--heads", "4", "--kv-heads", "2", "--intermediate", "704", "--starts", "0,512,1024",
                 "--chunks", "32,64,128", "--sizes-mib", "1,2,3,4,6,8,12,16"])
    out = capsys.readouterr().out
    assert code == 0 and "9" in out and "host->device" in out
    assert store.scalar(f"SELECT count() FROM {store.db}.calibrations") == 9 + 8
    code = main(["--dsn", str(store.dsn), "costs", "--recipe", "tiny=dense"])
    out = capsys.readouterr().out
    assert code == 0 and "host->device" in out and "tiny" in out
    assert "ns_per_token_pair" in out and "(none)" not in out.split("crossover")[0]
