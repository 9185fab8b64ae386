"""An emitter's journal: a ring of encoded events in a memory-mapped file, so that what `emit()`
returned from outlives the process, however it ends.

The engine's thread encodes each event (msgpack, the bytes it has in a batch) straight into the
ring and then publishes the new write position; the emitter's worker reads records from the read
position, exports them and publishes the read position once the sink has them. Pages of a shared
file mapping belong to the kernel's page cache, not to the process: a SIGKILL or an out-of-memory
kill leaves everything published there for another process to read. A record is published only
once it is whole, so one cut short by a kill is never read.

Liveness is a lock: the emitter holds an exclusive `flock` on its journal for its life, and the
kernel drops it when the process dies, however it dies. Whoever then gets the lock on a journal
that was not closed owns what is left in it (`Journal.claim`): the shipper process the emitter
started, or the next emitter to start with the same journal directory.

Layout: a 4096-byte header of 8-byte words (host byte order: a journal never leaves its
machine), then the data. The emitting side writes the write position and the sequence end, the
shipping side the read position, each on its own cache line; the emitter's counters follow
(those of emit() as they change, those of the export after each batch), then its identity
(instance, engine) as msgpack. Positions count bytes since the start and only
grow; the offset is position mod size. A record is a 16-byte head (u32 payload length, u32 tag,
u64 seq) then the payload, padded to 16 bytes, so the space left before the end of the data
always holds a head: a record that would straddle the end leaves a padding record there and
starts at the front.

Writers are serialized by the emitter's lock; there is one reader at a time (the emitter's
worker, or whoever claimed the journal after the emitter's process died). The positions are
single aligned 8-byte stores, which a kill cannot tear.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import msgspec

from kvtrace.schema.events import Event

MAGIC = b"KVTJRNL\x00"
HEADER_BYTES = 4096
SUFFIX = ".kvjournal"
PARTIAL = ".new"  # a journal being made: renamed to its final name once its header is written
MIN_DATA_BYTES = 64 << 10


class State(IntEnum):
    OPEN = 0  # its emitter runs, or its process died before shutting down
    STOPPED = 1  # its emitter shut down; records, or its final stats, are left for a taker to ship
    CLOSED = 2  # everything delivered, its final stats too: only removing the file is left


# Header words (byte offset // 8).
_MAGIC = 0
_VERSION = 1
_DATA_BYTES = 2
_SOURCE = 3
_PID = 4
_CREATED = 5
_STATE = 6
_ENDED = 7
_WRITE = 8  # byte 64: the emitting side's line
_SEQ_END = 9
_READ = 16  # byte 128: the shipping side's line
_SHIPPED_SEQ_END = 17
_BATCH_SEQ = 18
_HEARTBEAT = 19
_COUNTERS = 24  # byte 192
COUNTERS = (
    # the emitting side's (written as they change, which is rare)
    "dropped_queue_full", "emit_errors", "dropped_shutdown", "dropped_sampled_out",
    # the shipping side's (written after each export)
    "exported", "rejected", "batches", "export_errors", "dropped_export_failed", "recovered",
)
_COUNTER = {name: _COUNTERS + i for i, name in enumerate(COUNTERS)}
_IDENTITY = 512  # u32 length, then the identity as msgpack
_VERSION_NUMBER = 1

_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+; Python 3.11 lacks the name
_HEAD = struct.Struct("<IIQ")  # payload length, tag, seq
_RECORD = 0x4A52564B  # "KVRJ"
_PAD = 0x4150564B  # "KVPA": the rest of the data up to its end is padding


class JournalError(OSError):
    """A file that is not a journal this version can read."""


class Identity(msgspec.Struct, frozen=True):
    instance: str = ""
    engine: str = ""


@dataclass(frozen=True, slots=True)
class Records:
    """What one `read` found: payloads in seq order, the position after the last, its seq, and
    why reading stopped early (empty when it reached the write position or a limit)."""

    payloads: list[bytes]
    end: int
    last_seq: int
    fault: str = ""
    count: int = 0


def journal_path(directory: str | os.PathLike[str], source_id: int) -> Path:
    return Path(directory) / f"{source_id:016x}{SUFFIX}"


def journals(directory: str | os.PathLike[str]) -> list[Path]:
    """Journals in a directory (live, ended or half made), oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [p for p in d.iterdir() if p.name.endswith((SUFFIX, SUFFIX + PARTIAL))]
    return sorted(found, key=lambda p: _mtime(p))


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _reserve(fd: int, size: int) -> None:
    """Give the file its blocks now: a write through the mapping into a block the file system
    cannot allocate (a full disk) would kill the process with SIGBUS."""
    try:
        os.posix_fallocate(fd, 0, size)
        return
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
    os.ftruncate(fd, 0)
    zeros = bytes(1 << 20)
    written = 0
    while written < size:
        written += os.write(fd, zeros[: min(len(zeros), size - written)])


class Journal:
    """One journal file, mapped and locked; `create` on the emitting side, `claim` for a taker."""

    def __init__(self, path: Path, fd: int, memory: mmap.mmap) -> None:
        self.path = path
        self._fd = fd
        self._mm = memory
        self._words = memoryview(memory)[:HEADER_BYTES].cast("Q")
        self.size = int(self._words[_DATA_BYTES])
        self.source_id = int(self._words[_SOURCE])
        self.pid = int(self._words[_PID])
        (length,) = struct.unpack_from("<I", memory, _IDENTITY)
        try:
            identity = msgspec.msgpack.decode(memory[_IDENTITY + 4 : _IDENTITY + 4 + length], type=Identity)
        except (msgspec.DecodeError, msgspec.ValidationError):
            identity = Identity()
        self.instance = identity.instance
        self.engine = identity.engine
        self._read = int(self._words[_READ])  # read by the emitting side for the room left
        self.closed = False
        self.append = self._appender()

    # -- making and taking -------------------------------------------------------------------------
    @classmethod
    def create(cls, directory: str | os.PathLike[str], source_id: int, data_bytes: int, *, instance: str = "",
               engine: str = "") -> Journal:
        """A new journal for an emitter, locked by this process for its life. Made under a
        temporary name and renamed when whole, so a taker never finds one half made."""
        if data_bytes < MIN_DATA_BYTES:
            raise ValueError(f"a journal needs at least {MIN_DATA_BYTES} bytes of data, not {data_bytes}")
        data_bytes &= ~15
        final = journal_path(directory, source_id)
        final.parent.mkdir(parents=True, exist_ok=True)
        partial = final.with_name(final.name + PARTIAL)
        fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            size = HEADER_BYTES + data_bytes
            _reserve(fd, size)
            memory = mmap.mmap(fd, size)
            words = memoryview(memory)[:HEADER_BYTES].cast("Q")
            words[_VERSION] = _VERSION_NUMBER
            words[_DATA_BYTES] = data_bytes
            words[_SOURCE] = source_id
            words[_PID] = os.getpid()
            words[_CREATED] = words[_HEARTBEAT] = time.time_ns()
            identity = msgspec.msgpack.encode(Identity(instance=instance[:1024], engine=engine[:256]))
            struct.pack_into("<I", memory, _IDENTITY, len(identity))
            memory[_IDENTITY + 4 : _IDENTITY + 4 + len(identity)] = identity
            memory[: len(MAGIC)] = MAGIC  # last: only a whole header says "journal"
            words.release()
            os.rename(partial, final)
        except BaseException:
            os.close(fd)
            partial.unlink(missing_ok=True)
            raise
        return cls(final, fd, memory)

    @classmethod
    def claim(cls, path: str | os.PathLike[str], wait: bool = False) -> Journal | None:
        """Lock a journal whose emitter is gone, or None: its emitter lives (without `wait`), or
        it was removed meanwhile. `wait` blocks until its emitter's process ends. A journal left
        half made is removed. Raises JournalError for a file this version cannot read."""
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                os.close(fd)
                return None
            st = os.fstat(fd)
            if st.st_nlink == 0:  # removed after its emitter shut down, or by another taker
                os.close(fd)
                return None
            if path.name.endswith(PARTIAL) or st.st_size < HEADER_BYTES or os.pread(fd, 8, 0) != MAGIC:
                path.unlink(missing_ok=True)  # its maker died before finishing it: nothing in it
                os.close(fd)
                return None
            memory = mmap.mmap(fd, st.st_size)
        except BaseException:
            os.close(fd)
            raise
        words = memoryview(memory)[:HEADER_BYTES].cast("Q")
        version, data_bytes = int(words[_VERSION]), int(words[_DATA_BYTES])
        words.release()
        if version != _VERSION_NUMBER or HEADER_BYTES + data_bytes != st.st_size or data_bytes & 15:
            memory.close()
            os.close(fd)
            raise JournalError(f"{path}: journal version {version} with {data_bytes} data bytes in a "
                               f"{st.st_size}-byte file; this kvtrace reads version {_VERSION_NUMBER}")
        return cls(path, fd, memory)

    # -- the emitting side ---------------------------------------------------------------------------
    def _appender(self) -> Callable[[Event, int], bool]:
        """`append(event, seq)`: encode one event into the ring and publish it; False when it
        does not fit. Callers serialize calls (the emitter's lock). The record is copied in
        whole before the write position that covers it is stored. A closure over what it
        touches: on the engine's thread every attribute lookup saved counts."""
        buf = bytearray(4096)
        encode_into = msgspec.msgpack.Encoder().encode_into
        pack_into = _HEAD.pack_into
        mm, words, size = self._mm, self._words, self.size
        write = int(words[_WRITE])
        at = write % size
        journal = self

        def append(event: Event, seq: int) -> bool:
            nonlocal write, at
            encode_into(event, buf, 16)
            n = len(buf)
            total = (n + 15) & ~15
            if at + total > size:  # it would straddle the end: pad to it, start at the front
                pad = size - at
                if write + pad + total > journal._read + size:
                    return False
                pack_into(mm, HEADER_BYTES + at, pad - 16, _PAD, 0)
                write += pad
                at = 0
            elif write + total > journal._read + size:
                return False
            pack_into(buf, 0, n - 16, _RECORD, seq)
            start = HEADER_BYTES + at
            mm[start : start + n] = buf
            write += total
            at += total
            if at == size:
                at = 0
            words[_WRITE] = write
            words[_SEQ_END] = seq + 1
            return True

        return append

    def note_drops(self, counters: dict[str, int], seq_end: int) -> None:
        """Persist the emitting side's drop counters (they change rarely) and the sequence end."""
        words = self._words
        for name, value in counters.items():
            words[_COUNTER[name]] = value
        if seq_end > words[_SEQ_END]:
            words[_SEQ_END] = seq_end

    # -- the shipping side ---------------------------------------------------------------------------
    def read(self, max_records: int, max_bytes: int = 1 << 30) -> Records:
        """Records from the read position, in order, up to the limits (at least one record when
        there is one); nothing is released until `release`."""
        return self._scan(self._read, max_records, max_bytes, keep=True)

    def _scan(self, read: int, max_records: int, max_bytes: int, keep: bool) -> Records:
        """Walk the records from position `read`: every head must be whole, tagged, within the
        published part and numbered after the one before; the walk stops at the first that is
        not (a fault the caller reports), never guessing where the next record starts."""
        mm, size = self._mm, self.size
        write = int(self._words[_WRITE])
        payloads: list[bytes] = []
        append = payloads.append
        unpack_from = _HEAD.unpack_from
        count = taken = 0
        last = self.shipped_seq_end - 1
        if write - read > size or read > write:
            return Records([], read, -1, f"write position {write} is not within one lap of read position {read}")
        fault = ""
        at = read % size
        while read < write and count < max_records and (not count or taken < max_bytes):
            length, tag, seq = unpack_from(mm, HEADER_BYTES + at)
            if tag == _RECORD and seq > last:
                total = (length + 31) & ~15
                if at + total <= size and read + total <= write:
                    if keep:
                        base = HEADER_BYTES + 16 + at
                        append(mm[base : base + length])
                    last = seq
                    count += 1
                    taken += total
                    read += total
                    at += total
                    if at == size:
                        at = 0
                    continue
            if tag == _PAD and length == size - at - 16:
                read += size - at
                at = 0
                continue
            if tag == _RECORD and seq <= last:
                fault = f"the record at position {read} has seq {seq}, not after {last}"
            else:
                fault = f"no whole record at position {read} (tag {tag:#x}, length {length})"
            break
        return Records(payloads, read, last if count else -1, fault, count)

    def release(self, end: int, last_seq: int) -> None:
        """Everything before `end` was delivered (or given up on): its space is free again."""
        words = self._words
        if last_seq >= 0:
            words[_SHIPPED_SEQ_END] = last_seq + 1
        words[_READ] = end
        self._read = end

    def skip_to_write(self) -> int:
        """Give up on everything up to the write position (records that cannot be read); returns
        the bytes skipped."""
        write = int(self._words[_WRITE])
        skipped = write - self._read
        self._words[_READ] = write
        self._read = write
        return skipped

    def pending(self) -> int:
        """Records between the read and the write position that a reader would take (a walk
        over their heads, up to the first fault)."""
        return self._scan(self._read, 1 << 62, 1 << 62, keep=False).count

    @property
    def shipped_seq_end(self) -> int:
        return int(self._words[_SHIPPED_SEQ_END])

    @property
    def seq_end(self) -> int:
        """One past the highest sequence number the emitter handed out and accounted for."""
        return int(self._words[_SEQ_END])

    @property
    def write_position(self) -> int:
        return int(self._words[_WRITE])

    def counters(self) -> dict[str, int]:
        words = self._words
        return {name: int(words[i]) for name, i in _COUNTER.items()}

    def note_shipping(self, counters: dict[str, int]) -> None:
        words = self._words
        for name, value in counters.items():
            words[_COUNTER[name]] = value

    @property
    def batch_seq(self) -> int:
        return int(self._words[_BATCH_SEQ])

    def note_batch_seq(self, batch_seq: int) -> None:
        self._words[_BATCH_SEQ] = batch_seq

    def prefault(self, step: int = 256 << 10, stop: Callable[[], bool] = bool) -> bool:
        """Fault the data pages in for writing, from the write position on, ahead of the
        emitting side. The first write to a page of a new file mapping faults (about 7 us on a
        VM: two thirds of what appending an 11 KB lookup cost); done here, on the worker's
        thread, in steps that let the engine's thread run in between, it is off the engine's
        path. Contents are left as they are. False where the kernel cannot (Linux before 5.14,
        other systems): pages then fault in as they are first written, and when `stop()` says
        so before the end."""
        if sys.platform != "linux":
            return False
        page = mmap.PAGESIZE
        step = max(step // page, 1) * page
        first = (int(self._words[_WRITE]) % self.size) // page * page
        offsets = [*range(first, self.size, step), *range(0, first, step)]
        try:
            for offset in offsets:
                if self.closed or stop():
                    return False
                end = first if offset < first else self.size
                self._mm.madvise(_MADV_POPULATE_WRITE, HEADER_BYTES + offset, min(step, end - offset))
                time.sleep(0)  # let the engine's thread have the interpreter between steps
        except (OSError, ValueError):  # EINVAL: an older kernel; ValueError: closed meanwhile
            return False
        return True

    def heartbeat(self) -> None:
        self._words[_HEARTBEAT] = time.time_ns()

    @property
    def last_alive_ns(self) -> int:
        return max(int(self._words[_HEARTBEAT]), int(self._words[_CREATED]))

    @property
    def state(self) -> State:
        return State(int(self._words[_STATE]))

    @property
    def ended_ns(self) -> int:
        return int(self._words[_ENDED])

    # -- the end -----------------------------------------------------------------------------------
    def close(self, state: State, ended_ns: int = 0) -> None:
        """Mark the journal and let go of it: CLOSED removes the file first (a taker waiting on
        the lock then finds it gone); otherwise the file stays for a taker. Safe twice."""
        if self.closed:
            return
        self.closed = True
        words = self._words
        words[_STATE] = state
        if ended_ns:
            words[_ENDED] = ended_ns
        if state is State.CLOSED:
            self.path.unlink(missing_ok=True)
        words.release()
        # Unlocked explicitly: the mapping holds a duplicate of the descriptor, which would keep
        # the lock if the mapping could not be closed.
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        try:
            self._mm.close()
        except BufferError:  # a view still exported: the mapping goes with the process
            pass
        os.close(self._fd)

    def abandon(self) -> None:
        """In a forked child: let go of the parent's journal without touching it. The lock stays
        the parent's (it belongs to the open file, which the parent still holds); the child's
        descriptors, this one and the mapping's duplicate, are closed, as a process's death
        closes them."""
        if self.closed:
            return
        self.closed = True
        self._words.release()
        try:
            self._mm.close()
        except BufferError:
            pass
        os.close(self._fd)
