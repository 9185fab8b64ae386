"""The live path's reorder buffer: stored event columns held until the watermark passes them,
released in stream order (ts_ns, source_id, seq), equal keys in arrival order.

Why runs: an instance's events wait here for the lateness window (2 s of its clock by default),
which at ingest rates is tens to hundreds of thousands of rows. Sorting the whole buffer again
at every release, and copying it whole into one table, cost more than judging the rows released
(5-6 us an event at 1M events, most of the live path's own cost). Each batch is sorted once, as
it arrives, and held as a run; a release cuts every run at the watermark (a binary search on its
sorted timestamps), hands the prefixes on and keeps the suffixes, slices of the same buffers.
The prefixes need a sort only where they overlap, which in-order senders never do.

The order is the stable sort of everything that arrived: each run is sorted stably and runs
are taken in arrival order, so on equal keys the earlier arrival still goes first. Many small
runs (a sender of one-event batches) are merged once there are `max_runs` of them, so a release
stays a few array operations whatever the senders do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

ORDER = [("ts_ns", "ascending"), ("source_id", "ascending"), ("seq", "ascending")]
Key = tuple[int, int, int]


def first_key(table: pa.Table) -> Key:
    """The smallest (ts_ns, source_id, seq) of a table's rows, sorted or not."""
    row = table.take(pc.sort_indices(table, sort_keys=ORDER)[:1])
    return (row["ts_ns"][0].as_py(), row["source_id"][0].as_py(), row["seq"][0].as_py())


def last_key(table: pa.Table) -> Key:
    """The (ts_ns, source_id, seq) of a sorted table's last row."""
    i = table.num_rows - 1
    return (table["ts_ns"][i].as_py(), table["source_id"][i].as_py(), table["seq"][i].as_py())


def count_before(table: pa.Table, key: Key) -> int:
    """Rows of a sorted table whose (ts_ns, source_id, seq) is below `key`: a prefix."""
    ts = table["ts_ns"].to_numpy()
    at = int(np.searchsorted(ts, key[0], side="left"))
    end = int(np.searchsorted(ts, key[0], side="right"))
    if end > at:  # ties on ts: compare the rest of the key
        src, seq = table["source_id"].to_numpy()[at:end], table["seq"].to_numpy()[at:end]
        at += int(np.count_nonzero((src < key[1]) | ((src == key[1]) & (seq < key[2]))))
    return at


def _in_order(table: pa.Table) -> bool:
    """Whether a one-chunk table's rows are already in stream order (non-decreasing keys)."""
    ts = table["ts_ns"].to_numpy()
    step = np.diff(ts)
    if (step > 0).all():
        return True
    if (step < 0).any():
        return False
    tie = np.flatnonzero(step == 0)  # equal timestamps: the source, then the sequence decides
    src, seq = table["source_id"].to_numpy(), table["seq"].to_numpy()
    a, b = src[tie], src[tie + 1]
    return bool(((b > a) | ((b == a) & (seq[tie + 1] >= seq[tie]))).all())


def _sorted(table: pa.Table) -> pa.Table:
    """The table in stream order (stable: equal keys keep their order), one chunk per column."""
    table = table.combine_chunks()
    if table.num_rows > 1 and not _in_order(table):
        table = table.take(pc.sort_indices(table, sort_keys=ORDER))
    return table


def _runs(table: pa.Table, most: int) -> list[pa.Table]:
    """The table as sorted runs: each of its record batches (a stored chunk is one per request,
    each in order as a sender sends it) is a run as it stands, so a chunk of several concurrent
    senders' requests is neither copied into one nor sorted; beyond `most` batches, or where a
    batch is out of order, the whole table is sorted once."""
    batches = table.to_batches()
    if 1 < len(batches) <= most:
        runs = [pa.Table.from_batches([b]) for b in batches if b.num_rows]
        if all(_in_order(r) for r in runs):
            return runs
    return [_sorted(table)]


@dataclass(slots=True)
class _Run:
    table: pa.Table  # sorted, one chunk
    ts: np.ndarray  # its ts_ns column (a view, for the binary search)


@dataclass(slots=True)
class ReorderBuffer:
    """Rows held until released in stream order; see the module's docstring."""

    max_runs: int = 64
    runs: list[_Run] = field(default_factory=list)  # arrival order, each sorted
    count: int = 0  # rows held

    def add(self, table: pa.Table) -> None:
        if not table.num_rows:
            return
        for run in _runs(table, self.max_runs):
            self.runs.append(_Run(run, run["ts_ns"].to_numpy()))
            self.count += run.num_rows
        if len(self.runs) > self.max_runs:
            self._merge()

    def oldest_ts(self) -> int | None:
        return min((int(r.ts[0]) for r in self.runs), default=None)

    def tables(self) -> list[pa.Table]:
        return [r.table for r in self.runs]

    def release(self, watermark: int | None, max_held: int) -> tuple[pa.Table | None, int]:
        """The rows at or before `watermark` (all, when None) in stream order, plus the oldest
        beyond `max_held` still held; and how many of those were released early."""
        if not self.runs:
            return None, 0
        if watermark is None:
            cuts = [len(r.ts) for r in self.runs]
        else:
            cuts = [int(np.searchsorted(r.ts, watermark, side="right")) for r in self.runs]
        early = self.count - sum(cuts) - max_held if watermark is not None else 0
        if early > 0:  # over the bound: one merged run, cut at the watermark plus the excess
            run = self._merge()
            cut = int(np.searchsorted(run.ts, watermark, side="right")) + early
            cuts = [cut]
        else:
            early = 0
        parts = [r.table.slice(0, k) for r, k in zip(self.runs, cuts, strict=True) if k]
        kept = [_Run(r.table.slice(k), r.ts[k:]) for r, k in zip(self.runs, cuts, strict=True) if k < len(r.ts)]
        self.runs = kept
        self.count = sum(len(r.ts) for r in kept)
        if not parts:
            return None, early
        return (parts[0] if len(parts) == 1 else _merged(parts)), early

    def drop_through(self, key: Key) -> int:
        """Drop the rows at or before `key` (a prefix of each run); how many."""
        after = (key[0], key[1], key[2] + 1)
        kept, dropped = [], 0
        for r in self.runs:
            k = count_before(r.table, after)
            dropped += k
            if k < len(r.ts):
                kept.append(_Run(r.table.slice(k), r.ts[k:]) if k else r)
        self.runs = kept
        self.count -= dropped
        return dropped

    def _merge(self) -> _Run:
        table = _merged(self.tables()).combine_chunks()
        run = _Run(table, table["ts_ns"].to_numpy())
        self.runs = [run]
        return run


def _merged(runs: list[pa.Table]) -> pa.Table:
    """Sorted runs, in arrival order, as one table in stream order: concatenated, and sorted
    (stably: arrival order on ties) only where one run starts before the one ahead of it ends.
    Runs that do not overlap are only put in order (concurrent senders' chunks arrive out of
    order, each a range of its own): no row is copied."""
    firsts = [_first_of_sorted(r) for r in runs]
    order = sorted(range(len(runs)), key=firsts.__getitem__)
    if all(last_key(runs[a]) < firsts[b] for a, b in zip(order, order[1:], strict=False)):
        return pa.concat_tables([runs[i] for i in order])
    table = pa.concat_tables(runs)
    if any(last_key(a) > _first_of_sorted(b) for a, b in zip(runs, runs[1:], strict=False)):
        table = table.take(pc.sort_indices(table, sort_keys=ORDER))
    return table


def _first_of_sorted(table: pa.Table) -> Key:
    """The (ts_ns, source_id, seq) of a sorted table's first row."""
    return (table["ts_ns"][0].as_py(), table["source_id"][0].as_py(), table["seq"][0].as_py())
