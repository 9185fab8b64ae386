"""Load-vs-recompute: cost models fitted from the events, their crossover, and what the fleet lost.

Two models, each an ordinary least-squares fit with 95 % confidence intervals:
- a transfer (`load` events, per model and tier path): seconds = latency + bytes / bandwidth;
- a prefill (`adopt` events that report the time spent recomputing, per model): computing
  tokens [s, s + n) costs fixed + per_token * n + per_pair * n * (s + n / 2), the last term
  because attention reads every earlier token, so the same n tokens cost more deeper in the
  context.

Restoring n tokens that start at position s beats recomputing them once
load(n * bytes_per_token) < prefill(s, n); the crossover is the smallest such n. Applied to each
lookup, the models say whether restoring what was recoverable but not resident was worth it, and
how many seconds were lost by doing the other thing.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import polars as pl

from kvtrace.schema.kinds import Tier

Z95 = 1.959963984540054


class FitError(ValueError):
    """Too few or too uniform samples to fit a model; the message says which."""


@dataclass(frozen=True, slots=True)
class LinearFit:
    """y = X @ coef; `stderr` per coefficient; `n` samples."""

    names: tuple[str, ...]
    coef: tuple[float, ...]
    stderr: tuple[float, ...]
    n: int
    r2: float

    def ci95(self, name: str) -> tuple[float, float]:
        i = self.names.index(name)
        return self.coef[i] - Z95 * self.stderr[i], self.coef[i] + Z95 * self.stderr[i]

    def __getitem__(self, name: str) -> float:
        return self.coef[self.names.index(name)]


def least_squares(x: np.ndarray, y: np.ndarray, names: tuple[str, ...], nonnegative: bool = False) -> LinearFit:
    """Ordinary least squares; with `nonnegative`, the best fit whose coefficients are all >= 0
    (for costs: a noisy sample set can otherwise fit a negative per-token cost, and then long
    spans would cost negative seconds). With a handful of coefficients the exact answer is the
    best of the unconstrained fits on each subset of the columns that comes out non-negative;
    a dropped coefficient is 0 with no error."""
    n, k = x.shape
    if n <= k:
        raise FitError(f"{n} samples cannot fit {k} coefficients ({', '.join(names)})")
    # Columns are scaled to unit size before solving: seconds and bytes differ by 12 orders.
    scale = np.maximum(np.abs(x).max(axis=0), 1e-300)
    xs = x / scale
    if np.linalg.matrix_rank(xs) < k:
        raise FitError(f"samples do not vary enough to separate {', '.join(names)}")
    coef_s, *_ = np.linalg.lstsq(xs, y, rcond=None)
    kept = list(range(k))
    if nonnegative and (coef_s < 0).any():
        best = None
        for size in range(k - 1, 0, -1):
            for subset in itertools.combinations(range(k), size):
                part, *_ = np.linalg.lstsq(xs[:, subset], y, rcond=None)
                if (part >= 0).all():
                    r = y - xs[:, subset] @ part
                    if best is None or float(r @ r) < best[0]:
                        best = (float(r @ r), list(subset), part)
        if best is None:
            raise FitError(f"no fit of {', '.join(names)} with every coefficient >= 0")
        _, kept, part = best
        coef_s = np.zeros(k)
        coef_s[kept] = part
    resid = y - xs @ coef_s
    dof = n - len(kept)
    sigma2 = float(resid @ resid) / dof
    sub = xs[:, kept]
    variances = np.zeros(k)
    variances[kept] = np.diag(sigma2 * np.linalg.inv(sub.T @ sub))
    coef = coef_s / scale
    stderr = np.sqrt(np.maximum(variances, 0.0)) / scale
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(resid @ resid) / total if total > 0 else 1.0
    return LinearFit(names, tuple(map(float, coef)), tuple(map(float, stderr)), n, r2)


@dataclass(frozen=True, slots=True)
class TransferModel:
    """Moving bytes along one tier path for one model."""

    model: str
    src: Tier
    dst: Tier
    fit: LinearFit  # seconds = latency_s + s_per_byte * bytes

    @property
    def latency_s(self) -> float:
        return max(self.fit["latency_s"], 0.0)

    @property
    def bytes_per_s(self) -> float:
        slope = self.fit["s_per_byte"]
        return 1.0 / slope if slope > 0 else math.inf

    def bandwidth_ci95(self) -> tuple[float, float]:
        lo, hi = self.fit.ci95("s_per_byte")
        return (1.0 / hi if hi > 0 else math.inf, 1.0 / lo if lo > 0 else math.inf)

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s if nbytes > 0 else 0.0


@dataclass(frozen=True, slots=True)
class PrefillModel:
    """Recomputing tokens for one model."""

    model: str
    fit: LinearFit  # seconds = fixed_s + per_token_s * n + per_pair_s * n * (s + n / 2)

    def seconds(self, start: int, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        f = self.fit
        return max(f["fixed_s"], 0.0) + f["per_token_s"] * tokens + f["per_pair_s"] * tokens * (start + tokens / 2)


def transfer_samples(events: pl.DataFrame) -> pl.DataFrame:
    """One row per timed load: model, tier path, bytes moved (a run moves every block it names)."""
    return (events.lazy()
            .filter((pl.col("kind") == "load") & (pl.col("duration_ns") > 0))
            .select("model", "src_tier", "dst_tier",
                    (pl.col("nbytes") * (1 + pl.col("more_keys").list.len())).cast(pl.Float64).alias("bytes"),
                    (pl.col("duration_ns") / 1e9).alias("seconds"), "in_flight")
            .collect())


def prefill_samples(events: pl.DataFrame) -> pl.DataFrame:
    """One row per adopt that reports its recompute time: tokens computed and where they started."""
    return (events.lazy()
            .filter((pl.col("kind") == "adopt") & (pl.col("duration_ns") > 0) & (pl.col("recomputed_tokens") > 0))
            .select("model", pl.col("reused_tokens").list.sum().fill_null(0).cast(pl.Float64).alias("start"),
                    pl.col("recomputed_tokens").cast(pl.Float64).alias("tokens"),
                    (pl.col("duration_ns") / 1e9).alias("seconds"))
            .collect())


def _fill(samples: pl.DataFrame, measured: pl.DataFrame, keys: list[str], min_samples: int) -> pl.DataFrame:
    """Event samples, plus calibration samples for the keys the events have too few of: timings
    from production are the truth, a calibration only fills the gaps."""
    if measured.is_empty():
        return samples
    enough = samples.group_by(keys).len().filter(pl.col("len") >= min_samples).select(keys)
    return pl.concat([samples, measured.join(enough, on=keys, how="anti").select(samples.columns)],
                     how="vertical_relaxed")


def calibration_transfer_samples(calibrations: pl.DataFrame) -> pl.DataFrame:
    return calibrations.filter(pl.col("kind") == "transfer").select(
        "model", "src_tier", "dst_tier", pl.col("nbytes").cast(pl.Float64).alias("bytes"), "seconds",
        pl.lit(False).alias("in_flight"))


def calibration_prefill_samples(calibrations: pl.DataFrame) -> pl.DataFrame:
    return calibrations.filter(pl.col("kind") == "prefill").select(
        "model", pl.col("start").cast(pl.Float64), pl.col("tokens").cast(pl.Float64), "seconds")


def fit_transfers(events: pl.DataFrame, min_samples: int = 8,
                  calibrations: pl.DataFrame | None = None) -> list[TransferModel]:
    """A model per (model, src, dst) with enough timed loads of varying size (calibrated copies
    fill in where the events have too few)."""
    samples = transfer_samples(events)
    if calibrations is not None:
        samples = _fill(samples, calibration_transfer_samples(calibrations), ["model", "src_tier", "dst_tier"],
                        min_samples)
    out = []
    for (model, src, dst), part in samples.group_by(["model", "src_tier", "dst_tier"], maintain_order=True):
        if part.height < min_samples:
            continue
        x = np.column_stack([np.ones(part.height), part["bytes"].to_numpy()])
        try:
            fit = least_squares(x, part["seconds"].to_numpy(), ("latency_s", "s_per_byte"))
        except FitError:
            continue
        out.append(TransferModel(str(model), Tier(src), Tier(dst), fit))
    return out


def fit_prefill(events: pl.DataFrame, min_samples: int = 8,
                calibrations: pl.DataFrame | None = None) -> list[PrefillModel]:
    """A model per model name with enough timed recomputes of varying length and depth
    (calibrated prefills fill in where the events have too few)."""
    samples = prefill_samples(events)
    if calibrations is not None:
        samples = _fill(samples, calibration_prefill_samples(calibrations), ["model"], min_samples)
    out = []
    for (model,), part in samples.group_by(["model"], maintain_order=True):
        if part.height < min_samples:
            continue
        n, s = part["tokens"].to_numpy(), part["start"].to_numpy()
        x = np.column_stack([np.ones(part.height), n, n * (s + n / 2)])
        try:
            fit = least_squares(x, part["seconds"].to_numpy(), ("fixed_s", "per_token_s", "per_pair_s"),
                                nonnegative=True)
        except FitError:
            continue
        out.append(PrefillModel(str(model), fit))
    return out


def crossover_tokens(transfer: TransferModel, prefill: PrefillModel, bytes_per_token: float, start: int = 0,
                     max_tokens: int = 1 << 22) -> int | None:
    """The fewest tokens, starting at position `start`, whose restore is faster than recomputing
    them (None: recomputing stays cheaper up to `max_tokens`).

    recompute(n) - load(n) = a n^2 + b n + c with a = per_pair / 2, b = per_token + per_pair * s
    - bytes_per_token / bandwidth, c = fixed - latency; loading wins where that is positive.
    """
    f = prefill.fit
    a = f["per_pair_s"] / 2
    b = f["per_token_s"] + f["per_pair_s"] * start - bytes_per_token / transfer.bytes_per_s
    c = max(f["fixed_s"], 0.0) - transfer.latency_s

    def wins(n: int) -> bool:
        return a * n * n + b * n + c > 0

    roots = sorted(r.real for r in np.roots([a, b, c]) if abs(r.imag) < 1e-12) if a else (
        [-c / b] if b else [])
    for candidate in [1, *(math.floor(r) + 1 for r in roots if r > 0)]:
        if 1 <= candidate <= max_tokens and wins(candidate):
            return int(candidate)
    return None


@dataclass(frozen=True, slots=True)
class Crossover:
    model: str
    src: Tier
    start: int
    tokens: int | None


def crossover_curve(transfers: Iterable[TransferModel], prefills: Iterable[PrefillModel],
                    bytes_per_token: Mapping[str, float], starts: Iterable[int]) -> pl.DataFrame:
    """Crossover tokens per model, tier path and context position."""
    by_model = {p.model: p for p in prefills}
    rows = []
    starts = list(starts)
    for t in transfers:
        prefill = by_model.get(t.model)
        if prefill is None or t.model not in bytes_per_token:
            continue
        for s in starts:
            rows.append({"model": t.model, "src_tier": t.src.value, "start": s,
                         "crossover_tokens": crossover_tokens(t, prefill, bytes_per_token[t.model], s)})
    return pl.DataFrame(rows, schema={"model": pl.Utf8, "src_tier": pl.Utf8, "start": pl.Int64,
                                      "crossover_tokens": pl.Int64})


_RESTORE_COLUMNS = (("restore_host_bytes", Tier.HOST), ("restore_disk_bytes", Tier.DISK),
                    ("restore_remote_bytes", Tier.REMOTE))


def restore_decisions(results: pl.DataFrame, transfers: Iterable[TransferModel],
                      prefills: Iterable[PrefillModel]) -> pl.DataFrame:
    """Per lookup with something to restore: restore vs recompute seconds, which was cheaper,
    what the engine did, and the seconds its choice lost.

    The span in question is [resident, recoverable): recoverable but not on the device. The
    engine restored it when it adopted past the resident hit. Lookups whose model or tier path
    has no fitted model are left out (`restore_s` would be a guess).
    """
    to_device = {(t.model, t.src): t for t in transfers if t.dst is Tier.DEVICE}
    by_model = {p.model: p for p in prefills}
    rows = []
    for r in results.filter(pl.col("adopt_seen") & (pl.col("recoverable_hit_tokens") > pl.col("resident_hit_tokens")))\
            .iter_rows(named=True):
        prefill = by_model.get(r["model"])
        if prefill is None:
            continue
        restore = 0.0
        known = True
        for column, tier in _RESTORE_COLUMNS:
            if r[column]:
                model = to_device.get((r["model"], tier))
                if model is None:
                    known = False
                    break
                restore += model.seconds(r[column])
        if not known:
            continue
        start, span = r["resident_hit_tokens"], r["recoverable_hit_tokens"] - r["resident_hit_tokens"]
        recompute = prefill.seconds(start, span)
        restored = r["adopted_tokens"] > start
        lost = (restore - recompute) if restored else (recompute - restore)
        rows.append({"ts_ns": r["ts_ns"], "request_id": r["request_id"], "model": r["model"],
                     "instance": r["instance"], "span_tokens": span, "restore_s": restore, "recompute_s": recompute,
                     "restore_cheaper": restore < recompute, "restored": restored, "lost_s": max(lost, 0.0)})
    schema = {"ts_ns": pl.Int64, "request_id": pl.Utf8, "model": pl.Utf8, "instance": pl.Utf8,
              "span_tokens": pl.Int64, "restore_s": pl.Float64, "recompute_s": pl.Float64,
              "restore_cheaper": pl.Boolean, "restored": pl.Boolean, "lost_s": pl.Float64}
    return pl.DataFrame(rows, schema=schema)


def _restore_seconds(model: str, by_tier: Iterable[tuple[Tier, int]],
                     to_device: Mapping[tuple[str, Tier], TransferModel]) -> float | None:
    """Seconds to bring each tier's bytes to the device, one transfer per tier (None: a tier
    with bytes has no fitted path)."""
    total = 0.0
    for tier, nbytes in by_tier:
        if nbytes:
            path = to_device.get((model, tier))
            if path is None:
                return None
            total += path.seconds(nbytes)
    return total


def routing_regret_seconds(results: pl.DataFrame, transfers: Iterable[TransferModel],
                           prefills: Iterable[PrefillModel]) -> pl.DataFrame:
    """Per lookup with routing regret (fleet view rows): the modelled seconds to serve its prompt
    on the instance it was sent to and on the best instance, and what the routing cost.

    Serving at boundary r costs restoring the recoverable prefix's off-device bytes plus
    recomputing [r, prompt). On the chosen instance the restore is priced per tier; the best
    instance's rows carry only its total restore bytes, so they are priced on the slowest fitted
    path to the device (`best_exact` is False then): `best_s` is at most that, and `regret_s`,
    the seconds the request would have saved there (0 where it would have saved none), at
    least what the routing cost. Where the model has no fitted prefill, or a restore no fitted
    path, the seconds are null (the tokens still count): a guess is not a price.
    """
    to_device = {(t.model, t.src): t for t in transfers if t.dst is Tier.DEVICE}
    slowest: dict[str, TransferModel] = {}
    for (model, _), path in to_device.items():
        old = slowest.get(model)
        if old is None or (path.bytes_per_s, -path.latency_s) < (old.bytes_per_s, -old.latency_s):
            slowest[model] = path
    by_model = {p.model: p for p in prefills}
    rows = []
    for r in results.filter(pl.col("routing_regret_tokens") > 0).iter_rows(named=True):
        prefill, path = by_model.get(r["model"]), slowest.get(r["model"])
        here_restore = _restore_seconds(r["model"], ((tier, r[column]) for column, tier in _RESTORE_COLUMNS),
                                        to_device)
        best_bytes = r["best_restore_bytes"]
        best_restore = 0.0 if not best_bytes else None if path is None else path.seconds(best_bytes)
        here_s = best_s = regret_s = None
        if prefill is not None and here_restore is not None and best_restore is not None:
            prompt, best = r["prompt_tokens"], r["recoverable_anywhere_tokens"]
            here = best - r["routing_regret_tokens"]
            here_s = here_restore + prefill.seconds(here, prompt - here)
            best_s = best_restore + prefill.seconds(best, prompt - best)
            regret_s = max(here_s - best_s, 0.0)
        rows.append({"ts_ns": r["ts_ns"], "request_id": r["request_id"], "model": r["model"],
                     "instance": r["instance"], "best_instance": r["best_instance"],
                     "regret_tokens": r["routing_regret_tokens"], "here_s": here_s, "best_s": best_s,
                     "best_exact": not best_bytes, "regret_s": regret_s})
    schema = {"ts_ns": pl.Int64, "request_id": pl.Utf8, "model": pl.Utf8, "instance": pl.Utf8,
              "best_instance": pl.Utf8, "regret_tokens": pl.Int64, "here_s": pl.Float64, "best_s": pl.Float64,
              "best_exact": pl.Boolean, "regret_s": pl.Float64}
    return pl.DataFrame(rows, schema=schema)


def regret_by_pair(regret: pl.DataFrame) -> pl.DataFrame:
    """Routing regret in seconds (`routing_regret_seconds`) by (instance sent to, best instance),
    largest first; `unpriced` counts lookups with no seconds, `exact` says whether every priced
    one was priced exactly."""
    return regret.group_by("instance", "best_instance").agg(
        pl.len().alias("lookups"), pl.col("regret_tokens").sum(), pl.col("regret_s").sum(),
        pl.col("regret_s").is_null().sum().alias("unpriced"),
        pl.col("best_exact").filter(pl.col("regret_s").is_not_null()).all().alias("exact"),
    ).sort("regret_s", "instance", "best_instance", descending=[True, False, False])


def waiting_seconds(events: pl.DataFrame) -> pl.DataFrame:
    """Time requests waited on loads still in flight when they were admitted, per model."""
    samples = transfer_samples(events).filter(pl.col("in_flight"))
    return samples.group_by("model").agg(pl.len().alias("loads"), pl.col("seconds").sum().alias("waiting_s"))
