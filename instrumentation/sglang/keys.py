"""Page keys of an SGLang request: kvtrace's prefix-chained page keys, one 64-bit key per page.

SGLang's radix tree matches tokens and names nothing, so the shim names every page of every
prompt itself, on the scheduler thread. It uses kvtrace's own page keys (`page_keys`: a few
vectorized passes, ~0.04 us a page) rather than SGLang's storage hash (SHA-256 chained through
hex digests, ~0.25 us a page with the decoding to ints), which cost as much as the radix cache's
own work per request. The chain is seeded by the request's namespace (LoRA `extra_key`,
`cache_salt`) so namespaces never share keys, and it is deterministic, so every process names
a page the same way. Where SGLang does name pages (HiCache's storage tier files them under its
SHA-256 hashes), the HiCache hooks translate (`StorageNames`).

The chain is computed once per request and extended as the request grows; lookups and commits
of that request share it, and share its keys as Python ints too (`ints`): the events carry keys
as ints, and making ~850 of them costs as much as hashing the prompt, so a request's commit
reuses the very objects its lookup made instead of making them again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtrace.instrumentation.page_keys import finalize, namespace_seed, page_states, state_of

_NONE = np.zeros(0, dtype=np.uint64)


@dataclass(slots=True)
class Chain:
    """The page keys of one token sequence in one namespace, grown page by page."""

    seed: int  # the namespace's starting state (0: no namespace)
    states: np.ndarray = field(default_factory=lambda: _NONE)  # chain state after each page
    keys: np.ndarray = field(default_factory=lambda: _NONE)  # uint64, one per page
    _ints: tuple[int, ...] = ()  # keys[: len(_ints)] as Python ints, made on demand

    def extend(self, token_ids: Any, page_size: int) -> np.ndarray:
        """Keys of every full page of `token_ids` (a prefix of what earlier calls saw, or an
        extension of it); only pages not keyed yet are hashed. Returns all keys so far."""
        done = len(self.keys)
        if len(token_ids) // page_size > done:
            new = page_states(token_ids, page_size, int(self.states[-1]) if done else self.seed, skip=done)
            if done:
                self.states = np.concatenate([self.states, new])
                self.keys = np.concatenate([self.keys, finalize(new)])
            else:
                self.states, self.keys = new, finalize(new)
        return self.keys

    def ints(self, start: int, stop: int) -> tuple[int, ...]:
        """Keys [start, stop) as Python ints (a tuple: the garbage collector stops tracking a
        tuple of ints). The first call makes every key up to `stop`; later calls slice."""
        made = self._ints
        if stop > len(made):
            made = self._ints = made + tuple(self.keys[len(made) : stop].tolist())
        return made[start:stop]

    def prefix(self, pages: int) -> Chain:
        """A chain of this one's first `pages` pages (sharing its arrays and ints)."""
        return Chain(self.seed, self.states[:pages], self.keys[:pages], self._ints[:pages])


def new_chain(extra_key: str | None, cache_salt: str | None) -> Chain:
    return Chain(namespace_seed(extra_key, cache_salt))


def continue_from(key: int) -> Chain:
    """An empty chain whose next page follows the page named `key`."""
    return Chain(state_of(key))


class StorageNames:
    """SGLang's storage names (the first 64 bits of its SHA-256 page hashes) -> kvtrace keys, for
    the pages this process wrote to storage, newest `limit` kept. Pages read back from storage
    arrive under SGLang's names; this is how they get kvtrace's."""

    def __init__(self, limit: int = 1 << 18) -> None:
        self.limit = limit
        self._keys: OrderedDict[int, int] = OrderedDict()

    @staticmethod
    def short(name: str) -> int:
        return int(name[:16], 16)

    def learn(self, names: list[str], keys: np.ndarray) -> None:
        for name, key in zip(names, keys.tolist(), strict=False):
            if key:
                short = self.short(name)
                self._keys[short] = key
                self._keys.move_to_end(short)
        while len(self._keys) > self.limit:
            self._keys.popitem(last=False)

    def get(self, name: str | None) -> int:
        """The kvtrace key of a page SGLang named `name`, 0 if unknown."""
        return self._keys.get(self.short(name), 0) if name else 0

    def clear(self) -> None:
        self._keys.clear()
