"""Cost models fitted from events recover the simulator's known costs, and the crossover lands
where those costs put it."""

from __future__ import annotations

import random

import numpy as np
import polars as pl
import pytest

from kvtrace.analysis.costs import (
    FitError,
    LinearFit,
    PrefillModel,
    TransferModel,
    crossover_curve,
    crossover_tokens,
    fit_prefill,
    fit_transfers,
    least_squares,
    restore_decisions,
    waiting_seconds,
)
from kvtrace.analysis.funnel import results_frame
from kvtrace.analysis.reconstruct import reconstruct
from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.simulator import CacheSimulator, SimConfig, SimRequest
from kvtrace.instrumentation.sinks.memory import MemorySink
from kvtrace.schema.arrow import to_arrow
from kvtrace.schema.kinds import Tier
from kvtrace.schema.recipes import BUILTIN
from kvtrace.schema.verdicts import LookupResult

BYTES_PER_TOKEN = 2048
HOST_LATENCY_S, HOST_BW = 50e-6, 10e9
DISK_LATENCY_S, DISK_BW = 400e-6, 1e9
PER_TOKEN_S, PER_PAIR_S = 40e-6, 4e-9


def simulate(noise: float = 0.05, requests: int = 400) -> tuple[CacheSimulator, list]:
    rng = random.Random(7)
    docs = [[d * 100_000 + i for i in range(rng.choice([256, 512, 1024, 2048, 4096]))] for d in range(30)]
    config = SimConfig(recipe=BUILTIN["dense"], model="m", bytes_per_token=BYTES_PER_TOKEN,
                       capacity_bytes=(24 << 20, 96 << 20, 1 << 30),
                       load_latency_ns=(int(HOST_LATENCY_S * 1e9), int(DISK_LATENCY_S * 1e9)),
                       load_bytes_per_s=(HOST_BW, DISK_BW), prefill_ns_per_token=PER_TOKEN_S * 1e9,
                       prefill_ns_per_token_pair=PER_PAIR_S * 1e9, timing_noise=noise)
    sink = MemorySink()
    emitter = BatchEmitter(sink, BatchConfig(max_queue_size=1 << 21, max_export_batch_size=1 << 14),
                           register_atexit=False)
    sim = CacheSimulator(config, emitter)
    for i in range(requests):
        doc = rng.choice(docs)
        sim.serve(SimRequest(f"r{i}", doc[: rng.randint(len(doc) // 2, len(doc))] + [i] * rng.randint(1, 300)))
    assert emitter.shutdown() and not emitter.stats().dropped
    return sim, sink.events


@pytest.fixture(scope="module")
def simulated() -> tuple[CacheSimulator, pl.DataFrame, list[LookupResult]]:
    sim, events = simulate()
    return sim, pl.from_arrow(to_arrow(events)), list(reconstruct(events, BUILTIN["dense"]))


def close(got: float, want: float, rel: float) -> bool:
    return abs(got - want) <= rel * abs(want)


def test_least_squares_recovers_a_line_and_says_when_it_cannot() -> None:
    x = np.column_stack([np.ones(50), np.arange(50.0)])
    fit = least_squares(x, 3 + 2 * np.arange(50.0), ("a", "b"))
    assert close(fit["a"], 3, 1e-9) and close(fit["b"], 2, 1e-9) and fit.r2 == pytest.approx(1.0)
    with pytest.raises(FitError, match="do not vary"):
        least_squares(np.ones((10, 2)), np.ones(10), ("a", "b"))
    with pytest.raises(FitError, match="2 samples cannot fit 2"):
        least_squares(x[:2], np.ones(2), ("a", "b"))


def test_transfer_fits_recover_the_simulated_latency_and_bandwidth(simulated) -> None:
    _, events, _ = simulated
    fits = {(t.src, t.dst): t for t in fit_transfers(events)}
    host, disk = fits[(Tier.HOST, Tier.DEVICE)], fits[(Tier.DISK, Tier.DEVICE)]
    assert close(host.bytes_per_s, HOST_BW, 0.05) and close(disk.bytes_per_s, DISK_BW, 0.05)
    assert close(host.latency_s, HOST_LATENCY_S, 0.2) and close(disk.latency_s, DISK_LATENCY_S, 0.2)
    lo, hi = disk.bandwidth_ci95()
    assert lo < disk.bytes_per_s < hi and lo < DISK_BW * 1.05 and hi > DISK_BW * 0.95
    assert host.fit.n >= 8 and disk.fit.n >= 8


def test_prefill_fit_recovers_per_token_and_attention_costs(simulated) -> None:
    _, events, _ = simulated
    (prefill,) = fit_prefill(events)
    assert close(prefill.fit["per_token_s"], PER_TOKEN_S, 0.1)
    assert close(prefill.fit["per_pair_s"], PER_PAIR_S, 0.1)
    lo, hi = prefill.fit.ci95("per_pair_s")
    assert lo <= prefill.fit["per_pair_s"] <= hi


def known(src: Tier) -> tuple[TransferModel, PrefillModel]:
    latency, bw = (HOST_LATENCY_S, HOST_BW) if src is Tier.HOST else (DISK_LATENCY_S, DISK_BW)
    t = TransferModel("m", src, Tier.DEVICE, LinearFit(("latency_s", "s_per_byte"), (latency, 1 / bw), (0, 0), 99, 1))
    p = PrefillModel("m", LinearFit(("fixed_s", "per_token_s", "per_pair_s"), (0, PER_TOKEN_S, PER_PAIR_S),
                                    (0, 0, 0), 99, 1))
    return t, p


def test_crossover_is_where_the_known_costs_put_it(simulated) -> None:
    _, events, _ = simulated
    fitted_t = {t.src: t for t in fit_transfers(events)}
    (fitted_p,) = fit_prefill(events)
    for src in (Tier.HOST, Tier.DISK):
        t, p = known(src)
        for start in (0, 1024, 8192):
            n = crossover_tokens(t, p, BYTES_PER_TOKEN, start)
            assert n is not None
            # the definition: loading n tokens beats recomputing them, n - 1 does not
            assert t.seconds(n * BYTES_PER_TOKEN) < p.seconds(start, n)
            assert n == 1 or t.seconds((n - 1) * BYTES_PER_TOKEN) >= p.seconds(start, n - 1)
            got = crossover_tokens(fitted_t[src], fitted_p, BYTES_PER_TOKEN, start)
            assert got is not None and abs(got - n) <= max(2, 0.15 * n), (src, start, got, n)
    curve = crossover_curve(fitted_t.values(), [fitted_p], {"m": BYTES_PER_TOKEN}, [0, 4096])
    assert curve.height == 4 and curve["crossover_tokens"].null_count() == 0
    # deeper in the context recomputing costs more, so restoring pays off sooner
    host = curve.filter(pl.col("src_tier") == "host").sort("start")["crossover_tokens"].to_list()
    assert host[1] <= host[0]


def test_restore_decisions_price_each_partial_lookup(simulated) -> None:
    _, events, results = simulated
    decisions = restore_decisions(results_frame(results), fit_transfers(events), fit_prefill(events))
    assert decisions.height > 0
    assert (decisions["span_tokens"] > 0).all() and (decisions["lost_s"] >= 0).all()
    # the simulator restores everything recoverable: a lost second is a restore slower than recompute
    assert decisions["restored"].all()
    wrong = decisions.filter(~pl.col("restore_cheaper"))
    assert (wrong["lost_s"] == wrong["restore_s"] - wrong["recompute_s"]).all()
    assert (decisions.filter(pl.col("restore_cheaper"))["lost_s"] == 0).all()
    assert waiting_seconds(events).height == 0  # the simulator's loads never wait in flight


def test_a_prefill_fit_never_prices_a_span_below_zero():
    """Timings that a straight least-squares fit reads as a negative per-pair cost (noise on a
    loaded machine) give a fit with that coefficient at 0, never negative seconds."""
    rng = np.random.default_rng(3)
    n = np.array([32, 64, 128, 256] * 6, dtype=float)
    s = np.repeat([0.0, 128.0, 256.0, 0.0, 128.0, 256.0], 4)
    pair = n * (s + n / 2)
    y = 0.001 + 2e-5 * n - 4e-9 * pair + rng.normal(0, 1e-5, n.size)
    x = np.column_stack([np.ones(n.size), n, pair])
    names = ("fixed_s", "per_token_s", "per_pair_s")
    assert least_squares(x, y, names)["per_pair_s"] < 0  # what a plain fit makes of it
    fit = least_squares(x, y, names, nonnegative=True)
    assert min(fit.coef) >= 0 and fit["per_pair_s"] == 0 and fit["per_token_s"] > 0
    model = PrefillModel("m", fit)
    assert all(model.seconds(start, tokens) > 0 for start in (0, 4096) for tokens in (1, 32, 100_000))
    # The best non-negative fit: no other choice of the free coefficients leaves less residual.
    free = least_squares(x[:, :2], y, names[:2])
    assert fit["fixed_s"] == pytest.approx(free["fixed_s"]) and fit["per_token_s"] == pytest.approx(free["per_token_s"])
