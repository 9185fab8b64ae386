"""The SGLang shim's engine-free parts: a request's key chain (and the Python ints it shares
between a lookup and its commit) and the ledger's netting helpers. The shim itself is tested
against SGLang's real caches in tests/engines/sglang."""

from __future__ import annotations

from array import array

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrace.instrumentation.page_keys import page_keys
from kvtrace.instrumentation.sglang.keys import new_chain
from kvtrace.instrumentation.sglang.ledger import as_slots, unique


def test_chain_ints_are_its_keys_made_once() -> None:
    tokens = array("q", range(16 * 10))
    chain = new_chain(None, None)
    keys = chain.extend(tokens[: 16 * 6], 16)
    first = chain.ints(0, 6)
    assert list(first) == keys.tolist() == page_keys(tokens[: 16 * 6], 16).tolist()
    # A later slice of the same pages is the same objects: a commit reuses its lookup's ints.
    assert all(a is b for a, b in zip(chain.ints(2, 6), first[2:6], strict=True))
    # Growing the chain grows the ints on demand, the earlier ones kept.
    chain.extend(tokens, 16)
    grown = chain.ints(4, 10)
    assert list(grown) == page_keys(tokens, 16).tolist()[4:10]
    assert grown[0] is first[4]
    # A prefix chain shares what was made.
    short = chain.prefix(3)
    assert short.ints(0, 3) == first[:3] and short.ints(0, 3)[1] is first[1]
    assert short.ints(0, 3) == tuple(short.keys.tolist())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), max_size=60))
def test_unique_keeps_first_seen_order(values: list[int]) -> None:
    keys = np.array(values, dtype=np.uint64)
    want = list(dict.fromkeys(values))
    assert unique(keys).tolist() == want


def test_unique_without_repeats_is_the_same_array() -> None:
    keys = np.array([9, 3, 7, 1], dtype=np.uint64)
    assert unique(keys) is keys


def test_slots_of_a_single_segment_list_and_pads() -> None:
    import torch

    seg = torch.arange(32, 64, dtype=torch.int64)
    assert as_slots([seg], 16).tolist() == [2, 3]
    assert as_slots([seg, torch.arange(96, 112)], 16).tolist() == [2, 3, 6]
    assert as_slots(torch.tensor([-1, 5, 7], dtype=torch.int32), 1).tolist() == [5, 7]
    assert as_slots(None, 16).tolist() == []


def test_ledger_slots_stand_in_for_the_tensor_they_were_read_from() -> None:
    import torch

    from kvtrace.instrumentation.sglang.ledger import LedgerSlots

    raw = torch.arange(64, 64 + 16 * 5, dtype=torch.int64)  # five pages of 16 slots
    read = LedgerSlots(as_slots(raw, 16), 16)
    assert len(read) == len(raw)
    for cut in (slice(None), slice(0, 48), slice(16, 80), slice(0, 40)):
        assert as_slots(read[cut], 16).tolist() == as_slots(raw[cut], 16).tolist()
    with pytest.raises(ValueError, match="page of 1"):
        as_slots(read, 1)
