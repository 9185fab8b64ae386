"""Live reconstruction: the streaming reconstructor run on the ingest stream, one per instance,
writing one verdict row per lookup into the store as its adopt arrives.

Events reach the collector in per-source order but an instance's sources (processes) interleave,
so each instance's events wait in a small reorder buffer and are released in (ts_ns, source_id,
seq) order once they are older than the newest event seen minus `lateness_ns` (or, when the
instance goes quiet, once that much wall time has passed). The buffer is also bounded by count
(`max_held` per instance): a sender whose clock runs slow, or a burst of many events within the
window, releases its oldest early (counted) instead of filling memory. An event later than what
was already released is still used, and counted. Delivery is at least once: the rows a source
had delivered before (a batch sent again after its answer was lost) are dropped as they arrive
(collector.redelivery), so a lookup is never opened twice nor a commit applied twice.

The buffer holds the stored Arrow columns, not events: a release sorts them (Arrow's stable
sort, so equal keys keep their arrival order) and hands the released rows to the
reconstructor as a table, whose object rows never become Python objects (analysis.columnar).

With the fleet view (`Policy(fleet=True)`), every instance is judged against the others at the
moment of each lookup, so all instances share one reconstructor and one reorder buffer,
released in one global order on the fleet's watermark: the newest event of its slowest instance
still sending (heard from within `lateness_ns` of wall time) minus `lateness_ns`, so a sender
that falls behind holds the others back instead of arriving late. The instances' clocks must
agree within `lateness_ns`, as an instance's processes' already must. It
needs the whole fleet's events on this collector: behind a load balancer that spreads
instances over collectors, each judges against the instances it sees.

A collector that takes over an instance (its previous collector died, or the load balancer
moved it) has no state for it: before its first events are used, the instance's earlier events
are read back from the store (within `rebuild_window_ns`) and replayed, so verdicts continue as
if nothing had happened: the rows read back count as delivered (a copy of one that comes later
is dropped), and a sender's row that reaches the store only after the read is fed late, as it
would have been without the takeover. Verdict rows are keyed by the lookup's id, so a lookup verdicted twice
(by the old collector and again while rebuilding) stays one row.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrace.analysis.evaluate import Policy
from kvtrace.collector.drain import StoredEvents
from kvtrace.collector.judge import Judged, JudgeLost, LocalJudges, ProcessJudges
from kvtrace.collector.metrics import CollectorMetrics
from kvtrace.collector.redelivery import Delivered, redelivered
from kvtrace.collector.reorder import Key, ReorderBuffer, count_before, first_key, last_key
from kvtrace.schema.arrow import conform, to_arrow
from kvtrace.schema.clickhouse import VERDICTS, VERIFICATIONS
from kvtrace.schema.events import Event
from kvtrace.schema.recipes import Recipe, RecipeBook
from kvtrace.schema.verdicts import Verification
from kvtrace.store.client import Store

log = logging.getLogger("kvtrace.collector.live")
_MAX_ROWS = 10_000  # verification rows held while their inserts fail (probes are few: rate-limited)
# Verdict rows held between inserts. Why: every insert is a part of the verdicts table, and
# ClickHouse's cost per part is fixed: in parts of one drained chunk's verdicts (~2,000 rows),
# inserting cost ~7.6 us of CPU per row, in parts of ~20,000 ~2.2 us (and fewer parts to merge
# later). Held rows are written when this many have gathered, and at every tick (0.5 s), end of
# an emitter and stop, so a verdict waits at most a tick longer than it did.
_HOLD_VERDICTS = 16_384


@dataclass(slots=True)
class _Instance:
    buffer: ReorderBuffer = field(default_factory=ReorderBuffer)  # rows not yet released
    newest: dict[str, int] = field(default_factory=dict)  # instance -> its newest event's ts_ns
    # The last row fed, from the buffer or read back from the store when the state was (re)built
    # (`_rebuilt`); it only grows.
    released: tuple[int, int, int] = (0, 0, 0)
    first: tuple[int, int, int] | None = None  # its first row's key, until its judge slot is opened
    last_seen_s: float = 0.0
    ended: set[tuple[str, int]] = field(default_factory=set)  # (instance, source) of emitters that ended
    # instance -> source -> the sequence numbers it delivered (collector.redelivery: copies are dropped)
    delivered: dict[str, dict[int, Delivered]] = field(default_factory=dict)


def _delivered_again(inst: _Instance, part: pa.Table, names: list[str]) -> np.ndarray | None:
    """The rows of `part` (of the instances `names`) their sources delivered before, as a mask
    (None: none); all of them counted delivered from now on."""
    delivered = inst.delivered
    sources, seqs = part["source_id"].to_numpy(), part["seq"].to_numpy()
    if len(names) == 1:
        return redelivered(sources, seqs, delivered.setdefault(names[0], {}))
    again = None
    column = part["instance"]
    for name in names:
        rows = np.flatnonzero(pc.equal(column, name).to_numpy(zero_copy_only=False))
        mine = redelivered(sources[rows], seqs[rows], delivered.setdefault(name, {}))
        if mine is not None:
            again = np.zeros(part.num_rows, dtype=bool) if again is None else again
            again[rows[mine]] = True
    return again


class LiveReconstruction:
    def __init__(self, store: Store, recipes: RecipeBook | Recipe | None, metrics: CollectorMetrics,
                 policy: Policy = Policy(), lateness_ns: int = 2_000_000_000,
                 rebuild_window_ns: int = 3600 * 10**9, rebuild: bool = True, idle_s: float = 3600.0,
                 max_held: int = 200_000, own_process: bool = False) -> None:
        self.store = store
        self.recipes = RecipeBook.of(recipes)
        # The reconstructors: in a process of their own (the collector's default, see
        # collector.judge), or in this one.
        self.judges: LocalJudges | ProcessJudges = (ProcessJudges if own_process else LocalJudges)(
            self.recipes, policy)
        self.metrics = metrics
        self.policy = policy
        self.lateness_ns = lateness_ns
        self.rebuild_window_ns = rebuild_window_ns
        self.rebuild = rebuild
        self.idle_s = idle_s  # an instance quiet this long is finished and forgotten (memory stays bounded)
        self.max_held = max(int(max_held), 1)  # events one instance's reorder buffer holds at most
        self.released_early = 0
        self._instances: dict[str, _Instance] = {}  # by instance; with the fleet view, one for all (key "")
        self._seen: dict[str, float] = {}  # instance -> when its last batch came (monotonic seconds)
        self._lock = threading.Lock()
        self.late_events = 0
        self.redelivered_events = 0  # rows a source had delivered before (collector.redelivery)
        self.rebuilt_events = 0
        self.verdicts_written = 0
        self.verifications_written = 0
        self.verifications_dropped = 0
        self._rows: list[Verification] = []
        self._held: list[pa.Table] = []  # verdicts judged, not yet written (see _HOLD_VERDICTS)
        self._held_rows = 0
        # Models whose given recipe their events contradicted (the judges refuse them): no
        # verdicts for them, and the reason logged once.
        self.refused: dict[tuple[str, str], str] = {}

    def instances(self) -> list[str]:
        return sorted(self._seen)

    def _slot(self, instance: str) -> str:
        return "" if self.policy.fleet else instance

    def feed(self, events: list[Event] | pa.Table) -> int:
        """Take stored events (a table in the stored schema, or events); write the verdicts that
        became final. Returns rows written."""
        table = to_arrow(events) if isinstance(events, list) else conform(events)
        with self._lock:
            now = time.monotonic()
            verdicts: list[pa.Table] = []
            parts: dict[str, pa.Table] = {}
            if table.num_rows:  # every part held first: a judge lost below loses none of them
                names = table["instance"].unique().to_pylist()
                for name in names:
                    self._seen[name] = now
                if self.policy.fleet:
                    parts = {"": table}
                elif len(names) == 1:
                    parts = {names[0]: table}
                else:
                    parts = {name: table.filter(pc.equal(table["instance"], name)) for name in names}
                for slot, part in list(parts.items()):
                    inst = self._instances.get(slot)
                    new = inst is None
                    if inst is None:
                        inst = self._instances[slot] = _Instance()
                    part = parts[slot] = self._new_rows(inst, part, names if self.policy.fleet else [slot])
                    if not part.num_rows:  # all delivered before (a new instance's first rows never are)
                        continue
                    if new:
                        inst.first = first_key(part)
                    inst.buffer.add(part)
                    newest = part.group_by("instance").aggregate([("ts_ns", "max")]) if self.policy.fleet \
                        else pa.table({"instance": [slot], "ts_ns_max": [pc.max(part["ts_ns"]).as_py()]})
                    for name, ts in zip(newest["instance"].to_pylist(), newest["ts_ns_max"].to_pylist(), strict=True):
                        if ts > inst.newest.get(name, 0):
                            inst.newest[name] = ts
                    inst.last_seen_s = now

            def release() -> None:
                self._start_new(verdicts)
                for slot, inst in self._instances.items():
                    self._release(slot, inst, self._watermark(inst, now), verdicts)
                    self._close_ended(slot, inst, verdicts)

            self._run_pass(release, verdicts)
            if parts:  # quiet from now: the time spent judging this batch is not silence
                done = time.monotonic()
                for slot in parts:
                    if slot in self._instances:
                        self._instances[slot].last_seen_s = done
            self.metrics.live_instances.set(len(self._seen))
            return self._write(verdicts, hold=True)

    def _new_rows(self, inst: _Instance, part: pa.Table, names: list[str]) -> pa.Table:
        """The part without the rows its sources delivered before (collector.redelivery)."""
        again = _delivered_again(inst, part, names)
        if again is None:
            return part
        n = int(again.sum())
        self.redelivered_events += n
        self.metrics.live_skipped.labels("redelivered").inc(n)
        return part.filter(pa.array(~again))

    def _run_pass(self, one_pass: Callable[[], None], verdicts: list[pa.Table], tries: int = 3) -> None:
        """Run a pass over the instances; when the judge is lost in it, recover (a fresh judge,
        every instance rebuilt from the store up to the last row it was fed) and run the pass
        again. Why again: what the pass had still to do (the other instances' releases, an ended
        emitter's close, a tick's finish, the one that gives lookups whose adopt never came
        their verdicts) would otherwise wait for the next call, and at a stop none comes. Rows
        the lost pass took from a buffer are not lost: they were stored before being held, and
        the rebuild reads them back."""
        for _ in range(tries):
            try:
                one_pass()
                return
            except JudgeLost:
                self._recover(verdicts)

    def _watermark(self, inst: _Instance, now: float) -> int:
        """Events up to here are released: the newest event of the slowest instance still
        sending (one heard from within the lateness window, in wall time) less the lateness.
        With one instance per reconstructor that is its own newest; under the fleet view a
        sender that falls behind holds the fleet back rather than have its events come late,
        and one gone quiet no longer does."""
        active = [ts for name, ts in inst.newest.items() if now - self._seen.get(name, 0.0) < self.lateness_ns / 1e9]
        return (min(active) if active else max(inst.newest.values(), default=0)) - self.lateness_ns

    def ended(self, sources: list[tuple[str, int]]) -> int:
        """(instance, source id) of emitters whose last stats say they ended, cleanly or not, with
        nothing left to send: their lookups still without an adopt never get one (a server
        killed mid-load), so their verdicts are written once the source's events are all
        released, not when the instance has been idle for `idle_s`. Returns rows written."""
        with self._lock:
            verdicts: list[pa.Table] = []

            def close() -> None:
                self._start_new(verdicts)
                for name, source in sources:
                    if (inst := self._instances.get(slot := self._slot(name))) is not None:
                        inst.ended.add((name, source))
                        self._close_ended(slot, inst, verdicts)

            self._run_pass(close, verdicts)
            return self._write(verdicts)

    def _close_ended(self, slot: str, inst: _Instance, verdicts: list[pa.Table]) -> None:
        held: set[tuple[str, int]] = set()
        if inst.ended:
            for table in inst.buffer.tables():
                pairs = table.group_by(["instance", "source_id"]).aggregate([])
                held.update(zip(pairs["instance"].to_pylist(), pairs["source_id"].to_pylist(), strict=True))
        for name, source in [s for s in inst.ended if s not in held]:
            self._absorb(self.judges.close_source(slot, name, source), verdicts)
            inst.ended.discard((name, source))

    def tick(self, force: bool = False) -> int:
        """Release what quiet instances still hold (or everything, when `force`); finish and
        forget instances idle for `idle_s` (one that comes back is rebuilt from the store)."""
        with self._lock:
            now = time.monotonic()
            verdicts: list[pa.Table] = []

            def finish() -> None:
                self._start_new(verdicts)
                for slot, inst in list(self._instances.items()):
                    quiet = now - inst.last_seen_s
                    if force or quiet >= self.lateness_ns / 1e9:
                        self._release(slot, inst, None, verdicts)
                        self._close_ended(slot, inst, verdicts)
                    if force or quiet >= self.idle_s:
                        self._absorb(self.judges.finish(slot), verdicts)
                        if not force:
                            del self._instances[slot]
                            self.judges.forget(slot)

            self._run_pass(finish, verdicts)
            for name, seen in list(self._seen.items()):
                if not force and now - seen >= self.idle_s and self._slot(name) not in self._instances:
                    del self._seen[name]
            self.metrics.live_instances.set(len(self._seen))
            return self._write(verdicts)

    def warm(self, wait: bool = True, timeout_s: float = 60.0) -> None:
        """Start the judge process now, if it has one (`ProcessJudges.spawn`), and with `wait`
        wait until it answers, at most `timeout_s`. One that does not start or answer in time
        is logged, not fatal: ingest goes on, and the first events start another or take the
        late answer first."""
        if isinstance(self.judges, ProcessJudges):
            try:
                if not wait:
                    self.judges.spawn()
                elif not self.judges.warm(timeout_s):
                    log.warning("the live judge process has not answered in %.0f s; serving without waiting for it",
                                timeout_s)
            except Exception as exc:  # noqa: BLE001 - a judge that cannot start must not stop ingest
                log.warning("the live judge process did not start (%s); the first events start another", exc)

    def close(self) -> None:
        """End the judge process, if it has one (after the last tick)."""
        if isinstance(self.judges, ProcessJudges):
            self.judges.close()

    def _start_new(self, verdicts: list[pa.Table]) -> None:
        """Open the judge slots of instances held but not yet started."""
        for slot, inst in self._instances.items():
            if inst.first is not None:
                self._start(slot, inst, verdicts)

    def _start(self, slot: str, inst: _Instance, verdicts: list[pa.Table]) -> None:
        """A reconstructor for a new instance (the fleet's, for slot ""), rebuilt from its stored
        events before its first event's key."""
        assert inst.first is not None
        self.judges.open(slot)
        if self.rebuild:
            self._rebuilt(inst, self._replay(slot, inst, inst.first, False, verdicts))
        inst.first = None

    def _rebuilt(self, inst: _Instance, last: Key | None) -> None:
        """After a replay that fed the stored rows up to `last`: the rows the buffer holds up to
        there were among them (stored before they were held), so they are dropped now; any
        that comes later is new to the store (a sender's late row) and is fed as late, or is
        a copy (dropped as one: the replayed rows count as delivered)."""
        if last is None:
            return
        judged = inst.buffer.drop_through(last)
        if judged:
            self.metrics.live_skipped.labels("rebuilt").inc(judged)
        inst.released = max(inst.released, last)

    def _replay(self, slot: str, inst: _Instance, bound: Key, inclusive: bool, verdicts: list[pa.Table]) -> Key | None:
        """Feed the slot's stored events up to `bound` (within the rebuild window; and the
        engines' attach events, however old); the last key fed. Each row fed counts as
        delivered by its source: a copy of it arriving later (the retry of a batch whose answer
        the collector that died never sent) is dropped as any copy is."""
        since = bound[0] - self.rebuild_window_ns
        mine = "instance = {i:String} AND " if slot else ""
        # The engine's own recipe is in its attach event, however long ago it attached.
        attached = mine + "kind = 'attach' AND ts_ns < {since:Int64}"
        scope = {"i": slot} if slot else {}
        for table in self.store.iter_event_batches(attached, {**scope, "since": since}):
            self._absorb(self.judges.feed(slot, table), verdicts)
        where = (mine + "ts_ns >= {since:Int64} AND (ts_ns, source_id, seq) " + ("<=" if inclusive else "<") +
                 " ({t:Int64}, {s:UInt64}, {q:UInt64})")
        params = {**scope, "since": since, "t": bound[0], "s": bound[1], "q": bound[2]}
        last: Key | None = None
        read = 0
        for table in self.store.iter_event_batches(where, params):
            _delivered_again(inst, table, table["instance"].unique().to_pylist())
            self._absorb(self.judges.feed(slot, table), verdicts)
            read += table.num_rows
            last = last_key(table)
        self.rebuilt_events += read
        if read:
            log.info("%s: rebuilt live state from %d stored events", f"instance {slot}" if slot else "the fleet", read)
        return last

    def _recover(self, verdicts: list[pa.Table], attempts: int = 3) -> None:
        """The judge process died (a fresh one runs): every instance's state is read back from
        the store up to the last row it had judged; what each still holds is fed later as
        usual. Gives up after `attempts` deaths in a row (the instances are then forgotten, and
        rebuilt when their next events come)."""
        for attempt in range(attempts):
            try:
                for slot, inst in self._instances.items():
                    if inst.first is not None:  # never started: as any new instance
                        self._start(slot, inst, verdicts)
                        continue
                    self.judges.open(slot)
                    if self.rebuild:
                        if inst.released != (0, 0, 0):
                            self._rebuilt(inst, self._replay(slot, inst, inst.released, True, verdicts))
                return
            except JudgeLost:
                log.error("the live judge process died again while rebuilding (%d of %d)", attempt + 1, attempts)
        self._instances.clear()

    def _release(self, slot: str, inst: _Instance, watermark: int | None, verdicts: list[pa.Table]) -> None:
        """Feed the held rows up to the watermark (all, when None) in stream order, and the
        oldest beyond `max_held` early."""
        out, early = inst.buffer.release(watermark, self.max_held)
        if early:
            self.released_early += early
            self.metrics.live_released_early.inc(early)
        if out is None:
            return
        cut = out.num_rows
        late = count_before(out, inst.released)
        if late:
            self.late_events += late
            self.metrics.live_skipped.labels("late").inc(late)
        if late < cut:
            inst.released = last_key(out)
        self._absorb(self.judges.feed(slot, out), verdicts)

    def _absorb(self, judged: Judged, verdicts: list[pa.Table]) -> None:
        """Take what a judge call gave: verdicts to write, verifications, counts, refusals."""
        if judged.verdicts is not None and judged.verdicts.num_rows:
            verdicts.append(judged.verdicts)
        self._rows.extend(judged.verifications)
        for reason, n in judged.skipped.items():
            self.metrics.live_skipped.labels(reason).inc(n)
        for (engine, model), why in judged.refused.items():
            if (engine, model) not in self.refused:
                self.refused[(engine, model)] = why
                log.error("live verdicts for model %r of engine %r are off: %s", model, engine, why)

    def _write(self, verdicts: list[pa.Table], hold: bool = False) -> int:
        """Write the verdicts held and these (when `hold`, only once `_HOLD_VERDICTS` rows have
        gathered), and the verification rows; the verdict rows written."""
        for table in verdicts:
            self._held.append(table)
            self._held_rows += table.num_rows
        n = self._held_rows
        if n and not (hold and n < _HOLD_VERDICTS):
            held, self._held, self._held_rows = self._held, [], 0  # a failed insert loses them, as it did one batch's
            self.store.insert_arrow(VERDICTS.name, pa.concat_tables(held))
            self.verdicts_written += n
            self.metrics.verdicts.inc(n)
        else:
            n = 0
        if len(self._rows) > _MAX_ROWS:  # the store has been failing for long: keep the newest
            self.verifications_dropped += len(self._rows) - _MAX_ROWS
            del self._rows[:-_MAX_ROWS]
        if self._rows:  # kept until stored: a failed insert is tried again with the next batch
            self.store.insert_arrow(VERIFICATIONS.name, to_arrow(self._rows, Verification))
            self.verifications_written += len(self._rows)
            self._rows = []
        return n


class LiveWorker:
    """Live reconstruction on a thread of its own, fed through a bounded queue.

    Why: the drain thread stores a chunk and then judged it, so ingest waited for the verdicts
    and the verdicts waited for the insert. The store's insert runs in ClickHouse's threads with
    the GIL released; the reconstruction holds it. On their own threads the next chunk is stored
    while this one is judged. The queue is bounded in events (`max_queued`): when the verdicts
    fall behind, the drain waits for them (the spool takes the slack, then the senders are told
    429), so nothing is judged out of order or dropped and memory stays bounded. Chunks and the
    ends of emitters are taken in the order they were stored, as the drain gave them before.
    """

    def __init__(self, live: LiveReconstruction, max_queued: int = 1_000_000) -> None:
        self.live = live
        self.max_queued = max(int(max_queued), 1)
        self.queued = 0  # events waiting
        self._items: deque[tuple[str, Any]] = deque()
        self._cond = threading.Condition()
        self._busy = False  # an item taken and not yet done
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvtrace-live", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stored(self, events: StoredEvents | pa.Table) -> None:
        """A chunk just stored: judged in turn (read into a table on this worker's thread, not
        the drain's). Waits while the queue is full."""
        self._put("stored", events, events.num_rows)

    def ended(self, sources: list[tuple[str, int]]) -> None:
        self._put("ended", sources, 0)

    def _put(self, what: str, item: Any, rows: int) -> None:
        with self._cond:
            while self.queued and self.queued + rows > self.max_queued and not self._stop:
                self._cond.wait(0.5)
            self._items.append((what, item))
            self.queued += rows
            self.live.metrics.live_queued.set(self.queued)
            self._cond.notify_all()

    def idle(self) -> bool:
        with self._cond:
            return not self._items and not self._busy

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Judge what is queued (within the timeout), then end the thread. Returns True when
        nothing was left."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while (self._items or self._busy) and self._thread.is_alive() and time.monotonic() < deadline:
                self._cond.wait(0.1)
            self._stop = True
            left = len(self._items)
            self._cond.notify_all()
        self._thread.join(max(0.1, deadline - time.monotonic()))
        if left:
            log.warning("stopped with %d stored chunks not yet judged live; a restart rebuilds their state "
                        "from the store", left)
        return not left

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._stop:
                    self._cond.wait(0.5)
                if self._stop:
                    return
                what, item = self._items.popleft()
                self._busy = True
            try:
                if what == "stored":
                    self.live.feed(item.table() if isinstance(item, StoredEvents) else item)
                else:
                    self.live.ended(item)
            except Exception:  # noqa: BLE001 - live analysis must never stop ingest
                log.exception("live reconstruction failed on a chunk; ingest continues")
            finally:
                with self._cond:
                    self._busy = False
                    if what == "stored":
                        self.queued -= item.num_rows
                        self.live.metrics.live_queued.set(self.queued)
                    self._cond.notify_all()
