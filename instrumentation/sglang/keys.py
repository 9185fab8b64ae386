"""Page keys of an SGLang request: SGLang's own storage hash chain, one 64-bit key per page.

SGLang names a page by a SHA-256 chained over the pages before it, seeded by the request's
namespace (LoRA `extra_key`, `cache_salt`). HiCache's storage tier files pages under these
hashes and SGLang's KV events carry their first 64 bits (when the request has no namespace), so
kvtrace keys made the same way name the same pages as the engine, its storage and the KV-event
bridge, and never collide across namespaces.

The chain is computed once per request, natively (SGLang's C++ hasher), and extended as the
request grows; lookups and commits of that request share it. Turning 256 hex digests into ints
costs about as much as hashing, so it is one `bytes.fromhex` and one `struct.unpack` per call.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sglang.srt.mem_cache.utils import get_hash_str, storage_namespace_seed


_FORMATS: dict[int, struct.Struct] = {}


def keys_of_hex(hexes: list[str]) -> list[int]:
    """kvtrace keys of SGLang page hashes: their first 64 bits, never 0.

    All digests are decoded at once and the struct skips the last 24 bytes of each: no
    per-page Python work."""
    n = len(hexes)
    if not n:
        return []
    if len(hexes[0]) != 64:  # not SHA-256 hex: take the first 16 digits of each
        keys = list(struct.unpack(f">{n}Q", bytes.fromhex("".join([h[:16] for h in hexes]))))
    else:
        fmt = _FORMATS.get(n)
        if fmt is None:
            fmt = struct.Struct(">" + "Q24x" * n)
            if len(_FORMATS) < 4096:
                _FORMATS[n] = fmt
        keys = list(fmt.unpack(bytes.fromhex("".join(hexes))))
    if 0 in keys:
        keys = [k or 1 for k in keys]
    return keys


@dataclass(slots=True)
class Chain:
    """The page hashes and keys of one token sequence in one namespace, grown page by page."""

    seed: str | None  # SGLang's namespace seed (None: no namespace)
    hexes: list[str] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)
    _array: np.ndarray | None = None  # the keys as uint64, for the slot ledgers

    def array(self) -> np.ndarray:
        """The keys as a uint64 array (made once per length)."""
        if self._array is None or len(self._array) != len(self.keys):
            self._array = np.array(self.keys, dtype=np.uint64)
        return self._array

    def extend(self, token_ids: Any, page_size: int) -> list[int]:
        """Keys of every full page of `token_ids` (a prefix of what earlier calls saw, or an
        extension of it); only pages not hashed yet are hashed."""
        pages = len(token_ids) // page_size
        done = len(self.keys)
        if pages > done:
            prior = self.hexes[-1] if self.hexes else self.seed
            new = get_hash_str(token_ids[done * page_size : pages * page_size], prior, page_size)
            if isinstance(new, str):
                new = [new]
            self.hexes.extend(new)
            self.keys.extend(keys_of_hex(new))
        return self.keys


def new_chain(extra_key: str | None, cache_salt: str | None) -> Chain:
    return Chain(storage_namespace_seed(extra_key, cache_salt))
