"""Serve requests through a real LMCache engine the way a serving engine's connector does.

Per request: look the prompt up (`lookup`, with the request id), retrieve the hit into the
engine's KV (`retrieve`), compute the rest, store what was computed (`store`, masked past the
retrieved prefix). The "computed" KV of each token is a pure function of its id and position,
so every retrieve can be checked byte for byte against what a fresh computation would give.

LMCache writes to disk asynchronously; `settle` waits for those writes between requests so a
replay gives the same answers on every run (a lookup racing a disk write is LMCache's real
behaviour, not something a test should depend on).

LMCache refuses no request for its length (LMCache 0.5.6, v1/cache_engine.py): lookup and
retrieve take any prompt, whole chunks only, and `store` allocates chunk after chunk and, when
its memory runs out, stores the leading chunks it has ("Local cpu memory under pressure so
choosing to store only N total chunks") and returns. The limits a request meets are the serving
engine's, in front of LMCache; so this driver serves every request, as LMCache does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from kvtrace.instrumentation.lmcache.cpu import EngineSpec


@dataclass(frozen=True, slots=True)
class Served:
    request_id: str
    prompt_tokens: int
    lookup_hit: int  # LMCache's own answer
    retrieved: int  # tokens the retrieve delivered
    exact: bool  # the retrieved KV equals a fresh computation's, byte for byte
    retrieved_bytes: int


def kv_for(spec: EngineSpec, tokens: list[int]) -> torch.Tensor:
    """The KV a forward pass would write for these tokens: [2, layers, n, heads * head_size]."""
    n, width = len(tokens), spec.heads * spec.head_size
    ids = torch.tensor(tokens, dtype=torch.float64)[:, None]
    pos = torch.arange(n, dtype=torch.float64)[:, None]
    lanes = torch.arange(width, dtype=torch.float64)[None, :]
    base = torch.sin(ids * 0.37 + pos * 1e-3 + lanes * 0.11)
    layers = torch.stack([base + layer for layer in range(spec.layers)])
    return torch.stack([layers, -layers]).to(spec.dtype)


def wait_for_disk(engine: Any, timeout_s: float = 30.0) -> None:
    """Until the disk backend has no write in flight."""
    disk = (getattr(engine.storage_manager, "storage_backends", {}) or {}).get("LocalDiskBackend")
    if disk is None:
        return
    deadline = time.monotonic() + timeout_s
    while disk.disk_worker.put_tasks and time.monotonic() < deadline:
        time.sleep(0.002)


class Driver:
    def __init__(self, engine: Any, spec: EngineSpec, settle: bool = True) -> None:
        self.engine, self.spec, self.settle = engine, spec, settle

    def serve(self, request_id: str, tokens: list[int], tenant: str = "") -> Served:
        configs = {"lmcache.tag.tenant": tenant} if tenant else None
        engine, n = self.engine, len(tokens)
        if self.settle:
            wait_for_disk(engine)
        hit = int(engine.lookup(tokens, lookup_id=request_id, request_configs=configs))
        kv = kv_for(self.spec, tokens)
        slots = torch.arange(n)
        retrieved, exact, nbytes = 0, True, 0
        if hit:
            out = torch.zeros_like(kv)
            mask = engine.retrieve(tokens, kvcaches=out, slot_mapping=slots, req_id=request_id,
                                   request_configs=configs)
            retrieved = int(mask.sum())
            exact = bool(torch.equal(out[:, :, :retrieved], kv[:, :, :retrieved]))
            nbytes = out[:, :, :retrieved].numel() * out.element_size()
        if retrieved < n:  # compute the rest and store it; the retrieved prefix is already stored
            mask = torch.ones(n, dtype=torch.bool)
            mask[:retrieved] = False
            engine.store(tokens, mask=mask, kvcaches=kv, slot_mapping=slots, request_configs=configs)
        return Served(request_id, n, hit, retrieved, exact, nbytes)
