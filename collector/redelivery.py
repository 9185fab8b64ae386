"""Events delivered twice, found as they arrive, before the live state sees them again.

Delivery is at least once: an emitter's batch that reached the collector but whose answer never
reached the emitter (its process was killed between the two, or the answer timed out) is sent
again, by the emitter's retry, by the shipper of its journal, or by the next emitter that takes
the journal over. The store de-duplicates the copy (its rows replace on (source, seq)); the live
state must not take it at all. A copy of a lookup fed again re-opened the lookup, and a copied
commit was applied again after the evictions that had followed it.

Why ranges of sequence numbers: an event's id is (source, seq), and a source's numbers are
dense but do not arrive in order (a client may send one source's batches concurrently, and an
emitter's threads take numbers and queue in either order). The numbers a source delivered form
a few ranges that join as the holes fill, so a source costs a few integers, where a set of the
ids fed would grow with the ingest rate times the longest retry. Holes that never fill (events
dropped before they were sent) each keep a range; past `MAX_RANGES` the oldest holes are
forgotten, counted as delivered: an event arriving into one of those would have come far too
late to be judged in order anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MAX_RANGES = 4096  # per source


def _none() -> np.ndarray:
    return np.empty(0, dtype=np.int64)


@dataclass(slots=True)
class Delivered:
    """The sequence numbers one source delivered, as sorted, disjoint, non-adjacent ranges
    [start, end)."""

    starts: np.ndarray = field(default_factory=_none)
    ends: np.ndarray = field(default_factory=_none)

    def take(self, seqs: np.ndarray) -> np.ndarray | None:
        """Count these numbers (in arrival order) delivered; the mask of the rows that were
        already, before or earlier in `seqs`, or None when none was."""
        n = len(seqs)
        if not n:
            return None
        seqs = seqs.astype(np.int64, copy=False)  # emitters count from 0: far below 2^63
        if (not len(self.ends) or seqs[0] >= self.ends[-1]) and (n == 1 or bool((np.diff(seqs) > 0).all())):
            self._add(seqs)  # the usual case: all new, rising
            return None
        fresh, first, inverse = np.unique(seqs, return_index=True, return_inverse=True)
        again = np.ones(n, dtype=bool)
        again[first] = False  # the first of each number in this batch, unless delivered before
        if len(self.starts):
            at = np.searchsorted(self.starts, fresh, side="right") - 1
            old = (at >= 0) & (fresh < self.ends[np.maximum(at, 0)])
            again |= old[inverse]
            fresh = fresh[~old]
        self._add(fresh)
        return again if again.any() else None

    def _add(self, seqs: np.ndarray) -> None:
        """Add sorted, distinct numbers not delivered before."""
        if not len(seqs):
            return
        cut = np.flatnonzero(np.diff(seqs) != 1) + 1  # runs of consecutive numbers
        starts = np.concatenate((self.starts, seqs[np.concatenate(([0], cut))]))
        ends = np.concatenate((self.ends, seqs[np.concatenate((cut - 1, [len(seqs) - 1]))] + 1))
        if len(self.starts) and starts[len(self.starts)] < self.ends[-1]:  # not all past the last range
            order = np.argsort(starts, kind="stable")
            starts, ends = starts[order], ends[order]
        new = np.ones(len(starts), dtype=bool)
        new[1:] = starts[1:] > np.maximum.accumulate(ends)[:-1]  # a range that meets the one before joins it
        heads = np.flatnonzero(new)
        self.starts, self.ends = starts[heads], np.maximum.reduceat(ends, heads)
        if len(self.starts) > MAX_RANGES:  # forget the oldest holes
            k = len(self.starts) - MAX_RANGES
            self.starts = np.concatenate((self.starts[:1], self.starts[k + 1:]))
            self.ends = self.ends[k:]


def redelivered(sources: np.ndarray, seqs: np.ndarray, delivered: dict[int, Delivered]) -> np.ndarray | None:
    """The rows whose (source, seq) was delivered before (or earlier in these rows), as a
    mask; None when none was. `delivered` (by source) is updated with these rows."""
    n = len(seqs)
    if not n:
        return None
    first = sources[0]
    if (sources == first).all():
        return delivered.setdefault(int(first), Delivered()).take(seqs)
    mask: np.ndarray | None = None
    for source in np.unique(sources):
        rows = np.flatnonzero(sources == source)
        again = delivered.setdefault(int(source), Delivered()).take(seqs[rows])
        if again is not None:
            if mask is None:
                mask = np.zeros(n, dtype=bool)
            mask[rows[again]] = True
    return mask
