"""Measures load and recompute costs on this machine, for deployments whose events carry no
timings yet. Needs torch (the optional `torch` extra); nothing else in kvtrace does.

Prefill: a transformer-shaped forward pass (QKV and output projections, attention over the
cached context plus the new tokens with a causal mask, a gated MLP) for chunks of n tokens after
s cached ones, for a given model shape, timed as the median of a few repeats. The same cost
model the events are fitted with (fixed + per token + per token pair) is fitted to these.

Transfers: copies of growing sizes along each tier path the machine has. With a GPU, host
(pinned) to device and back; without one, the "device" is host memory too, so the copy measures
memory bandwidth, which is what restoring from a host tier costs there.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import partial

from kvtrace.schema.kinds import Tier
from kvtrace.schema.records import CalibrationSample


@dataclass(frozen=True, slots=True)
class ModelShape:
    layers: int = 4
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 1408
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate"):
            if getattr(self, name) < 1:
                raise ValueError(f"model shape: {name} must be >= 1, got {getattr(self, name)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"model shape: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"model shape: dtype {self.dtype!r} is not float32, float16 or bfloat16")

    def kv_bytes_per_token(self) -> int:
        """K and V of every layer: what restoring one cached token moves."""
        return 2 * self.layers * self.kv_heads * self.head_dim * (4 if self.dtype == "float32" else 2)


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return f"cuda: {torch.cuda.get_device_name(torch.device(device))}"
    return f"cpu: {platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


def _timed(fn, device: str, repeats: int) -> float:  # noqa: ANN001
    import torch

    fn()  # warm-up: allocations, kernel choice
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def calibrate_prefill(shape: ModelShape, model: str, starts: Sequence[int] = (0, 512, 1024, 2048),
                      chunks: Sequence[int] = (64, 128, 256, 512), device: str = "cpu", repeats: int = 3,
                      run_id: str = "") -> list[CalibrationSample]:
    import torch
    import torch.nn.functional as F

    dtype = getattr(torch, shape.dtype)
    dev = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(0)

    def weight(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen) / rows**0.5).to(dev, dtype)

    h, hd, nh, nkv = shape.hidden, shape.head_dim, shape.heads, shape.kv_heads
    wq, wk, wv, wo = weight(h, nh * hd), weight(h, nkv * hd), weight(h, nkv * hd), weight(nh * hd, h)
    wg, wu, wd = weight(h, shape.intermediate), weight(h, shape.intermediate), weight(shape.intermediate, h)
    run_id = run_id or uuid.uuid4().hex[:12]
    name = device_name(device)
    shape_json = json.dumps(asdict(shape), sort_keys=True)

    # one chunk of n new tokens after the cached ones, bound to each chunk's tensors below
    def forward(x0: torch.Tensor, n: int, cache_k: torch.Tensor, cache_v: torch.Tensor, mask: torch.Tensor) -> None:
        x = x0
        with torch.inference_mode():
            for _ in range(shape.layers):
                q = (x @ wq).view(n, nh, hd).transpose(0, 1).unsqueeze(0)
                k = torch.cat([cache_k, (x @ wk).view(n, nkv, hd).transpose(0, 1).unsqueeze(0)], dim=2)
                v = torch.cat([cache_v, (x @ wv).view(n, nkv, hd).transpose(0, 1).unsqueeze(0)], dim=2)
                k = k.repeat_interleave(nh // nkv, dim=1)
                v = v.repeat_interleave(nh // nkv, dim=1)
                a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                x = x + a.squeeze(0).transpose(0, 1).reshape(n, nh * hd) @ wo
                x = x + (F.silu(x @ wg) * (x @ wu)) @ wd

    out = []
    for start in starts:
        cache_k = torch.randn(1, nkv, start, hd, generator=gen).to(dev, dtype)
        cache_v = torch.randn(1, nkv, start, hd, generator=gen).to(dev, dtype)
        for n in chunks:
            x0 = torch.randn(n, h, generator=gen).to(dev, dtype)
            # token i of the chunk sees the cache and chunk tokens up to itself
            mask = torch.ones(n, start + n, dtype=torch.bool, device=dev).tril(diagonal=start)
            seconds = _timed(partial(forward, x0, n, cache_k, cache_v, mask), device, repeats)
            out.append(CalibrationSample(ts_ns=time.time_ns(), run_id=run_id, device=name, model=model,
                                         shape=shape_json, kind="prefill", start=start, tokens=n, seconds=seconds))
    return out


def calibrate_transfers(model: str, sizes: Sequence[int] = (1 << 20, 4 << 20, 16 << 20, 64 << 20),
                        device: str = "cpu", repeats: int = 3, run_id: str = "") -> list[CalibrationSample]:
    import torch

    run_id = run_id or uuid.uuid4().hex[:12]
    name = device_name(device)
    out = []
    for nbytes in sizes:
        count = nbytes // 4
        if device.startswith("cuda"):
            host = torch.empty(count, dtype=torch.float32).pin_memory()
            gpu = torch.empty(count, dtype=torch.float32, device=device)
            paths = [(Tier.HOST, Tier.DEVICE, partial(gpu.copy_, host, non_blocking=True)),
                     (Tier.DEVICE, Tier.HOST, partial(host.copy_, gpu, non_blocking=True))]
        else:
            src = torch.ones(count, dtype=torch.float32)
            dst = torch.empty(count, dtype=torch.float32)
            paths = [(Tier.HOST, Tier.DEVICE, partial(dst.copy_, src))]
        for s, d, fn in paths:
            seconds = _timed(fn, device, repeats)
            out.append(CalibrationSample(ts_ns=time.time_ns(), run_id=run_id, device=name, model=model,
                                         kind="transfer", src_tier=s.value, dst_tier=d.value, nbytes=count * 4,
                                         seconds=seconds))
    return out


@dataclass(frozen=True, slots=True)
class Calibration:
    """One calibration run: prefill timings, then copy timings, all under one run id."""

    run_id: str
    samples: list[CalibrationSample]

    @property
    def device(self) -> str:
        return self.samples[0].device if self.samples else ""


def calibrate(shape: ModelShape, model: str, starts: Sequence[int] = (0, 512, 1024, 2048),
              chunks: Sequence[int] = (64, 128, 256, 512),
              sizes: Sequence[int] = (1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20, 32 << 20, 64 << 20, 128 << 20),
              device: str = "cpu", repeats: int = 3) -> Calibration:
    """Prefill of `chunks` tokens after each of `starts` cached ones for `shape`, and copies of
    `sizes` bytes along each tier path, on `device`: what `kvtrace calibrate` measures."""
    run_id = uuid.uuid4().hex[:12]
    return Calibration(run_id, [*calibrate_prefill(shape, model, starts, chunks, device, repeats, run_id),
                                *calibrate_transfers(model, sizes, device, repeats, run_id)])
