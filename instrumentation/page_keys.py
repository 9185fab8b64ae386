"""Prefix-chained page keys computed in a handful of vectorized passes.

A page's key names the page *and everything before it*: equal keys mean equal token prefixes in
the same namespace, which is what prefix caching reuses. Engines that hash their own pages
(vLLM's block hashes, LMCache's chunk hashes) give kvtrace those names for free. SGLang's radix
tree does not hash pages at all unless HiCache's storage tier is on, so its shim has to name
every page of every prompt itself, on the scheduler thread. SGLang's storage hash (SHA-256 per
page, chained through hex digests) costs ~0.15 us per page plus ~0.1 us to turn digests into
ints: as much as the radix cache's own work per request in a model-free replay. These keys cost
~0.04 us per page (twice that with caches cold), because the chain is a polynomial over
per-page digests and a polynomial prefix is a cumulative sum:

    u_j   = xs29(M1 * t_j)                           one word per token (uint64 arithmetic, wrapping)
    d_i   = sum of L[j mod P] * u_j over page i + K   (P = page size)
    H_i   = B * H_(i-1) + d_i,   H_(-1) = namespace seed
          = B^i * (H_(-1) * B + sum_(k<=i) d_k * B^-k)        (B odd, so invertible mod 2^64)
    key_i = xs29(F * xs32(H_i)), 0 mapped to 1      (0 marks an empty ledger slot)

`xsN(x) = x ^ (x >> N)`. Per-lane odd weights make the position inside a page count, the
xorshift makes the per-token word non-linear (so no small token differences cancel), K keeps a
page of zeros from leaving the chain where it was, and the last step is a bijection that
spreads the bits (keys are also sampled by their bits). These are
identifiers, not a security boundary: like any 64-bit name (SGLang's KV events truncate SHA-256
to 64 bits) they collide by chance with probability ~n^2 / 2^65, and a determined adversary can
make collisions. The constants are fixed ("kvtrace page keys v1"), so every process and host
names the same page the same way.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from functools import lru_cache
from typing import Any

import numpy as np

VERSION = "kvtrace page keys v1"

_U64 = np.uint64
_M1 = _U64(0x9E3779B97F4A7C15)
_B = _U64(0xD6E8FEB86659FD93)
_F1 = _U64(0xBF58476D1CE4E5B9)
_K = _U64(0x6A09E667F3BCC909)
_S29, _S32 = _U64(29), _U64(32)
_MASK = (1 << 64) - 1


@lru_cache(maxsize=64)
def _lanes(count: int) -> np.ndarray:
    """Per-position odd weights L, from a fixed generator (read-only: shared by every caller)."""
    rng = np.random.Generator(np.random.PCG64(0x6B767472616365))  # "kvtrace"
    out = rng.integers(0, 1 << 63, count, dtype=np.uint64) * _U64(2) + _U64(1)
    out.setflags(write=False)
    return out


def _inverse(a: int) -> int:
    """a^-1 mod 2^64 for odd a (Newton's iteration doubles the correct bits each step)."""
    x = a
    for _ in range(6):
        x = (x * (2 - a * x)) & _MASK
    return x


_B_INV = _U64(_inverse(int(_B)))


class _Powers:
    """B^0..B^n and B^0..B^-n, grown on demand (doubling) so a call only slices. Both arrays
    are swapped in as one tuple, so a thread never sees one grown without the other."""

    def __init__(self) -> None:
        one = np.ones(1, dtype=np.uint64)
        self.tables = (one, one)

    def __call__(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        pw, iv = self.tables
        if len(pw) <= n:
            size = max(n + 1, 2 * len(pw), 4096)
            pw, iv = np.empty(size, dtype=np.uint64), np.empty(size, dtype=np.uint64)
            p, q = 1, 1
            b, bi = int(_B), int(_B_INV)
            for i in range(size):  # once per doubling; exact integer arithmetic
                pw[i], iv[i] = p, q
                p, q = (p * b) & _MASK, (q * bi) & _MASK
            self.tables = (pw, iv)
        return pw[: n + 1], iv[: n + 1]


_POWERS = _Powers()
_LOCAL = threading.local()


def _scratch(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Two uint64 work buffers of `size`, this thread's own, grown by doubling."""
    bufs = getattr(_LOCAL, "bufs", None)
    if bufs is None or len(bufs[0]) < size:
        cap = max(size, 2 * len(bufs[0]) if bufs is not None else 1 << 15)
        bufs = _LOCAL.bufs = (np.empty(cap, dtype=np.uint64), np.empty(cap, dtype=np.uint64))
    return bufs[0][:size], bufs[1][:size]


def token_words(tokens: Any) -> np.ndarray:
    """Tokens as a flat uint64 array (no copy for int64 buffers: SGLang's `array("q")`, numpy,
    CPU tensors). A token made of several ids (a tuple) contributes each of them in order."""
    if isinstance(tokens, array):
        if tokens.typecode in ("q", "Q"):
            return np.frombuffer(tokens, dtype=np.uint64)
        if tokens.typecode not in "bBhHiIlL":
            raise TypeError(f"page keys need integer token ids, got array({tokens.typecode!r})")
        return np.frombuffer(tokens, dtype=np.dtype(tokens.typecode)).astype(np.int64).view(np.uint64)
    if hasattr(tokens, "numpy") and hasattr(tokens, "cpu"):  # a torch tensor
        tokens = tokens.cpu().numpy()
    arr = np.asarray(tokens)
    if arr.size == 0:
        return np.zeros(0, dtype=np.uint64)
    if arr.dtype.kind not in "iub":
        raise TypeError(f"page keys need integer token ids, got {arr.dtype}")
    return arr.astype(np.int64, copy=False).reshape(-1).view(np.uint64)


@lru_cache(maxsize=4096)
def namespace_seed(*parts: str | None) -> int:
    """The chain's starting state for a namespace (LoRA adapter, cache salt, ...): 0 when every
    part is absent, so un-namespaced prompts share pages; absent, empty and joined parts differ."""
    if all(p is None for p in parts):
        return 0
    digest = hashlib.blake2b(VERSION.encode(), digest_size=8)
    for part in parts:
        if part is None:
            digest.update(b"\x00")
        else:
            data = part.encode("utf-8")
            digest.update(b"\x01" + len(data).to_bytes(8, "little") + data)
    return int.from_bytes(digest.digest(), "little") or 1


def chain_states(words: np.ndarray, page_words: int, prior: int) -> np.ndarray:
    """The chain states H of every full page of `words`, continuing from state `prior`."""
    n = len(words) // page_words
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    total = n * page_words
    u, tmp = _scratch(total)  # reused buffers: fresh ones of this size cost page faults each call
    np.multiply(words[:total], _M1, out=u)
    np.right_shift(u, _S29, out=tmp)
    u ^= tmp
    # Per-page weighted sums (wrapping) against the page's lane constants: one pass over the
    # words and a table of `page_words` constants that stays in cache.
    h = np.einsum("ij,j->i", u.reshape(n, page_words), _lanes(page_words))
    h += _K  # so that a page of zeros still moves the chain
    pw, iv = _POWERS(n)
    h *= iv[:n]
    np.cumsum(h, out=h)
    if prior:
        h += _U64((prior * int(_B)) & _MASK)
    h *= pw[:n]
    return h


def finalize(states: np.ndarray) -> np.ndarray:
    """Keys of chain states (a new array): a bijective xorshift-multiply-xorshift, never 0."""
    k = states >> _S32
    k ^= states
    k *= _F1
    k ^= k >> _S29
    if not k.all():
        k[k == 0] = 1
    return k


def page_states(tokens: Any, page_size: int, prior: int = 0, skip: int = 0) -> np.ndarray:
    """The chain states of the full pages of `tokens` after the first `skip`, continuing from
    state `prior` (the namespace seed when `skip` is 0)."""
    if len(tokens) // page_size <= skip:
        return np.zeros(0, dtype=np.uint64)
    words = token_words(tokens)
    step = page_size * (len(words) // len(tokens))  # words per page: ids per token may be > 1
    return chain_states(words[skip * step : len(tokens) // page_size * step], step, prior)


def page_keys(tokens: Any, page_size: int, seed: int = 0) -> np.ndarray:
    """The key of every full page of `tokens` (uint64)."""
    return finalize(page_states(tokens, page_size, seed))


_F1_INV = _inverse(int(_F1))


def state_of(key: int) -> int:
    """The chain state a key was made from (the inverse of `finalize`), so a chain can continue
    after a page known only by its key. (The one state whose key would be 0 is named 1; its
    inverse is wrong, with probability 2^-64.)"""
    x = key ^ (key >> 29) ^ (key >> 58)
    x = (x * _F1_INV) & _MASK
    return x ^ (x >> 32)
