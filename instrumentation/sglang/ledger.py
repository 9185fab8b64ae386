"""Which page each pool slot holds, for one cache component on one tier.

SGLang hands slots around as tensors of a few thousand indices per request (an insert's value,
a node's freed value, a copy's source and destination). Keeping the ledger as one array of
64-bit keys indexed by slot turns each of those into a handful of vectorized operations,
instead of a Python dictionary operation per page: the shim's cost stays per call, not per page.
Key 0 marks an empty slot (kvtrace keys are never 0).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

EMPTY = np.zeros(0, dtype=np.uint64)
NO_SLOTS = np.zeros(0, dtype=np.int64)


class LedgerSlots:
    """Slots already in ledger units (one per page of `step` slots), standing in for the slot
    tensor they were read from: how recorded calls hand slots back to the shim (see
    `capture`) without expanding them to every token's slot. Slicing is in the tensor's units."""

    __slots__ = ("slots", "step")

    def __init__(self, slots: np.ndarray, step: int) -> None:
        self.slots, self.step = slots, step

    def __len__(self) -> int:
        return len(self.slots) * self.step

    def __getitem__(self, index: slice) -> LedgerSlots:
        start, stop, stride = index.indices(len(self))
        if stride != 1 or start % self.step:
            raise IndexError("ledger slots slice from a page boundary, with a step of 1 only")
        return LedgerSlots(self.slots[start // self.step : -(-stop // self.step)], self.step)


def as_slots(values: Any, step: int) -> np.ndarray:
    """Ledger indices of the slot indices SGLang passes (a tensor, a list of tensors, ints):
    one per page for token pools (`step` = page size; slots of a page are contiguous and its
    first is page-aligned), each index for state pools (`step` = 1)."""
    if type(values) is LedgerSlots:
        if values.step != step:
            raise ValueError(f"ledger slots of {values.step} slots a page read with a page of {step}")
        return values.slots
    return ledger_of_starts(page_starts(values, step), step)


def page_starts(values: Any, step: int) -> np.ndarray:
    """The first slot of every page (every slot for `step` 1) as int64, as SGLang holds them:
    for a 1-D CPU tensor a strided view of its memory, nothing computed. The out-of-process
    capture copies these as they are and leaves `ledger_of_starts` to the resolver."""
    if values is None:
        return NO_SLOTS
    if isinstance(values, (list, tuple)):
        if len(values) == 1:
            return page_starts(values[0], step)
        parts = [page_starts(v, step) for v in values]
        return np.concatenate(parts) if parts else NO_SLOTS
    torch = sys.modules.get("torch")  # SGLang has imported it whenever it hands a tensor over
    if torch is not None and isinstance(values, torch.Tensor):
        if values.is_cpu and values.dim() == 1:  # a view, no torch dispatch for the slice
            out = values.numpy()
            out = out[::step] if step > 1 else out
        else:  # on a device: slice there, copy only the page starts
            flat = values.reshape(-1)
            out = (flat[::step] if step > 1 else flat).cpu().numpy()
    else:
        out = np.asarray(values).reshape(-1)
        out = out[::step] if step > 1 else out
    return out if out.dtype == np.int64 else out.astype(np.int64)


def gather(table: Any, index: np.ndarray) -> np.ndarray:
    """`table[index]` of a 1-D slot table (an allocator's full-to-window map) as int64: on CPU a
    gather from the tensor's numpy view, no torch dispatch; on a device a gather there and one
    copy back."""
    if table.is_cpu:
        return table.numpy()[index].astype(np.int64, copy=False)
    torch = sys.modules["torch"]  # a device tensor came from it
    return table[torch.from_numpy(index).to(table.device)].cpu().numpy().astype(np.int64, copy=False)


def ledger_of_starts(starts: np.ndarray, step: int) -> np.ndarray:
    """Ledger indices of page starts: -1 pads and sentinels dropped, divided by the step."""
    if len(starts) and starts.min() < 0:
        starts = starts[starts >= 0]  # -1 pads and sentinels name no slot
    if step == 1:
        return starts
    shift = step.bit_length() - 1
    return starts >> shift if step == 1 << shift else starts // step


def slot_step(page_size: int, per_slot_state: bool) -> int:
    """Slots per ledger entry: a page's worth for token pools, one for state pools (Mamba's,
    one state per slot) and for pools of one-token pages."""
    return 1 if per_slot_state or page_size == 1 else page_size


def unique(keys: np.ndarray) -> np.ndarray:
    """Keys without repeats, in first-seen order. Repeats are rare (a page held in two slots),
    so one plain sort checks for them and the order-keeping pass runs only when there are."""
    if len(keys) < 2:
        return keys
    ordered = np.sort(keys)
    if not (ordered[1:] == ordered[:-1]).any():
        return keys
    _, first = np.unique(keys, return_index=True)
    return keys[np.sort(first)]


def scatter(table: np.ndarray, slots: np.ndarray, values: np.ndarray) -> np.ndarray:
    """`table[slots] = values` (`slots` not empty), the table grown first (doubling, zeros) to
    hold the largest slot; returns the table, which may be a new array."""
    top = int(slots.max())
    if top >= len(table):
        grown = np.zeros(max(top + 1, 2 * len(table)), dtype=table.dtype)
        grown[: len(table)] = table
        table = grown
    table[slots] = values
    return table


class SlotBook:
    """Page keys by ledger slot; grows to the largest slot seen."""

    __slots__ = ("keys",)

    def __init__(self, size: int = 4096) -> None:
        self.keys = np.zeros(size, dtype=np.uint64)

    def put(self, slots: np.ndarray, keys: np.ndarray) -> None:
        if len(slots):
            self.keys = scatter(self.keys, slots, keys)

    def peek(self, slots: np.ndarray) -> np.ndarray:
        """The keys the slots hold (0 where empty)."""
        if not len(slots):
            return EMPTY
        inside = slots < len(self.keys)
        if inside.all():
            return self.keys[slots]
        out = np.zeros(len(slots), dtype=np.uint64)
        out[inside] = self.keys[slots[inside]]
        return out

    def take(self, slots: np.ndarray) -> np.ndarray:
        """Empty the slots; the keys they held, in slot order."""
        if not len(slots):
            return EMPTY
        slots = slots[slots < len(self.keys)]
        got = self.keys[slots]
        self.keys[slots] = 0
        return got[got != 0]

    def resident(self) -> np.ndarray:
        return self.keys[self.keys != 0]

    def __bool__(self) -> bool:
        return bool(self.keys.any())
