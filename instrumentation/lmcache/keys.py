"""kvtrace names for LMCache's chunks, and the namespace a chunk's tags put it in.

LMCache keys a chunk by `CacheEngineKey(model_name, world_size, worker_id, chunk_hash, dtype,
request_configs)`; its `chunk_hash` is prefix-chained over the chunks of `chunk_size` tokens
and its `tags` (the `lmcache.tag.*` request configs) partition the cache: two tenants storing
the same tokens hold two different chunks with one `chunk_hash`. So the block key folds the
tags into the hash, or one tenant's commit would overwrite the other's in kvtrace's state.
"""

from __future__ import annotations

import hashlib
from typing import Any

MASK64 = (1 << 64) - 1
ADAPTER_TAGS = frozenset({"adapter", "lora", "lora_name", "lora_id"})
"""Tags whose value names the adapter a chunk was computed with; every other tag is namespace."""


def block_key(key: Any) -> int:
    """The chunk's 64-bit kvtrace key: LMCache's chunk hash, with its tags folded in."""
    h = int(key.chunk_hash) & MASK64
    tags = getattr(key, "tags", None)
    if not tags:
        return h
    digest = hashlib.blake2b(repr((h, tags)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def namespace(tags: Any) -> tuple[str, str]:
    """(tenant, adapter) from a chunk's tags: the adapter tag's value, and the rest as `k=v,...`."""
    if not tags:
        return "", ""
    adapter = ""
    rest = []
    for name, value in tags:
        if name in ADAPTER_TAGS:
            adapter = str(value)
        else:
            rest.append(f"{name}={value}")
    return ",".join(rest), adapter


def tags_of(request_configs: Any) -> tuple[tuple[str, Any], ...] | None:
    """The tags LMCache derives from a request's configs (as `CacheEngineKey` does)."""
    if not request_configs:
        return None
    tags = tuple((k[len("lmcache.tag."):], v) for k, v in request_configs.items() if k.startswith("lmcache.tag."))
    return tags or None
