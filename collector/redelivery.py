"""Events delivered twice, found as they arrive, before the live state sees them again.

Delivery is at least once: an emitter's batch that reached the collector but whose answer never
reached the emitter (its process was killed between the two, or the answer timed out) is sent
again, by the emitter's retry, by the shipper of its journal, or by the next emitter that takes
the journal over. The store de-duplicates the copy (its rows replace on (source, seq)); the live
state must not take it at all. A copy of a lookup fed again re-opened the lookup: the first was
closed without its adopt (or the copy was, at the emitter's end), and that verdict row could
replace the right one.

Why by sequence number at arrival: an emitter numbers its events as it queues them and sends
them in that order, one batch at a time, so the rows of one source arrive with rising `seq`,
whatever their timestamps (a shim may stamp its own). A row whose `seq` is not above the highest
its source has already delivered is a copy. That is one integer per source, where remembering
the keys fed would take memory in proportion to the ingest rate times the longest retry.
"""

from __future__ import annotations

import numpy as np


def redelivered(sources: np.ndarray, seqs: np.ndarray, newest: dict[int, int]) -> np.ndarray | None:
    """The rows (in arrival order) that repeat one their source delivered before, as a mask;
    None when there is none. `newest` holds each source's highest `seq` delivered, and is
    updated with these rows."""
    n = len(seqs)
    if not n:
        return None
    seqs = seqs.astype(np.int64, copy=False)  # emitters count from 0: far below 2^63
    first = sources[0]
    if (sources == first).all():
        groups = [(int(first), None)]
    else:
        groups = [(int(s), np.flatnonzero(sources == s)) for s in np.unique(sources)]
    mask: np.ndarray | None = None
    for source, rows in groups:
        mine = seqs if rows is None else seqs[rows]
        before = newest.get(source, -1)
        if mine[0] > before and (len(mine) < 2 or bool((np.diff(mine) > 0).all())):
            newest[source] = int(mine[-1])  # the usual case: all new, in order
            continue
        running = np.maximum.accumulate(np.concatenate(([before], mine)))
        again = mine <= running[:-1]
        newest[source] = int(running[-1])
        if again.any():
            if mask is None:
                mask = np.zeros(n, dtype=bool)
            if rows is None:
                mask |= again
            else:
                mask[rows[again]] = True
    return mask
