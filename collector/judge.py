"""The judging half of live reconstruction: one reconstructor (and canary probe judge) per slot,
fed the rows the reorder buffer released, returning verdict rows. In this process
(`LocalJudges`) or in a process of its own (`ProcessJudges`), the same code and the same rows.

Why a process: the collector is one Python process, and judging a lookup is Python work (the
event decoded, the evaluation's wrapper, the verdict built). Sampled under load, the judging
thread held the GIL ~3/4 of the time, so the request threads and the drain waited on it and
ingest slowed with live verdicts on, however many cores the host had. In a process of its own
it has its own interpreter: the collector keeps only the reorder buffer, the store's reads and
the verdicts' inserts. The store stays the collector's (the embedded one can only be opened by
one process): the judge never touches it.

The calls are synchronous (the live thread waits for each, without the GIL), so verdicts come
in the order they would in-process. If the judge process dies, the call raises `JudgeLost`
after starting a fresh one; the collector then forgets its instances, and the next events of
each rebuild its state from the store, as a collector taking over an instance does.
"""

from __future__ import annotations

import logging
import mmap
import multiprocessing
import os
import traceback
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing import reduction
from typing import Any, NoReturn

import msgspec
import pyarrow as pa
import pyarrow.compute as pc

from kvtrace.analysis.evaluate import Policy
from kvtrace.analysis.oracle import ProbeJudge
from kvtrace.analysis.reconstruct import Reconstructor
from kvtrace.schema.arrow import to_arrow
from kvtrace.schema.events import PROBE_PREFIX, Event
from kvtrace.schema.kinds import EventKind
from kvtrace.schema.recipes import RecipeBook, RecipeMismatch, UnknownModel
from kvtrace.schema.verdicts import LookupResult, Verification

log = logging.getLogger("kvtrace.collector.judge")


@dataclass(slots=True)
class Judged:
    """What one call judged: verdict rows (the verdicts table's schema), verification rows,
    events passed over by reason, and the models refused by this call (model key -> why)."""

    verdicts: pa.Table | None = None
    verifications: list[Verification] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)
    refused: dict[tuple[str, str], str] = field(default_factory=dict)


class JudgeLost(RuntimeError):
    """The judge process died (and a fresh one was started): every slot's state is gone."""


@dataclass(slots=True)
class _Slot:
    reconstructor: Reconstructor
    probes: ProbeJudge = field(default_factory=ProbeJudge)  # canary probes waiting on their re-run's verdict


class LocalJudges:
    """The slots' reconstructors in this process."""

    def __init__(self, recipes: RecipeBook, policy: Policy) -> None:
        self.recipes = recipes
        self.policy = policy
        self.slots: dict[str, _Slot] = {}
        # Models whose given recipe their events contradicted: no verdicts for them (they would
        # be made up); once one is, every later row is fed as an event, so each is checked.
        self.refused: dict[tuple[str, str], str] = {}

    def open(self, slot: str) -> None:
        self.slots[slot] = _Slot(Reconstructor(self.recipes, self.policy))

    def ping(self) -> None:
        """Nothing: a call that answers once the judge is up (`ProcessJudges.warm`)."""

    def forget(self, slot: str) -> None:
        self.slots.pop(slot, None)

    def feed(self, slot: str, table: pa.Table) -> Judged:
        one, out = self.slots[slot], Judged()
        rec = one.reconstructor
        rec.verdict_tables = tables = []  # the verdicts judged from the columns, as tables
        try:
            results = rec.feed_table(table, lambda event: self._use(one, event, out), bail=lambda: bool(self.refused))
        finally:
            rec.verdict_tables = None
        return self._done(one, results, out, tables)

    def close_source(self, slot: str, instance: str, source_id: int) -> Judged:
        one = self.slots[slot]
        return self._done(one, one.reconstructor.close_source(instance, source_id), Judged())

    def finish(self, slot: str) -> Judged:
        one = self.slots[slot]
        return self._done(one, one.reconstructor.finish(), Judged())

    def _done(self, one: _Slot, results: list[LookupResult], out: Judged, tables: list[pa.Table] = ()) -> Judged:
        parts = [to_arrow(results, LookupResult)] if results else []
        parts += tables
        if parts:
            out.verdicts = parts[0] if len(parts) == 1 else pa.concat_tables(parts)
            out.verifications.extend(one.probes.verdicts([*results, *_reruns(tables)]))
        return out

    def _use(self, one: _Slot, event: Event, out: Judged) -> list[LookupResult]:
        """Feed one event the reconstructor does not judge from the columns; its verdicts."""
        if event.kind is EventKind.PROBE:  # a canary's measurement: judged against its re-run's verdict
            out.verifications.extend(one.probes.probes((event,)))
            return []
        if self.refused and (event.engine, event.model) in self.refused:
            out.skipped["recipe_mismatch"] += 1
            return []
        try:
            return one.reconstructor.feed(event)
        except UnknownModel:
            out.skipped["unknown_model"] += 1
        except RecipeMismatch as exc:
            self.refused[(event.engine, event.model)] = out.refused[(event.engine, event.model)] = str(exc)
            out.skipped["recipe_mismatch"] += 1
        return []


def _reruns(tables: list[pa.Table]) -> list[LookupResult]:
    """The canary re-runs' verdicts among these (the only ones a probe judge keeps), as results."""
    out = []
    for table in tables:
        mine = table.filter(pc.starts_with(table.column("request_id"), PROBE_PREFIX))
        out += [msgspec.convert(row, LookupResult) for row in mine.to_pylist()]
    return out


@dataclass(slots=True)
class _Error:
    """A call that raised in the judge process: its traceback, raised again here."""

    text: str


@dataclass(slots=True)
class _Stream:
    """A table's place in a message. With a shared file (`size` >= 0) its Arrow IPC stream is
    in the file, `size` bytes from its start; otherwise it follows the message on the pipe as
    raw bytes. Why not in the message: pickling a table slices nothing (a slice of a buffer
    travels with the whole buffer), and a stream pickled inside the message was copied twice
    more on its way (~1.3 us of the collector's CPU per event judged)."""

    size: int = -1


class _Shared:
    """One direction's tables, through a memory file both processes map (Linux's memfd).

    Why: on the pipe a stream of ~500 bytes per event went through the kernel in 64 KiB pieces,
    each a write, a wake-up and a read: ~1.4 us of the collector's CPU per event judged (the
    stream grown in a buffer, then written), more than the rest of its live work together. Here
    the writer lays the stream into the mapping once and the reader copies it out once. The
    calls are synchronous, so one file per direction never holds two tables at a time; the
    reader copies because the writer's next table overwrites this one. A memfd has no name:
    it is gone once both processes have closed it (or died), nothing to clean up after a kill."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._map: mmap.mmap | None = None

    @staticmethod
    def pair() -> tuple[_Shared, _Shared] | None:
        """New files for the collector's tables and the judge's verdicts; None where the system
        has no memfd (the pipe carries the tables)."""
        make = getattr(os, "memfd_create", None)
        if make is None:
            return None
        fds: list[int] = []
        try:
            for name in ("kvtrace-judge-tables", "kvtrace-judge-verdicts"):
                fds.append(make(name, os.MFD_CLOEXEC))
        except OSError as exc:  # out of descriptors, or a sandbox that forbids it: the pipe will do
            log.warning("live judge: no shared memory file (%s); tables go through the pipe", exc)
            for fd in fds:
                os.close(fd)
            return None
        return _Shared(fds[0]), _Shared(fds[1])

    def _mapped(self, size: int) -> mmap.mmap:
        if self._map is None or len(self._map) < size:
            if self._map is not None:
                self._map.close()
                self._map = None
            have = os.fstat(self.fd).st_size
            if have < size:  # the writer grows it (by half again at least: few remaps)
                have = max(size, have + have // 2, 1 << 20)
                os.ftruncate(self.fd, have)
            self._map = mmap.mmap(self.fd, have)
        return self._map

    def put(self, table: pa.Table) -> _Stream:
        mock = pa.MockOutputStream()  # the stream's size, nothing copied: the file is grown to it first
        _write_stream(mock, table)
        size = mock.size()
        _write_stream(pa.FixedSizeBufferWriter(pa.py_buffer(self._mapped(size))), table)
        return _Stream(size)

    def take(self, stream: _Stream) -> pa.Table:
        return pa.ipc.open_stream(pa.py_buffer(self._mapped(stream.size)[:stream.size])).read_all()

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        os.close(self.fd)


def _write_stream(sink: Any, table: pa.Table) -> None:
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def _send_table(conn: Any, table: pa.Table) -> None:
    """Without a shared file: the table's stream on the pipe, after its message."""
    sink = pa.BufferOutputStream()
    _write_stream(sink, table)
    conn.send_bytes(sink.getvalue())


def _mark(table: pa.Table, shared: _Shared | None) -> _Stream:
    """The table's marker in its message: laid in the shared file first, where there is one."""
    return _Stream() if shared is None else shared.put(table)


def _take(conn: Any, stream: _Stream, shared: _Shared | None) -> pa.Table:
    if shared is not None and stream.size >= 0:
        return shared.take(stream)
    return pa.ipc.open_stream(pa.py_buffer(conn.recv_bytes())).read_all()


def _serve(conn: Any, recipes: RecipeBook, policy: Policy, shared: bool) -> None:
    """The judge process: calls in, results out, until the collector closes the pipe. With
    `shared`, the collector first sends the two shared files' descriptors (its tables', this
    one's verdicts')."""
    judges = LocalJudges(recipes, policy)
    try:
        inbound, outbound = (_Shared(reduction.recv_handle(conn)), _Shared(reduction.recv_handle(conn))) \
            if shared else (None, None)
    except (EOFError, OSError):
        return
    while True:
        try:
            name, args = conn.recv()
            args = [_take(conn, a, inbound) if isinstance(a, _Stream) else a for a in args]
        except (EOFError, OSError):  # the collector is gone (stopped, or killed): so is this
            return
        verdicts = None
        try:
            reply: Any = getattr(judges, name)(*args)
            if isinstance(reply, Judged) and reply.verdicts is not None:
                verdicts, reply.verdicts = reply.verdicts, _mark(reply.verdicts, outbound)  # type: ignore[assignment]
        except Exception:  # noqa: BLE001 - the caller logs it; the process goes on
            reply = _Error(traceback.format_exc())
        try:
            conn.send(reply)
            if verdicts is not None and outbound is None:
                _send_table(conn, verdicts)
        except (EOFError, OSError):
            return


class ProcessJudges:
    """`LocalJudges` in a process of its own (see the module's docstring)."""

    def __init__(self, recipes: RecipeBook, policy: Policy) -> None:
        self.recipes = recipes
        self.policy = policy
        self.restarts = 0
        self._ctx = multiprocessing.get_context("spawn")  # never fork: the collector has threads and a store open
        self._proc: Any = None  # started by `spawn`, or else by the first call
        self._shared: tuple[_Shared, _Shared] | None = None
        self._late = 0  # pings `warm` stopped waiting for: their answers are read before the next call's

    def _start(self) -> None:
        self._conn, child = self._ctx.Pipe()
        self._shared = _Shared.pair()
        self._proc = self._ctx.Process(target=_serve, args=(child, self.recipes, self.policy, self._shared is not None),
                                       name="kvtrace-live-judge", daemon=True)
        self._proc.start()
        child.close()
        for one in self._shared or ():
            reduction.send_handle(self._conn, one.fd, self._proc.pid)

    def spawn(self) -> None:
        """Start the process now, without waiting for it (`warm` waits). The collector starts
        its judge with itself: one started by the first events spends its start-up (~0.4-0.5 s
        of CPU: the interpreter, pyarrow and the reconstructor imported) while those events
        flow, taking it from ingest, and the first verdicts wait for it."""
        if self._proc is None:
            self._start()

    def warm(self, timeout_s: float = 60.0) -> bool:
        """Start the process if need be and wait, at most `timeout_s`, until it answers. False
        when it has not answered by then (a machine too loaded to start it, an import that
        hangs): the collector serves anyway, and the next call takes the late answer first.
        Raises `JudgeLost` when it dies starting; the next call starts another."""
        if self._late:
            return False
        try:
            self.spawn()
            self._conn.send(("ping", ()))
            if not self._conn.poll(timeout_s):
                self._late += 1
                return False
            self._conn.recv()
        except (EOFError, OSError) as exc:
            self._lost(exc)
        return True

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _call(self, name: str, *args: Any) -> Any:
        try:
            if self._proc is None:
                self._start()
            while self._late:  # the answer to a ping `warm` stopped waiting for
                self._conn.recv()
                self._late -= 1
            inbound, outbound = self._shared or (None, None)
            self._conn.send((name, tuple(_mark(a, inbound) if isinstance(a, pa.Table) else a for a in args)))
            for table in args:
                if isinstance(table, pa.Table) and inbound is None:
                    _send_table(self._conn, table)
            reply = self._conn.recv()
            if isinstance(reply, Judged) and isinstance(reply.verdicts, _Stream):
                reply.verdicts = _take(self._conn, reply.verdicts, outbound)
        except (EOFError, OSError) as exc:
            self._lost(exc)
        if isinstance(reply, _Error):
            raise RuntimeError(f"live judging failed in its process:\n{reply.text}")
        return reply

    def _lost(self, exc: BaseException) -> NoReturn:
        code = None
        if self._proc is not None:
            self._proc.join(1)
            code = self._proc.exitcode
        log.error("the live judge process died (exit code %s, %s); starting another: instances rebuild "
                  "their state from the store", code, type(exc).__name__)
        self.close()
        self.restarts += 1
        self._proc = None  # the next call starts another
        raise JudgeLost(f"the live judge process died (exit code {code})") from None

    def open(self, slot: str) -> None:
        self._call("open", slot)

    def forget(self, slot: str) -> None:
        self._call("forget", slot)

    def feed(self, slot: str, table: pa.Table) -> Judged:
        return self._call("feed", slot, table)  # type: ignore[no-any-return]

    def close_source(self, slot: str, instance: str, source_id: int) -> Judged:
        return self._call("close_source", slot, instance, source_id)  # type: ignore[no-any-return]

    def finish(self, slot: str) -> Judged:
        return self._call("finish", slot)  # type: ignore[no-any-return]

    def close(self) -> None:
        """End the process (it ends by itself when the pipe closes; killed if it does not)."""
        if self._proc is None:
            for one in self._shared or ():
                one.close()
            self._shared = None
            return
        self._conn.close()
        self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._proc = None
        self._late = 0
        for one in self._shared or ():
            one.close()
        self._shared = None
