"""The live path's reorder buffer releases what a full stable sort of every arrival would, cut at
each watermark, whatever the batches' sizes, order and overlap."""

from __future__ import annotations

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrace.collector.reorder import ReorderBuffer

# A batch: rows of (ts_ns, source_id, seq); few distinct values, so ties on every key part occur.
_row = st.tuples(st.integers(0, 40), st.integers(1, 3), st.integers(0, 5))
_rows = st.lists(_row, min_size=0, max_size=12)
# Most senders' batches come in time order: sorted on ts alone, ties in any order of the rest.
_batch = st.one_of(_rows, _rows.map(lambda rows: sorted(rows, key=lambda r: r[0])))
# What arrives at once: one batch, or several concatenated (a stored chunk of several requests,
# one record batch each).
_arrival = st.lists(_batch, min_size=1, max_size=3)
# One step: a batch arrives, then a release at a watermark (None: everything) with a bound.
_step = st.tuples(_arrival, st.one_of(st.none(), st.integers(-1, 45)), st.integers(1, 30))


def _table(rows: list[tuple[int, int, int]], first_id: int) -> pa.Table:
    return pa.table({"ts_ns": pa.array([r[0] for r in rows], pa.int64()),
                     "source_id": pa.array([r[1] for r in rows], pa.uint64()),
                     "seq": pa.array([r[2] for r in rows], pa.uint64()),
                     "arrival": pa.array(range(first_id, first_id + len(rows)), pa.int64())})


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(_step, max_size=12), max_runs=st.integers(1, 4))
def test_releases_follow_a_stable_sort_of_every_arrival(steps: list, max_runs: int) -> None:
    buffer = ReorderBuffer(max_runs=max_runs)
    held: list[tuple[int, int, int, int]] = []  # the reference: (ts, source, seq, arrival)
    arrived = 0
    for parts, watermark, max_held in steps:
        starts = [arrived + sum(map(len, parts[:i])) for i in range(len(parts))]
        buffer.add(pa.concat_tables([_table(p, at) for p, at in zip(parts, starts, strict=True)]))
        rows = [r for p in parts for r in p]
        held += [(*r, arrived + i) for i, r in enumerate(rows)]
        arrived += len(rows)
        out, early = buffer.release(watermark, max_held)
        held.sort(key=lambda r: r[:3])  # Python's sort is stable: arrival order on equal keys
        cut = len(held) if watermark is None else sum(1 for r in held if r[0] <= watermark)
        want_early = max(0, len(held) - cut - max_held) if watermark is not None else 0
        cut += want_early
        want, held = held[:cut], held[cut:]
        got = [] if out is None else list(zip(*(out[c].to_pylist() for c in ("ts_ns", "source_id", "seq", "arrival")),
                                              strict=True))
        assert got == want
        assert early == want_early
        assert buffer.count == len(held) <= max(max_held, len(held))
        assert buffer.oldest_ts() == (min(r[0] for r in held) if held else None)
