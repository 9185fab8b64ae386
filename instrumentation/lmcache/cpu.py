"""LMCache on a CPU-only machine: a connector stand-in and a builder for a real engine.

LMCache's shipped GPU connectors copy between the serving engine's paged KV and LMCache's
memory objects with accelerator kernels (or, the mock one, move nothing). Everything else a
store, lookup, retrieve, eviction or clear touches (token hashing, the storage manager, the
CPU and disk backends, their cache policies and the disk worker) is LMCache's own code and
runs on CPU as is. So the stand-in is only the copy: `FlatKVConnector` moves real bytes between
a flat KV buffer `kvcaches[2, layers, slots, heads * head_size]` and memory objects (LMCache's
`KV_2LTD` format), addressed by `slot_mapping` as the paged connectors are.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector import GPUConnectorInterface
from lmcache.v1.metadata import LMCacheMetadata


class FlatKVConnector(GPUConnectorInterface):
    """Copies chunks between memory objects and a flat CPU KV buffer (kwargs `kvcaches`, `slot_mapping`)."""

    def __init__(self, layers: int, heads: int, head_size: int) -> None:
        self.layers, self.width = layers, heads * head_size

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        slots = kwargs["slot_mapping"][start:end]
        memory_obj.tensor.copy_(kwargs["kvcaches"][:, :, slots].reshape(memory_obj.tensor.shape))

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        slots = kwargs["slot_mapping"][start:end]
        kv = kwargs["kvcaches"]
        kv[:, :, slots] = memory_obj.tensor.reshape(kv.shape[0], kv.shape[1], len(slots), kv.shape[3])

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for obj, s, e in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, s, e, **kwargs)

    def batched_to_gpu(self, memory_objs: Any = None, starts: Any = None, ends: Any = None, **kwargs: Any) -> None:
        for obj, s, e in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, s, e, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.layers, num_tokens, self.width])


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """A small model's KV geometry and LMCache's tiers: `cpu_gb` of host cache, `disk_gb` on disk."""

    model: str = "kvtrace/tiny"
    layers: int = 2
    heads: int = 2
    head_size: int = 16
    chunk_size: int = 256
    dtype: torch.dtype = torch.float32
    cpu_gb: float = 0.01
    disk_gb: float = 0.05
    disk_path: str = ""
    save_unfull_chunk: bool = False

    @property
    def chunk_bytes(self) -> int:
        return 2 * self.layers * self.chunk_size * self.heads * self.head_size * self.dtype.itemsize


def build_engine(spec: EngineSpec, instance_id: str = "kvtrace") -> LMCacheEngine:
    """A real `LMCacheEngine` with LMCache's local CPU backend (and its disk backend when
    `spec.disk_path` is set), ready to use (`post_init` done, so an enabled kvtrace is attached)."""
    os.environ.setdefault("PYTHONHASHSEED", "0")  # LMCache's builtin chunk hash: stable names
    kwargs: dict[str, Any] = dict(chunk_size=spec.chunk_size, local_cpu=True, max_local_cpu_size=spec.cpu_gb,
                                  save_unfull_chunk=spec.save_unfull_chunk)
    if spec.disk_path:
        kwargs.update(local_disk=f"file://{spec.disk_path.rstrip('/')}/", max_local_disk_size=spec.disk_gb)
    config = LMCacheEngineConfig.from_defaults(**kwargs)
    metadata = LMCacheMetadata(model_name=spec.model, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                               kv_dtype=spec.dtype,
                               kv_shape=(spec.layers, 2, spec.chunk_size, spec.heads, spec.head_size),
                               chunk_size=spec.chunk_size)
    engine = LMCacheEngineBuilder.get_or_create(instance_id, config, metadata,
                                                FlatKVConnector(spec.layers, spec.heads, spec.head_size),
                                                lambda tensor, rank: None, lambda obj, rank: obj)
    engine.post_init()
    return engine


def destroy_engine(instance_id: str = "kvtrace") -> None:
    LMCacheEngineBuilder.destroy(instance_id)


def kv_buffer(spec: EngineSpec, slots: int, seed: int = 0) -> torch.Tensor:
    """A flat KV buffer of random values: what a forward pass would have written."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(2, spec.layers, slots, spec.heads * spec.head_size, generator=generator, dtype=spec.dtype)
