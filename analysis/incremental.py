"""Analysis of a time range at the cost of that range: `kvtrace analyze --since/--until`.

A run starts from the newest snapshot before `since` (the reconstructor's state there, see
`analysis.snapshot`), reads the events after it, keeps the results of lookups made in
[since, until), and reads past `until` only while one of those lookups still waits for its
adopt. It leaves snapshots behind for the next run: one at `until`, and, while it reads a long
stretch, one each `every_ns` of stream time; so the first run over a month-old store reads the
month once, and every later one reads from the snapshot nearest its start. A snapshot is taken
only of settled time (older than `settle_ns`): an event that could still arrive before its
position would be missing from every run that starts there.

The rows equal those of a full streaming run over the same lookups (the tests split random
lifecycles at random points to show it): resuming gives back the exact state, including the
stream positions (`ord`) the state rules compare.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import polars as pl

from kvtrace.analysis.evaluate import Policy
from kvtrace.analysis.funnel import results_frame
from kvtrace.analysis.reconstruct import Reconstructor
from kvtrace.analysis.snapshot import Position, SnapshotError, fingerprint, resume, take
from kvtrace.analysis.sql import conform_results
from kvtrace.schema.recipes import Recipe, RecipeBook
from kvtrace.schema.records import StateSnapshot
from kvtrace.schema.verdicts import LookupResult

if TYPE_CHECKING:
    from kvtrace.store.client import Store

log = logging.getLogger("kvtrace.analysis")

HOUR_NS = 3600 * 10**9
# Periodic snapshots are stored when the read ends (the store's stream is open until then), so
# at most this many are held; a longer read keeps them spread over it, each tens of MB at most.
MAX_HELD = 24
_CHECK_EVERY = 1024  # past `until`, events between looks at whether a range lookup still waits


@dataclass(frozen=True, slots=True)
class RangeRun:
    """What one range analysis read and left behind."""

    since_ns: int
    until_ns: int
    started_at_ns: int  # the snapshot's position it resumed from; 0: from the first event
    events_read: int
    lookups: int
    snapshots_saved: int
    note: str = ""  # why a stored snapshot was not used, when one was not


def range_results(
    store: Store,
    since_ns: int,
    until_ns: int,
    recipes: RecipeBook | Recipe | None = None,
    policy: Policy = Policy(),
    save: bool = True,
    every_ns: int = HOUR_NS,
    settle_ns: int = 60 * 10**9,
    now_ns: int | None = None,
) -> tuple[pl.DataFrame, RangeRun]:
    """Per-lookup results of the lookups made in [since_ns, until_ns), in lookup order."""
    if until_ns <= since_ns:
        raise ValueError(f"--until ({until_ns}) must be after --since ({since_ns})")
    book, print_ = RecipeBook.of(recipes), fingerprint(recipes, policy)
    settled = (time.time_ns() if now_ns is None else now_ns) - settle_ns
    rec, where, params, start, note = Reconstructor(book, policy), "1", {}, 0, ""
    row = store.latest_snapshot(print_, since_ns)
    if row is not None:
        try:
            rec = resume(row, book, policy)
            where = "(ts_ns, source_id, seq) > ({t:Int64}, {s:UInt64}, {q:UInt64})"
            params, start = {"t": row.ts_ns, "s": row.source_id, "q": row.seq}, row.ts_ns
        except SnapshotError as exc:
            note = str(exc)
            log.warning("kvtrace: %s; reading from the first event", note)
    saved: list[StateSnapshot] = []
    next_mark = _next_mark(start, every_ns) if start else 0  # from the first event's time, when no snapshot
    out: list[LookupResult] = []
    last: Position | None = None
    read = 0
    passed = False
    done = False
    for table in store.iter_event_batches(where, params):
        # Fed in runs of rows (Reconstructor.feed_table), cut where an event needs a look first:
        # a snapshot mark, `until`, and past it every _CHECK_EVERY events read.
        ts = table["ts_ns"].to_numpy()
        n, i, looked = table.num_rows, 0, -1  # looked: the row whose looks were taken
        while i < n:
            first = i + 1 if looked == i else i
            j = min(n, first + int(np.searchsorted(ts[first:], next_mark, side="left")))
            if not passed:
                j = min(j, first + int(np.searchsorted(ts[first:], until_ns, side="left")))
            else:
                j = min(j, first + (-(read + first - i)) % _CHECK_EVERY)
            if j > i:
                out.extend(r for r in rec.feed_table(table.slice(i, j - i)) if since_ns <= r.ts_ns < until_ns)
                read += j - i
                last = Position(int(ts[j - 1]), int(table["source_id"][j - 1].as_py()),
                                int(table["seq"][j - 1].as_py()))
                i = j
                continue
            looked, at = i, int(ts[i])
            if at >= next_mark:  # a periodic snapshot, for runs that start later
                if save and last is not None and last.ts_ns < settled and at < until_ns:
                    saved.append(take(rec, last, print_))
                    if len(saved) > MAX_HELD:  # stored when the read ends: keep every other, evenly spread
                        del saved[-2::-2]  # the oldest and the newest stay
                next_mark = _next_mark(at, every_ns)
            if not passed and at >= until_ns:
                passed = True
                if save and last is not None and until_ns <= settled:
                    saved.append(take(rec, last, print_))
                if not rec.pending_since(since_ns, until_ns):
                    done = True
            elif passed and read % _CHECK_EVERY == 0 and not rec.pending_since(since_ns, until_ns):
                done = True
            if done:
                break
        if done:
            break
    if not done and not passed and save and last is not None and until_ns <= settled:
        saved.append(take(rec, last, print_))  # the stream ended before `until`: the state there
    out.extend(r for r in rec.finish() if since_ns <= r.ts_ns < until_ns)
    for snap in saved:
        store.insert_snapshot(snap)
    frame = conform_results(results_frame(out)).sort(["ts_ns", "source_id", "seq"])
    return frame, RangeRun(since_ns, until_ns, start, read, frame.height, len(saved), note)


def _next_mark(ts_ns: int, every_ns: int) -> int:
    return (ts_ns // every_ns + 1) * every_ns if every_ns > 0 else 2**63 - 1
