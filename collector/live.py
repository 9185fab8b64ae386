"""Live reconstruction: the streaming reconstructor run on the ingest stream, one per instance,
writing one verdict row per lookup into the store as its adopt arrives.

Events reach the collector in per-source order but an instance's sources (processes) interleave,
so each instance's events wait in a small reorder buffer and are released in (ts_ns, source_id,
seq) order once they are older than the newest event seen minus `lateness_ns` (or, when the
instance goes quiet, once that much wall time has passed). The buffer is also bounded by count
(`max_held` per instance): a sender whose clock runs slow, or a burst of many events within the
window, releases its oldest early (counted) instead of filling memory. An event later than what
was already released is still used, and counted.

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
if nothing had happened. Verdict rows are keyed by the lookup's id, so a lookup verdicted twice
(by the old collector and again while rebuilding) stays one row.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrace.analysis.evaluate import Policy
from kvtrace.analysis.oracle import ProbeJudge
from kvtrace.analysis.reconstruct import Reconstructor
from kvtrace.collector.metrics import CollectorMetrics
from kvtrace.schema.arrow import conform, to_arrow
from kvtrace.schema.clickhouse import VERDICTS, VERIFICATIONS
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import EventKind
from kvtrace.schema.recipes import Recipe, RecipeBook, RecipeMismatch, UnknownModel
from kvtrace.schema.verdicts import LookupResult, Verification
from kvtrace.store.client import Store

log = logging.getLogger("kvtrace.collector.live")
_MAX_ROWS = 10_000  # verification rows held while their inserts fail (probes are few: rate-limited)


def _last_key(table: pa.Table) -> tuple[int, int, int]:
    i = table.num_rows - 1
    return (table["ts_ns"][i].as_py(), table["source_id"][i].as_py(), table["seq"][i].as_py())


_ORDER = [("ts_ns", "ascending"), ("source_id", "ascending"), ("seq", "ascending")]


def _first_key(table: pa.Table) -> tuple[int, int, int]:
    """The smallest (ts_ns, source_id, seq) of a table's rows."""
    row = table.take(pc.sort_indices(table, sort_keys=_ORDER)[:1])
    return (row["ts_ns"][0].as_py(), row["source_id"][0].as_py(), row["seq"][0].as_py())


def _count_before(table: pa.Table, key: tuple[int, int, int]) -> int:
    """Rows of a sorted table whose (ts_ns, source_id, seq) is below `key`: a prefix."""
    ts = table["ts_ns"].to_numpy()
    at = int(np.searchsorted(ts, key[0], side="left"))
    end = int(np.searchsorted(ts, key[0], side="right"))
    if end > at:  # ties on ts: compare the rest of the key
        src, seq = table["source_id"].to_numpy()[at:end], table["seq"].to_numpy()[at:end]
        at += int(np.count_nonzero((src < key[1]) | ((src == key[1]) & (seq < key[2]))))
    return at


@dataclass(slots=True)
class _Instance:
    reconstructor: Reconstructor
    held: pa.Table | None = None  # sorted: rows released by none yet
    incoming: list[pa.Table] = field(default_factory=list)  # arrived since the last release, unsorted
    count: int = 0  # rows in held and incoming
    newest: dict[str, int] = field(default_factory=dict)  # instance -> its newest event's ts_ns
    released: tuple[int, int, int] = (0, 0, 0)
    last_seen_s: float = 0.0
    probes: ProbeJudge = field(default_factory=ProbeJudge)  # canary probes waiting on their re-run's verdict
    ended: set[tuple[str, int]] = field(default_factory=set)  # (instance, source) of emitters that ended


class LiveReconstruction:
    def __init__(self, store: Store, recipes: RecipeBook | Recipe | None, metrics: CollectorMetrics,
                 policy: Policy = Policy(), lateness_ns: int = 2_000_000_000,
                 rebuild_window_ns: int = 3600 * 10**9, rebuild: bool = True, idle_s: float = 3600.0,
                 max_held: int = 200_000) -> None:
        self.store = store
        self.recipes = RecipeBook.of(recipes)
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
        self.rebuilt_events = 0
        self.verdicts_written = 0
        self.verifications_written = 0
        self.verifications_dropped = 0
        self._rows: list[Verification] = []
        # Models whose given recipe their events contradicted: no verdicts for them (they would
        # be made up), and the reason logged once.
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
            results: list[LookupResult] = []
            parts: dict[str, pa.Table] = {}
            if table.num_rows:
                names = table["instance"].unique().to_pylist()
                for name in names:
                    self._seen[name] = now
                if self.policy.fleet:
                    parts = {"": table}
                elif len(names) == 1:
                    parts = {names[0]: table}
                else:
                    parts = {name: table.filter(pc.equal(table["instance"], name)) for name in names}
                for slot, part in parts.items():
                    inst = self._instances.get(slot)
                    if inst is None:
                        inst = self._instances[slot] = self._start(slot, _first_key(part), results)
                    inst.incoming.append(part)
                    inst.count += part.num_rows
                    newest = part.group_by("instance").aggregate([("ts_ns", "max")]) if self.policy.fleet else \
                        pa.table({"instance": [slot], "ts_ns_max": [pc.max(part["ts_ns"]).as_py()]})
                    for name, ts in zip(newest["instance"].to_pylist(), newest["ts_ns_max"].to_pylist(), strict=True):
                        if ts > inst.newest.get(name, 0):
                            inst.newest[name] = ts
                    inst.last_seen_s = now
            for inst in self._instances.values():
                self._release(inst, self._watermark(inst, now), results)
                self._close_ended(inst, results)
            if parts:  # quiet from now: the time spent judging this batch is not silence
                done = time.monotonic()
                for slot in parts:
                    self._instances[slot].last_seen_s = done
            self.metrics.live_instances.set(len(self._seen))
            return self._write(results)

    def _watermark(self, inst: _Instance, now: float) -> int:
        """Events up to here are released: the newest event of the slowest instance still
        sending (one heard from within the lateness window, in wall time) less the lateness.
        With one instance per reconstructor that is its own newest; under the fleet view a
        sender that falls behind holds the fleet back rather than have its events come late,
        and one gone quiet no longer does."""
        active = [ts for name, ts in inst.newest.items() if now - self._seen.get(name, 0.0) < self.lateness_ns / 1e9]
        return (min(active) if active else max(inst.newest.values(), default=0)) - self.lateness_ns

    def ended(self, sources: list[tuple[str, int]]) -> int:
        """(instance, source id) of emitters whose last stats say they ended, cleanly or not:
        their lookups still without an adopt never get one (a server killed mid-load), so their
        verdicts are written once the source's events are all released, not when the instance
        has been idle for `idle_s`. Returns rows written."""
        with self._lock:
            results: list[LookupResult] = []
            for name, source in sources:
                if (inst := self._instances.get(self._slot(name))) is not None:
                    inst.ended.add((name, source))
                    self._close_ended(inst, results)
            return self._write(results)

    def _close_ended(self, inst: _Instance, results: list[LookupResult]) -> None:
        held: set[tuple[str, int]] = set()
        if inst.ended:
            for table in ([inst.held] if inst.held is not None else []) + inst.incoming:
                pairs = table.group_by(["instance", "source_id"]).aggregate([])
                held.update(zip(pairs["instance"].to_pylist(), pairs["source_id"].to_pylist(), strict=True))
        for name, source in [s for s in inst.ended if s not in held]:
            inst.ended.discard((name, source))
            done = inst.reconstructor.close_source(name, source)
            results.extend(done)
            self._rows.extend(inst.probes.verdicts(done))

    def tick(self, force: bool = False) -> int:
        """Release what quiet instances still hold (or everything, when `force`); finish and
        forget instances idle for `idle_s` (one that comes back is rebuilt from the store)."""
        with self._lock:
            now = time.monotonic()
            results: list[LookupResult] = []
            for slot, inst in list(self._instances.items()):
                quiet = now - inst.last_seen_s
                if force or quiet >= self.lateness_ns / 1e9:
                    self._release(inst, None, results)
                    self._close_ended(inst, results)
                if force or quiet >= self.idle_s:
                    done = inst.reconstructor.finish()
                    results.extend(done)
                    self._rows.extend(inst.probes.verdicts(done))
                    if not force:
                        del self._instances[slot]
            for name, seen in list(self._seen.items()):
                if not force and now - seen >= self.idle_s and self._slot(name) not in self._instances:
                    del self._seen[name]
            self.metrics.live_instances.set(len(self._seen))
            return self._write(results)

    def _start(self, slot: str, first: tuple[int, int, int], results: list[LookupResult]) -> _Instance:
        """A reconstructor for an instance (the fleet's, for slot ""), rebuilt from its stored
        events before `first` (its first event's key)."""
        inst = _Instance(Reconstructor(self.recipes, self.policy))
        if not self.rebuild:
            return inst
        since = first[0] - self.rebuild_window_ns
        mine = "instance = {i:String} AND " if slot else ""
        # The engine's own recipe is in its attach event, however long ago it attached.
        attached = mine + "kind = 'attach' AND ts_ns < {since:Int64}"
        scope = {"i": slot} if slot else {}
        for table in self.store.iter_event_batches(attached, {**scope, "since": since}):
            self._feed(inst, table, results)
        where = (mine + "ts_ns >= {since:Int64} AND "
                 "(ts_ns, source_id, seq) < ({t:Int64}, {s:UInt64}, {q:UInt64})")
        params = {**scope, "since": since, "t": first[0], "s": first[1], "q": first[2]}
        for table in self.store.iter_event_batches(where, params):
            self._feed(inst, table, results)
            self.rebuilt_events += table.num_rows
        if self.rebuilt_events:
            log.info("%s: rebuilt live state from %d stored events", f"instance {slot}" if slot else "the fleet",
                     self.rebuilt_events)
        return inst

    def _release(self, inst: _Instance, watermark: int | None, results: list[LookupResult]) -> None:
        """Feed the held rows up to the watermark (all, when None) in stream order, and the
        oldest beyond `max_held` early."""
        if not inst.incoming:
            if inst.held is None or watermark is not None and inst.count <= self.max_held and \
                    inst.held["ts_ns"][0].as_py() > watermark:
                return
            table = inst.held
        else:
            fresh = pa.concat_tables(inst.incoming).sort_by(_ORDER) if len(inst.incoming) > 1 or \
                inst.incoming[0].num_rows > 1 else inst.incoming[0]
            if inst.held is None:
                table = fresh
            elif _count_before(fresh, _last_key(inst.held)) == 0:  # in order after what is held: no re-sort
                table = pa.concat_tables([inst.held, fresh])
            else:
                table = pa.concat_tables([inst.held, fresh]).sort_by(_ORDER)  # stable: arrival order on ties
            inst.incoming = []
        table = table.combine_chunks()
        n = table.num_rows
        cut = n if watermark is None else int(np.searchsorted(table["ts_ns"].to_numpy(), watermark, side="right"))
        if watermark is not None and n - cut > self.max_held:
            early = n - cut - self.max_held
            self.released_early += early
            self.metrics.live_released_early.inc(early)
            cut += early
        out = table.slice(0, cut)
        inst.held = table.slice(cut) if cut < n else None
        inst.count = n - cut
        if not cut:
            return
        late = _count_before(out, inst.released)
        if late:
            self.late_events += late
            self.metrics.live_skipped.labels("late").inc(late)
        if late < cut:
            inst.released = _last_key(out)
        self._feed(inst, out, results)

    def _feed(self, inst: _Instance, table: pa.Table, results: list[LookupResult]) -> None:
        def use(event: Event) -> list[LookupResult]:
            self._use(inst, event, results)
            return []

        inst.reconstructor.feed_table(table, use, bail=lambda: bool(self.refused))

    def _use(self, inst: _Instance, event: Event, results: list[LookupResult]) -> None:
        if event.kind is EventKind.PROBE:  # a canary's measurement: judged against its re-run's verdict
            self._rows.extend(inst.probes.probes((event,)))
            return
        if self.refused and (event.engine, event.model) in self.refused:
            self.metrics.live_skipped.labels("recipe_mismatch").inc()
            return
        try:
            new = inst.reconstructor.feed(event)
        except UnknownModel:
            self.metrics.live_skipped.labels("unknown_model").inc()
            return
        except RecipeMismatch as exc:
            self.refused[(event.engine, event.model)] = str(exc)
            self.metrics.live_skipped.labels("recipe_mismatch").inc()
            log.error("live verdicts for model %r of engine %r are off: %s", event.model, event.engine, exc)
            return
        if new:
            results.extend(new)
            self._rows.extend(inst.probes.verdicts(new))

    def _write(self, results: list[LookupResult]) -> int:
        if results:
            self.store.insert_arrow(VERDICTS.name, to_arrow(results, LookupResult))
            self.verdicts_written += len(results)
            self.metrics.verdicts.inc(len(results))
        if len(self._rows) > _MAX_ROWS:  # the store has been failing for long: keep the newest
            self.verifications_dropped += len(self._rows) - _MAX_ROWS
            del self._rows[:-_MAX_ROWS]
        if self._rows:  # kept until stored: a failed insert is tried again with the next batch
            self.store.insert_arrow(VERIFICATIONS.name, to_arrow(self._rows, Verification))
            self.verifications_written += len(self._rows)
            self._rows = []
        return len(results)


