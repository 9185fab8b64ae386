"""The emitter's journal: what emit() returned from reaches the sink however the process ends.

Engine stand-ins are real child processes (tests/journal_child.py) that configure kvtrace from
their environment as an engine plugin does, emit, and are then killed with nothing flushed: the
worker's schedule is a minute, so everything the spool holds afterwards was shipped from the
journal by another process (the detached shipper, or the next emitter to start).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
from emitter_helpers import _restore_global_emitter, wait_until  # noqa: F401 - an autouse fixture

from kvtrace.instrumentation.config import ConfigError, EmitterSettings, JournalMode, SinkKind
from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter, JournalConfig
from kvtrace.instrumentation.journal import HEADER_BYTES, Journal, State, journals
from kvtrace.instrumentation.sinks.base import ExportStatus
from kvtrace.instrumentation.sinks.memory import MemorySink
from kvtrace.instrumentation.sinks.spool import SpoolSink
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import ComponentKind, Ending, EventKind, Tier
from kvtrace.schema.records import EmitterStats
from kvtrace.schema.validation import problems
from kvtrace.schema.wire import SPOOL_SUFFIX, WIRE_VERSION, Batch, RawBatch, decode_batch, encode_batch, read_spool

CHILD = Path(__file__).with_name("journal_child.py")
QUIET = BatchConfig(max_queue_size=1 << 20, max_export_batch_size=1 << 20, schedule_delay_millis=60_000)


def wait_until_slow(predicate, timeout_s: float = 30.0) -> bool:  # noqa: ANN001
    """A child process and its shipper take their time: a longer bound, a slower poll."""
    return wait_until(predicate, timeout_s, poll_s=0.02)


def ev(key: int, keys: int = 0) -> Event:
    return Event(kind=EventKind.COMMIT, component=ComponentKind.FULL_ATTENTION, block_key=key, tier=Tier.DEVICE,
                 more_keys=list(range(1, keys + 1)))


# -- engine stand-ins ----------------------------------------------------------------------------------


def child_env(root: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, KVTRACE_ENABLED="1", KVTRACE_SINK="spool", KVTRACE_SPOOL_DIR=str(root / "spool"),
               KVTRACE_JOURNAL_DIR=str(root / "journal"), KVTRACE_INSTANCE="child-1", KVTRACE_JOURNAL_MIB="4",
               KVTRACE_SCHEDULE_DELAY_MILLIS="60000", KVTRACE_MAX_QUEUE_SIZE="1000000",
               KVTRACE_MAX_EXPORT_BATCH_SIZE="1000000")
    env.update(extra)
    return env


def start_child(root: Path, *args: str, **env: str) -> tuple[subprocess.Popen[str], int]:
    """The child, running, and its emitter's source id."""
    proc = subprocess.Popen([sys.executable, str(CHILD), *args], env=child_env(root, **env), stdout=subprocess.PIPE,
                            stderr=open(root / "child.log", "a"), text=True)  # noqa: SIM115 - the child's
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip().isdigit(), (line, (root / "child.log").read_text())
    return proc, int(line)


def run_child(root: Path, *args: str, **env: str) -> tuple[int, int]:
    """Run the child to its end; its source id and exit status."""
    proc, source = start_child(root, *args, **env)
    assert proc.stdout is not None
    rest = proc.stdout.read()
    code = proc.wait(60)
    assert "emitted" in rest or args and "--forever" in args, (root / "child.log").read_text()
    return source, code


def journals_left(root: Path) -> list[Path]:
    return journals(root / "journal")


def shippers_of(journal: Path) -> list[int]:
    """Processes running the shipper of `journal`."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"kvtrace.instrumentation.shipper" in cmdline and str(journal).encode() in cmdline:
            out.append(int(entry.name))
    return out


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (what a process-tree kill such as vLLM's walks)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


class Spooled(msgspec.Struct):
    seqs: list[int]
    stats: list[EmitterStats]
    batch_seqs: list[int]


def spooled(directory: Path, torn_ok: bool = False) -> dict[int, Spooled]:
    """source_id -> its events' seqs (in file order), stats rows and batch numbers, from every
    spool file; every event must be whole and valid. `torn_ok`: a process killed while its sink
    wrote may leave a torn last frame, which readers skip (its batch was never acknowledged, so
    the journal ships it again)."""
    out: dict[int, Spooled] = {}
    for path in sorted(directory.glob(f"*{SPOOL_SUFFIX}")):
        with path.open("rb") as f:
            scan = read_spool(f, path.name)
        assert torn_ok or scan.torn_tail_bytes == 0, path
        for payload in scan.payloads:
            batch = decode_batch(payload)
            got = out.setdefault(batch.source_id, Spooled([], [], []))
            got.batch_seqs.append(batch.batch_seq)
            for raw in batch.events:
                event = msgspec.msgpack.decode(raw, type=Event)
                assert not problems(event), event
                assert event.source_id == batch.source_id
                got.seqs.append(event.seq)
            if batch.stats is not None:
                got.stats.append(batch.stats)
    return out


# -- the format ------------------------------------------------------------------------------------------


def test_a_raw_batch_encodes_as_the_batch_of_its_events() -> None:
    """The journal's records go out as they are: the collector gets the bytes it gets today."""
    events = [ev(i + 1, keys=i % 5) for i in range(20)]
    for i, e in enumerate(events):
        e.source_id, e.seq, e.ts_ns = 77, i, 1_700_000_000_000_000_000 + i
    stats = EmitterStats(ts_ns=5, source_id=77, emitted=20)
    batch = Batch(source_id=77, batch_seq=3, sent_ns=9, events=events, stats=stats)
    raw = RawBatch(wire_version=WIRE_VERSION, source_id=77, batch_seq=3, sent_ns=9, stats=stats,
                   events=[msgspec.Raw(msgspec.msgpack.encode(e)) for e in events])
    assert encode_batch(raw) == encode_batch(batch)


def test_records_wrap_around_the_ring_and_what_does_not_fit_is_refused(tmp_path: Path) -> None:
    journal = Journal.create(tmp_path, 0xABC, 64 << 10, instance="i", engine="e")
    try:
        seq = 0
        shipped: list[int] = []
        big = ev(1)
        big.more_keys = [(1 << 63) + k for k in range(8000)]  # 72 KB: more than the whole ring
        assert journal.append(big, seq) is False
        for _lap in range(6):  # ~6 laps of the 64 KiB ring
            while journal.append(ev(seq + 1, keys=seq % 40), seq):
                seq += 1
            got = journal.read(10_000)
            assert not got.fault and got.count
            shipped += [msgspec.msgpack.decode(p, type=Event).block_key - 1 for p in got.payloads]
            journal.release(got.end, got.last_seq)
        got = journal.read(10_000)
        assert got.count == 0 and not got.fault
        assert shipped == list(range(seq))
        assert journal.seq_end == seq and journal.shipped_seq_end == seq
    finally:
        journal.close(State.CLOSED)
    assert not journal.path.exists()


def _resident_kib(path: Path) -> int:
    """This process's resident KiB of the mapping of `path` (/proc/self/smaps)."""
    rss, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):  # a mapping's first line: its range ... its path
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            rss += int(line.split()[1])
    return rss


@pytest.mark.skipif(sys.platform != "linux", reason="MADV_POPULATE_WRITE is Linux's")
def test_prefault_brings_the_pages_in_and_leaves_the_records_alone(tmp_path: Path) -> None:
    journal = Journal.create(tmp_path, 0xABD, 4 << 20)
    try:
        for seq in range(100):
            assert journal.append(ev(seq + 1, keys=seq % 40), seq)
        before = _resident_kib(journal.path)
        assert before < 1024  # only what the records touched
        assert journal.prefault(step=64 << 10)
        assert _resident_kib(journal.path) >= 4 << 10  # the whole data area, header aside
        got = journal.read(1000)
        assert not got.fault and got.count == 100
        assert [msgspec.msgpack.decode(p, type=Event).block_key - 1 for p in got.payloads] == list(range(100))
        assert journal.prefault(stop=lambda: True) is False  # asked to stop: stops
    finally:
        journal.close(State.CLOSED)


def _pokes(journal: Journal) -> memoryview:
    return memoryview(journal._mm)  # the test writes what a crash could leave


def test_a_torn_record_is_skipped_never_shipped(tmp_path: Path) -> None:
    """A record cut short by a kill lies past the write position: never read. A head that a
    crash left under a published position (garbage, or a stale one from an earlier lap) stops
    the reader there; what came before ships, and nothing after it is taken for an event."""
    cfg = JournalConfig(str(tmp_path), size_bytes=64 << 10, shipper=None)
    em = BatchEmitter(MemorySink(), QUIET, instance="torn", register_atexit=False, journal=cfg)
    for i in range(10):
        em.emit(ev(i + 1))
    journal = em._journal
    assert journal is not None
    mm = _pokes(journal)
    write = journal.write_position
    # a partial record where the next would go: a head claiming 300 bytes, 40 of them written
    mm[HEADER_BYTES + write : HEADER_BYTES + write + 16] = (300).to_bytes(4, "little") + \
        (0x4A52564B).to_bytes(4, "little") + (10).to_bytes(8, "little")
    mm[HEADER_BYTES + write + 16 : HEADER_BYTES + write + 56] = b"\x99" * 40
    got = journal.read(100)
    assert got.count == 10 and not got.fault
    # the same bytes under a published position: the reader refuses the head (it claims more than is published)
    journal._words[8] = write + 64
    got = journal.read(100)
    assert got.count == 10 and "no whole record" in got.fault
    # a whole-looking record with a stale seq (from an earlier lap)
    mm[HEADER_BYTES + write : HEADER_BYTES + write + 4] = (40).to_bytes(4, "little")
    mm[HEADER_BYTES + write + 8 : HEADER_BYTES + write + 16] = (3).to_bytes(8, "little")
    got = journal.read(100)
    assert got.count == 10 and "seq 3, not after 9" in got.fault
    mm.release()

    # the process dies here; a taker ships the ten whole records and stops at the bad one
    path = journal.path
    journal.abandon()  # what the kernel does with a dead process's files: its lock goes
    sink = MemorySink()
    taken = Journal.claim(path)
    assert taken is not None
    assert BatchEmitter(sink, QUIET, register_atexit=False, adopt=taken).shutdown() is True
    assert [e.block_key for e in sink.events] == list(range(1, 11))
    final = sink.last_stats
    assert final is not None and final.ended is Ending.UNCLEAN
    assert (final.emitted, final.exported, final.recovered) == (10, 10, 10)
    assert not path.exists()


def test_a_whole_record_that_does_not_decode_is_counted_invalid(tmp_path: Path) -> None:
    """A record whose head is sound but whose bytes are not an event (what a machine crash can
    leave, its pages written back in part): the sinks that need events count it as invalid and
    take the rest; it does not fail the batch on every retry."""
    em = _journaled(MemorySink(), tmp_path)
    for i in range(3):
        em.emit(ev(i + 1))
    journal = em._journal
    assert journal is not None
    write = journal.write_position
    mm = _pokes(journal)
    mm[HEADER_BYTES + write : HEADER_BYTES + write + 32] = (16).to_bytes(4, "little") + \
        (0x4A52564B).to_bytes(4, "little") + (3).to_bytes(8, "little") + b"\xc1" * 16  # 0xc1: never msgpack
    journal._words[8], journal._words[9] = write + 32, 4
    mm.release()
    path = journal.path
    journal.abandon()
    sink = MemorySink()
    taken = Journal.claim(path)
    assert taken is not None
    assert BatchEmitter(sink, QUIET, register_atexit=False, adopt=taken).shutdown() is True
    assert [e.seq for e in sink.events] == [0, 1, 2]
    final = sink.last_stats
    assert final is not None and (final.emitted, final.exported, final.dropped_invalid) == (4, 3, 1)
    assert final.queue_depth == 0 and not path.exists()


def test_a_kill_in_the_middle_of_writes_leaves_only_whole_records(tmp_path: Path) -> None:
    """Killed at random while emitting as fast as it can (large events, a journal that fills):
    every event shipped afterwards is whole and valid, and every number it handed out is
    either shipped or counted as dropped."""
    rng = random.Random(7)
    for attempt in range(3):
        root = tmp_path / str(attempt)
        root.mkdir()
        proc, source = start_child(root, "0", "--forever", "--no-shipper", KVTRACE_JOURNAL_MIB="1",
                                   KVTRACE_MAX_EXPORT_BATCH_SIZE="512")
        time.sleep(0.2 + rng.random() * 0.5)
        proc.kill()
        proc.wait(30)
        assert proc.stdout is not None
        proc.stdout.close()
        (left,) = journals_left(root)
        taken = Journal.claim(left)
        assert taken is not None
        settings = EmitterSettings.from_env(child_env(root))
        sink = SpoolSink(root / "spool")
        assert BatchEmitter(sink, settings.batch, register_atexit=False, adopt=taken).shutdown() is True
        got = spooled(root / "spool", torn_ok=True)[source]
        final = got.stats[-1]
        assert final.ended is Ending.UNCLEAN and final.dropped_export_failed == 0
        seqs = set(got.seqs)  # the child's worker shipped some before the kill; the taker the rest
        assert seqs and max(seqs) < final.emitted
        assert final.emitted == len(seqs) + final.dropped_queue_full, (final, len(seqs))


# -- ends ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("end", ["kill", "term"])
def test_a_process_killed_right_after_emit_loses_nothing(tmp_path: Path, end: str) -> None:
    """SIGKILL (or SIGTERM, as vLLM stops its engine core) the moment the last emit() returned:
    the shipper the emitter started ships every event under the dead emitter's source id, then
    its final stats, marked unclean, and removes the journal."""
    n = 3000
    source, code = run_child(tmp_path, str(n), "--end", end, KVTRACE_MAX_EXPORT_BATCH_SIZE="512")
    assert code == -(signal.SIGKILL if end == "kill" else signal.SIGTERM)
    assert wait_until_slow(lambda: not journals_left(tmp_path)), (tmp_path / "child.log").read_text()
    got = spooled(tmp_path / "spool")[source]
    assert sorted(got.seqs) == list(range(n))
    final = got.stats[-1]
    assert final.ended is Ending.UNCLEAN and final.ended_ns > 0
    assert (final.emitted, final.exported, final.recovered, final.dropped) == (n, n, n, 0)
    assert (final.instance, final.engine) == ("child-1", "test")
    assert got.batch_seqs == sorted(got.batch_seqs)
    # Every batch the shipper sent says the emitter ended, and how much is still to go: only
    # the last says nothing (the collector closes the dead emitter's open lookups at that one).
    depths = [st.queue_depth for st in got.stats if st.ended is Ending.UNCLEAN]
    assert depths == sorted(depths, reverse=True) and depths[-1] == 0 and depths[0] > 0, depths


def test_the_shipper_is_outside_the_engines_process_tree(tmp_path: Path) -> None:
    """vLLM kills its engine core with its whole process tree; the shipper is in none of it, in
    a session of its own, waiting; it ships once the engine is gone."""
    proc, source = start_child(tmp_path, "500", "--end", "hang")
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "emitted"
    (journal,) = journals_left(tmp_path)
    (shipper,) = shippers_of(journal)
    assert shipper not in descendants(proc.pid)
    assert os.getsid(shipper) != os.getsid(proc.pid)
    time.sleep(0.3)
    assert shippers_of(journal) == [shipper] and journal.exists()  # it waits while the engine lives
    for pid in [*descendants(proc.pid), proc.pid]:  # vLLM's kill_process_tree
        os.kill(pid, signal.SIGKILL)
    proc.wait(30)
    proc.stdout.close()
    assert wait_until_slow(lambda: not journal.exists() and not shippers_of(journal))
    got = spooled(tmp_path / "spool")[source]
    assert sorted(got.seqs) == list(range(500)) and got.stats[-1].ended is Ending.UNCLEAN


def test_the_next_start_ships_what_a_dead_emitter_left(tmp_path: Path) -> None:
    """No shipper (or one that was killed too): the journal waits on disk, and the next emitter
    to start with the same journal directory ships it before its own events."""
    n = 2000
    source, code = run_child(tmp_path, str(n), "--end", "kill", "--no-shipper")
    assert code == -signal.SIGKILL
    (left,) = journals_left(tmp_path)
    assert not shippers_of(left)

    settings = EmitterSettings.from_env(child_env(tmp_path, KVTRACE_SCHEDULE_DELAY_MILLIS="20"))
    cfg = JournalConfig(str(tmp_path / "journal"), 1 << 20, shipper=None)
    em = BatchEmitter(SpoolSink(tmp_path / "spool"), settings.batch, instance="next", register_atexit=False,
                      journal=cfg)
    for i in range(10):
        em.emit(ev(i + 1))
    assert wait_until_slow(lambda: not left.exists())
    assert em.force_flush(10_000) is True
    assert em.shutdown() is True
    assert not journals_left(tmp_path)

    got = spooled(tmp_path / "spool")
    dead, alive = got[source], got[em.source_id]
    assert sorted(dead.seqs) == list(range(n))
    assert dead.stats[-1].ended is Ending.UNCLEAN and dead.stats[-1].recovered == n
    assert dead.stats[-1].instance == "child-1"
    assert alive.seqs == list(range(10)) and alive.stats[-1].ended is Ending.CLEAN


def test_a_clean_shutdown_leaves_no_journal_and_says_clean(tmp_path: Path) -> None:
    source, code = run_child(tmp_path, "1000", "--end", "exit")
    assert code == 0
    assert not journals_left(tmp_path)
    assert wait_until_slow(lambda: not shippers_of(tmp_path / "journal" / f"{source:016x}.kvjournal"))
    got = spooled(tmp_path / "spool")[source]
    assert sorted(got.seqs) == list(range(1000))
    final = got.stats[-1]
    assert final.ended is Ending.CLEAN and final.recovered == 0 and final.emitted == final.exported == 1000


def test_a_full_journal_counts_its_drops_and_db_status_shows_the_gap(tmp_path: Path, store, store_dsn: str,  # noqa: ANN001
                                                                    capsys) -> None:  # noqa: ANN001
    """The sink stalls, the journal fills, emit() drops and counts, never waits. After a kill
    the shipper ships what the journal held; `kvtrace db status` names the instance that ended
    unclean and its gap, all of it the counted drops."""
    from kvtrace.cli.main import main as cli
    from kvtrace.store.ingest import ingest_file

    n = 20_000
    started = time.monotonic()
    source, code = run_child(tmp_path, str(n), "--end", "kill", "--stalled-sink", KVTRACE_JOURNAL_MIB="1",
                             KVTRACE_MAX_EXPORT_BATCH_SIZE="100", KVTRACE_SCHEDULE_DELAY_MILLIS="5")
    assert code == -signal.SIGKILL and time.monotonic() - started < 30
    assert wait_until_slow(lambda: not journals_left(tmp_path))
    got = spooled(tmp_path / "spool")[source]
    final = got.stats[-1]
    assert final.ended is Ending.UNCLEAN and final.emitted == n
    assert final.dropped_queue_full > n // 2 and len(set(got.seqs)) == n - final.dropped_queue_full

    for path in sorted((tmp_path / "spool").glob(f"*{SPOOL_SUFFIX}")):
        ingest_file(store, path)
    (end,) = store.emitter_endings()
    assert (end.source_id, end.instance, end.engine, end.ended) == (source, "child-1", "test", Ending.UNCLEAN)
    assert (end.emitted, end.stored) == (n, n - final.dropped_queue_full)
    assert end.missing == end.dropped == final.dropped_queue_full and end.unaccounted == 0
    assert [e.source_id for e in store.emitter_endings(None)] == [source]
    assert store.emitter_endings(Ending.CLEAN) == []

    assert cli(["--dsn", store_dsn, "db", "status"]) == 0
    out = capsys.readouterr().out
    assert "ended unclean:   1 emitters" in out
    assert f"child-1 (test, source {source:016x})" in out
    assert f"{end.missing:,} missing ({end.dropped:,} dropped as counted, 0 unaccounted)" in out

    # the default alert rules fire on it, counting the gap; the dashboards' panel lists it
    from kvtrace.dashboards.alerts import AlertLoop, Evaluator, rules_from_path
    from kvtrace.dashboards.queries import by_key, render

    said: list[str] = []
    loop = AlertLoop(Evaluator(store, rules_from_path(None)), out=said.append)
    fired = [a for a in loop.cycle() if a.rule.name == "engine-ended-unclean"]
    assert [(a.labels, a.value) for a in fired] == [((("instance", "child-1"),), 1.0)], said
    description = fired[0].payload()["annotations"]["description"]
    assert f"test source {source:016x} ended unclean" in description
    assert f"{end.missing:,} events missing ({end.dropped:,} dropped as counted, 0 unaccounted)" in description
    assert any(line.startswith("FIRING   engine-ended-unclean instance=child-1") for line in said), said
    lo, hi = end.ended_ns // 10**9 - 60, end.ended_ns // 10**9 + 60
    (row,) = store.query_polars(render(by_key("endings"), store.db, lo, hi)).to_dicts()
    assert (row["instance"], row["ended"], row["source"], row["missing"], row["dropped"], row["stored"]) == (
        "child-1", "unclean", f"{source:016x}", end.missing, end.dropped, end.stored)
    assert store.query_polars(render(by_key("endings"), store.db, lo, hi, variables={"instance": "x"})).is_empty()


# -- in one process ------------------------------------------------------------------------------------


def _journaled(sink: object, tmp_path: Path, config: BatchConfig = QUIET, size: int = 4 << 20) -> BatchEmitter:
    return BatchEmitter(sink, config, instance="here", register_atexit=False,  # type: ignore[arg-type]
                        journal=JournalConfig(str(tmp_path / "journal"), size, shipper=None))


@pytest.mark.parametrize("sink_kind", ["memory", "spool"])
def test_emit_from_many_threads_keeps_every_record_whole(tmp_path: Path, sink_kind: str) -> None:
    sink = MemorySink() if sink_kind == "memory" else SpoolSink(tmp_path / "spool")
    # A journal that holds every record (24,000 of ~180 bytes): in the default 4 MiB one they
    # fit only while the worker ships alongside, and on a loaded machine it fell behind, the
    # ring filled and emit dropped (counted, as it must: it never blocks), failing this test.
    em = _journaled(sink, tmp_path, BatchConfig(max_queue_size=65536, max_export_batch_size=1024,
                                                schedule_delay_millis=5), size=16 << 20)
    threads_n, per_thread = 8, 3000
    barrier = threading.Barrier(threads_n)

    def work(t: int) -> None:
        barrier.wait()
        for i in range(per_thread):
            em.emit(ev((t << 32) | (i + 1), keys=i % 7))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(threads_n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert em.force_flush(30_000) is True
    total = threads_n * per_thread
    st = em.stats()
    assert st.emitted == st.exported == total and st.dropped == 0 and st.queue_depth == 0
    assert em.shutdown() is True
    if isinstance(sink, MemorySink):
        got = sink.events
    else:
        got = [msgspec.msgpack.decode(r, type=Event)
               for p in sorted((tmp_path / "spool").glob(f"*{SPOOL_SUFFIX}"))
               for payload in read_spool(p.open("rb")).payloads for r in decode_batch(payload).events]
    assert sorted(e.seq for e in got) == list(range(total))
    for t in range(threads_n):
        mine = [e for e in got if e.block_key >> 32 == t]
        assert [e.block_key & 0xFFFFFFFF for e in mine] == list(range(1, per_thread + 1))
        assert all(e.more_keys == list(range(1, ((e.block_key & 0xFFFFFFFF) - 1) % 7 + 1)) for e in mine)
    assert not journals_left(tmp_path)


def test_a_journaled_emitter_keeps_the_emitters_contract(tmp_path: Path) -> None:
    sink = MemorySink()
    em = _journaled(sink, tmp_path)
    events = [ev(i + 1) for i in range(100)]
    for i, e in enumerate(events):
        em.emit(e)
        assert (e.source_id, e.seq) == (em.source_id, i) and e.ts_ns > 0
    em.emit(None)  # type: ignore[arg-type]
    st = em.stats()
    assert (st.emitted, st.queue_depth, st.dropped_invalid) == (101, 100, 1)
    assert em.force_flush(10_000) is True
    assert [e.seq for e in sink.events] == list(range(100))  # 100 was the non-event: a counted gap
    assert em.shutdown() is True and em.shutdown() is True
    late = ev(999)
    em.emit(late)
    assert late.seq == 101
    final = em.stats()
    assert (final.emitted, final.exported, final.dropped_shutdown, final.dropped_invalid) == (102, 100, 1, 1)
    assert sink.last_stats is not None and sink.last_stats.ended is Ending.CLEAN
    assert sink.shutdowns == 1 and not journals_left(tmp_path)


def test_a_shutdown_that_cannot_deliver_leaves_the_journal_to_the_next_taker(tmp_path: Path) -> None:
    """Nothing is dropped at shutdown: what the sink did not take stays in the journal (marked
    stopped, not closed), and whoever takes it next ships it, and the final stats say clean."""
    sink = MemorySink()
    sink.fail_with = ExportStatus.RETRY
    em = _journaled(sink, tmp_path, BatchConfig(schedule_delay_millis=60_000, shutdown_timeout_millis=300,
                                                retry_backoff_millis=50, max_export_attempts=100))
    for i in range(50):
        em.emit(ev(i + 1))
    assert em.shutdown() is False
    # its last try, at the deadline
    assert em._worker is not None and wait_until_slow(lambda: not em._worker.is_alive())
    st = em.stats()
    assert st.dropped == 0 and st.queue_depth == 50
    (left,) = journals_left(tmp_path)

    refusing = MemorySink()
    refusing.fail_with = ExportStatus.RETRY
    taken = Journal.claim(left)
    assert taken is not None and taken.state is State.STOPPED
    quick = BatchConfig(shutdown_timeout_millis=200, retry_backoff_millis=20, max_export_attempts=100)
    assert BatchEmitter(refusing, quick, register_atexit=False, adopt=taken).shutdown() is False
    assert left.exists()  # still there, as it was, for the next one

    good = MemorySink()
    taken = Journal.claim(left)
    assert taken is not None and taken.state is State.STOPPED and taken.source_id == em.source_id
    assert BatchEmitter(good, quick, register_atexit=False, adopt=taken).shutdown() is True
    assert [e.seq for e in good.events] == list(range(50))
    final = good.last_stats
    assert final is not None and final.ended is Ending.CLEAN and final.ended_ns == em.stats().ended_ns
    assert (final.emitted, final.exported, final.recovered, final.dropped) == (50, 50, 50, 0)
    # numbered on from the attempts before it, the emitter's own and the first taker's (but for the
    # emitter's last attempt, when its worker made it after the journal was closed)
    assert final.batches == 1 and good.batches[0].batch_seq - 1 in (sink.calls + refusing.calls,
                                                                    sink.calls + refusing.calls - 1)
    assert not left.exists()


def test_a_batch_landing_after_the_shutdown_deadline_is_no_failure(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A sink slower than the shutdown deadline: shutdown closes the journal and moves on, and the
    worker's batch lands afterwards. The journal keeps it for the next taker (the store drops the
    repeat), and nothing reports a failure (it did: a write to the closed journal, at every exit)."""

    class Slow(MemorySink):
        def export(self, batch):  # type: ignore[no-untyped-def]
            time.sleep(0.6)
            return super().export(batch)

    sink = Slow()
    em = _journaled(sink, tmp_path, BatchConfig(schedule_delay_millis=60_000, shutdown_timeout_millis=300))
    for i in range(50):
        em.emit(ev(i + 1))
    with caplog.at_level("WARNING", logger="kvtrace"):
        assert em.shutdown() is False
        assert em._worker is not None and wait_until_slow(lambda: not em._worker.is_alive())
    assert [e.seq for e in sink.events] == list(range(50))
    assert not [r for r in caplog.records if "failed" in r.getMessage()]
    (left,) = journals_left(tmp_path)
    taken = Journal.claim(left)
    assert taken is not None and taken.state is State.STOPPED


def test_a_live_emitters_journal_cannot_be_claimed(tmp_path: Path) -> None:
    em = _journaled(MemorySink(), tmp_path)
    (path,) = journals_left(tmp_path)
    assert Journal.claim(path) is None
    assert em.shutdown() is True
    assert not path.exists() and Journal.claim(path) is None


def test_a_forked_child_makes_its_own_journal_at_its_first_emit(tmp_path: Path) -> None:
    sink = SpoolSink(tmp_path / "spool")
    em = _journaled(sink, tmp_path, BatchConfig(schedule_delay_millis=5))
    for i in range(20):
        em.emit(ev(i + 1))
    assert em.force_flush(10_000) is True
    (parent_journal,) = journals_left(tmp_path)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            before = len(journals(tmp_path / "journal"))
            for i in range(25):
                em.emit(ev(1000 + i))
            during = len(journals(tmp_path / "journal"))
            ok = em.shutdown()
            os.write(w, f"{em.source_id} {before} {during} {int(ok)}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    out = os.read(r, 200).decode().split()
    os.close(r)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    child_id, before, during, ok = map(int, out)
    assert child_id != em.source_id and (before, during, ok) == (1, 2, 1)
    assert journals_left(tmp_path) == [parent_journal]
    assert Journal.claim(parent_journal) is None  # the child let go of it; the parent still holds it
    for i in range(5):
        em.emit(ev(2000 + i))
    assert em.shutdown() is True
    got = spooled(tmp_path / "spool")
    assert got[em.source_id].seqs == list(range(25)) and got[child_id].seqs == list(range(25))


# -- settings ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("env", "sink", "journaled"), [
    ({"KVTRACE_COLLECTOR_URL": "http://c:1"}, SinkKind.COLLECTOR, True),
    ({}, SinkKind.SPOOL, True),
    ({"KVTRACE_DSN": "chdb:///x"}, SinkKind.STORE, False),
    ({"KVTRACE_DSN": "chdb:///x", "KVTRACE_JOURNAL": "on"}, SinkKind.STORE, True),
    ({"KVTRACE_JOURNAL": "off"}, SinkKind.SPOOL, False),
    ({"KVTRACE_JOURNAL": "0"}, SinkKind.SPOOL, False),
    ({"KVTRACE_JOURNAL": "auto"}, SinkKind.SPOOL, True),
])
def test_the_journal_is_on_where_events_leave_the_process(env: dict[str, str], sink: SinkKind,
                                                          journaled: bool) -> None:
    s = EmitterSettings.from_env(env)
    assert (s.sink, s.journaled) == (sink, journaled)
    assert (s.journal_config() is not None) == journaled


def test_journal_settings_are_read_checked_and_handed_to_the_shipper(tmp_path: Path) -> None:
    env = {"KVTRACE_ENABLED": "1", "KVTRACE_COLLECTOR_URL": "http://c:1", "KVTRACE_TOKEN": "t0k",
           "KVTRACE_JOURNAL": "on", "KVTRACE_JOURNAL_DIR": str(tmp_path), "KVTRACE_JOURNAL_MIB": "8",
           "KVTRACE_INSTANCE": "n1", "KVTRACE_SAMPLE_RATE": "0.25", "KVTRACE_MAX_QUEUE_SIZE": "9000"}
    s = EmitterSettings.from_env(env)
    assert (s.journal, s.journal_dir, s.journal_mib) == (JournalMode.ON, str(tmp_path), 8)
    cfg = s.journal_config()
    assert cfg is not None and (cfg.directory, cfg.size_bytes) == (str(tmp_path), 8 << 20)
    assert EmitterSettings.from_env(s.environment()) == s  # what the shipper reads is what was set
    with pytest.raises(ConfigError, match="KVTRACE_JOURNAL="):
        EmitterSettings.from_env({"KVTRACE_JOURNAL": "maybe"})
    with pytest.raises(ConfigError, match="KVTRACE_JOURNAL_MIB"):
        EmitterSettings.from_env({"KVTRACE_JOURNAL_MIB": "0"})


def test_no_room_for_a_journal_falls_back_to_memory(tmp_path: Path, caplog) -> None:  # noqa: ANN001
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    sink = MemorySink()
    em = BatchEmitter(sink, QUIET, register_atexit=False, journal=JournalConfig(str(blocked), 1 << 20))
    em.emit(ev(1))
    assert em.shutdown() is True and [e.block_key for e in sink.events] == [1]
    assert "no journal in" in caplog.text
