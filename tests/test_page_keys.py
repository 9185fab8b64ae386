"""kvtrace's page keys: the vectorized chain against a plain scalar reading of its definition,
the prefix and namespace properties the shims rely on, and pinned values (keys name pages in
stored data, so they must never change silently)."""

from __future__ import annotations

from array import array

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrace.instrumentation.page_keys import (
    _B,
    _F1,
    _K,
    _M1,
    _lanes,
    chain_states,
    finalize,
    namespace_seed,
    page_keys,
    page_states,
    state_of,
    token_words,
)

MASK = (1 << 64) - 1


def reference(tokens: list[int], page: int, seed: int = 0) -> list[int]:
    """The definition in `page_keys`' docstring, one token at a time, in Python integers."""
    lanes = [int(x) for x in _lanes(page)]
    state, keys = seed, []
    for start in range(0, len(tokens) - page + 1, page):
        total = 0
        for lane, t in enumerate(tokens[start : start + page]):
            u = ((t & MASK) * int(_M1)) & MASK
            total += lanes[lane] * (u ^ (u >> 29))
        d = (total + int(_K)) & MASK
        state = (state * int(_B) + d) & MASK
        k = ((state ^ (state >> 32)) * int(_F1)) & MASK
        keys.append((k ^ (k >> 29)) or 1)
    return keys


tokens_st = st.lists(st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1), max_size=200)


@settings(max_examples=300, deadline=None)
@given(tokens=tokens_st, page=st.integers(1, 20), seed=st.integers(0, MASK))
def test_vectorized_keys_equal_the_definition(tokens: list[int], page: int, seed: int) -> None:
    assert page_keys(array("q", tokens), page, seed).tolist() == reference(tokens, page, seed)


@settings(max_examples=200, deadline=None)
@given(tokens=tokens_st, page=st.integers(1, 8), cut=st.integers(0, 30))
def test_a_chain_continues_from_a_key_alone(tokens: list[int], page: int, cut: int) -> None:
    """Keying a prefix, then the rest from the prefix's last key, gives the whole chain's keys."""
    whole = page_keys(tokens, page).tolist()
    head = min(cut, len(whole))
    if head == 0:
        return
    first = page_keys(tokens[: head * page], page).tolist()
    rest = finalize(chain_states(token_words(tokens[head * page :]), page, state_of(first[-1]))).tolist()
    assert first + rest == whole
    assert finalize(page_states(tokens, page, state_of(first[-1]), skip=head)).tolist() == rest


def test_keys_name_prefixes_not_pages() -> None:
    a = list(range(100, 164))
    b = [7] + a[1:]  # the first page differs: every later key differs too
    ka, kb = page_keys(a, 16).tolist(), page_keys(b, 16).tolist()
    assert len(set(ka)) == 4 and not set(ka) & set(kb)
    assert page_keys(a[:32], 16).tolist() == ka[:2]  # a prefix has its own keys as a prefix
    swapped = a[:]
    swapped[0], swapped[1] = swapped[1], swapped[0]  # order inside a page counts
    assert page_keys(swapped, 16)[0] != ka[0]
    zeros = page_keys([0] * 64, 16).tolist()
    assert len(set(zeros)) == 4 and 0 not in zeros  # a run of zero pages still moves the chain


def test_namespaces_share_nothing() -> None:
    tokens = list(range(64))
    plain = set(page_keys(tokens, 16).tolist())
    seeds = {namespace_seed(None, None), namespace_seed("lora-a", None), namespace_seed(None, "lora-a"),
             namespace_seed("", None), namespace_seed("a", "b"), namespace_seed("ab", None)}
    assert namespace_seed(None, None) == 0 and len(seeds) == 6
    for seed in seeds - {0}:
        assert not plain & set(page_keys(tokens, 16, seed).tolist())


def test_token_containers_agree() -> None:
    import torch

    tokens = list(range(1000, 1100))
    want = page_keys(tokens, 16).tolist()
    for container in (array("q", tokens), array("I", tokens), array("i", tokens), np.array(tokens, dtype=np.int32),
                      torch.tensor(tokens)):
        assert page_keys(container, 16).tolist() == want, type(container)


def test_non_integer_tokens_are_refused() -> None:
    for bad in (array("d", [1.0] * 16), np.ones(16), ["a"] * 16):
        with pytest.raises(TypeError, match="integer token ids"):
            page_keys(bad, 16)


def test_pinned_values() -> None:
    """Stored data names pages by these keys: a change here is a new key version, not a fix."""
    assert page_keys(list(range(32)), 16).tolist() == PINNED
    assert namespace_seed("tenant-a", None) == PINNED_SEED


PINNED = [901828130064313028, 1319876047136995817]
PINNED_SEED = 4944595835061456384
