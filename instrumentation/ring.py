"""A record ring in shared memory with one consuming process, for a hot path that must
hand raw facts to another process without blocking and without paying for what that process
does with them.

The producer (an engine's scheduler thread) copies a record in and publishes its new write
position; the consumer (kvtrace's own process) reads records and publishes its read position.
Each side writes only its own position, so no lock is shared between the processes (threads of
the producing process take turns through a lock of their own). A record that does not fit in
the free space is dropped and counted: the producer never waits for the consumer. Records never straddle the end of
the buffer: when one would, the tail is marked as padding and the record starts at the front.

Ordering: the data is written before the position that publishes it, and a position is read
before the data it covers. x86 keeps stores (and loads) in order, so there nothing more is done.
Other CPUs need a barrier, which CPython does not expose; there each side acquires and releases
a private lock between the data and the position (as vLLM's shared-memory broadcast does),
which glibc implements with barriers, but that is not a guarantee the language makes.

Losses: a ring made with a `loss_kind` writes a record of that kind (its value: how many
records were dropped) ahead of the first record that fits after a drop, so the consumer knows
exactly where its picture has a hole.

Layout: a 256-byte header (write position at 0, read position at 64, the consumer's flush
acknowledgement at 72 and its counters after that, each on the side that writes it), then the
data. Positions count bytes since the start and only grow; the offset is position mod size.
A record is a 16-byte head (u32 length with padding, u16 kind, u16 blob count, u64 value) then
u32 blob lengths, then the blobs, each padded to 8 bytes; whole records are padded to 16, so
the space left before the end always holds at least a padding head.
"""

from __future__ import annotations

import os
import platform
import struct
import threading
from array import array
from collections.abc import Sequence
from multiprocessing import shared_memory
from typing import Any

import numpy as np

HEADER_BYTES = 256
_WRITE, _READ, _ACK = 0, 64, 72
CONSUMER_COUNTERS = 96  # the consumer's own counters: 8 u64 from here
_HEAD = struct.Struct("<IHHq")
# x86 (total store order) keeps the data's stores ahead of the position's, and loads in order.
_ORDERED = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
_I64 = np.dtype(np.int64)


_LENGTHS = [struct.Struct(f"<{count}I") for count in range(256)]  # a record's blob lengths, by count
PAD = 0  # a record kind no caller uses: the rest of the buffer is padding


def _align(n: int) -> int:
    return (n + 7) & ~7


class RingCorrupt(RuntimeError):
    """The consumer found no record where one must start: the stream cannot be followed past
    it (its memory was written by something other than the producer's protocol). The consumer
    must stop rather than guess; nothing it read before is affected."""


def _view(blob: Any) -> memoryview:
    """A blob of another kind than those copied as they are (`Ring._append`) as a flat byte
    view (a non-contiguous array gathered first)."""
    if type(blob) is np.ndarray and not blob.flags.c_contiguous:
        blob = np.ascontiguousarray(blob)
    return memoryview(blob).cast("B")


class Ring:
    """One side of a ring; `create` on the producer's side, `attach` on the consumer's."""

    def __init__(self, memory: shared_memory.SharedMemory, owner: bool, loss_kind: int = 0) -> None:
        self.memory = memory
        self.owner = owner
        self.loss_kind = loss_kind
        self.closed = False
        self._unreported = 0  # records dropped since the last loss record
        self.size = (memory.size - HEADER_BYTES) // 16 * 16
        self.data = np.ndarray((self.size,), dtype=np.uint8, buffer=memory.buf, offset=HEADER_BYTES)
        self.words = np.ndarray((HEADER_BYTES // 8,), dtype=np.uint64, buffer=memory.buf)
        self.i64 = np.ndarray((memory.size // 8,), dtype=np.int64, buffer=memory.buf)  # for int64 blobs
        self.buf = memory.buf
        self._fence = threading.Lock()
        self._producer = threading.Lock()
        self.dropped = 0
        self.written = 0
        self._write = int(self.words[_WRITE // 8])  # the producer's own position
        self._read_seen = int(self.words[_READ // 8])

    @classmethod
    def create(cls, size: int = 64 << 20, loss_kind: int = 0) -> Ring:
        """A new ring of `size` data bytes, its memory reserved and touched now, so no write
        later faults (a shared-memory file system without room fails here, with an OSError,
        rather than killing the process with SIGBUS on a later write)."""
        if size < 4096:
            raise ValueError(f"a ring needs at least 4096 bytes, not {size}")
        memory = shared_memory.SharedMemory(create=True, size=HEADER_BYTES + size)
        try:
            os.posix_fallocate(memory._fd, 0, memory.size)  # type: ignore[attr-defined]
        except OSError as exc:
            memory.close()
            memory.unlink()
            raise OSError(exc.errno, f"no room in shared memory for a {memory.size:,}-byte ring "
                                     f"({exc.strerror}); give the container more /dev/shm or a smaller ring") from None
        except AttributeError:  # no posix_fallocate (not Linux): the touch below reserves it
            pass
        ring = cls(memory, owner=True, loss_kind=loss_kind)
        ring.words[:] = 0
        ring.data[:] = 0
        return ring

    @classmethod
    def attach(cls, name: str, own_tracker: bool = False) -> Ring:
        """The consumer's side. Attaching registers the segment with this process's resource
        tracker, which unlinks what it holds when the process ends; the creator owns the
        segment, so a process with a tracker of its own (`own_tracker`: not a multiprocessing
        child, which shares its parent's) takes the entry back."""
        memory = shared_memory.SharedMemory(name=name)
        if own_tracker:
            from multiprocessing import resource_tracker

            resource_tracker.unregister(memory._name, "shared_memory")  # type: ignore[attr-defined]
        return cls(memory, owner=False)

    @property
    def name(self) -> str:
        return self.memory.name

    def _load(self, at: int) -> int:
        value = int(self.words[at // 8])
        if not _ORDERED:
            with self._fence:  # what the position covers is read after it
                pass
        return value

    def _store(self, at: int, value: int) -> None:
        if not _ORDERED:
            with self._fence:  # what the position covers is written before it
                pass
        # One aligned 8-byte store. `struct.pack_into` would zero the 8 bytes first and then
        # write them (byte by byte for "<Q"): the other side could read a position of 0 or half
        # written, and a consumer that takes such a write position reads past the records into
        # the last lap's stale bytes and never finds its place again.
        self.words[at >> 3] = value

    # -- producer ----------------------------------------------------------------------------------
    def offer(self, kind: int, value: int = 0, blobs: Sequence[Any] = ()) -> bool:
        """Append one record; False (and counted) when it does not fit. Blobs are bytes-like or
        numpy arrays (copied as their raw bytes; an int64 array may be strided, and is gathered
        straight into the ring). The producer keeps its own write position and the last read
        position it saw, and reads the consumer's only when space runs short. Producers in
        several threads take turns (an uncontended lock: ~0.1 us)."""
        with self._producer:
            if self.closed:
                return False
            if self._unreported and self.loss_kind:
                if not self._append(self.loss_kind, self._unreported, ()):
                    self._unreported += 1
                    return False
                self._unreported = 0
            if self._append(kind, value, blobs) if blobs else self._bare(kind, value):
                return True
            self._unreported += 1
            return False

    def _bare(self, kind: int, value: int) -> bool:
        """A record without blobs (16 bytes, one head), the hot path's most common kind: one
        pack and the position. At a 16-aligned offset such a record always fits before the end."""
        write = self._write
        if not self._room(write, 16):
            return False
        _HEAD.pack_into(self.buf, HEADER_BYTES + write % self.size, 16, kind, 0, value)
        self._write = write = write + 16
        self._store(_WRITE, write)
        self.written += 1
        return True

    def _room(self, write: int, need: int) -> bool:
        """Whether `need` bytes fit ahead of the reader (its position is read only when the last
        one seen leaves too little); counted as a drop when not."""
        if need > self.size - (write - self._read_seen):
            self._read_seen = self._load(_READ)
            if need > self.size - (write - self._read_seen):
                self.dropped += 1
                return False
        return True

    def note_loss(self) -> None:
        """Count a record the producer could not make: reported like a dropped one."""
        with self._producer:
            self._unreported += 1

    def _append(self, kind: int, value: int, blobs: Sequence[Any]) -> bool:
        if len(blobs) >= len(_LENGTHS):
            raise ValueError(f"a ring record holds at most {len(_LENGTHS) - 1} blobs, not {len(blobs)}")
        sizes = []
        for b in blobs:  # the usual blobs go as they are: bytes, 1-D int64 arrays, array("q")
            t = type(b)
            if t is bytes:
                sizes.append(len(b))
            elif (t is np.ndarray and b.ndim == 1 and b.dtype == _I64) or (t is array and b.typecode == "q"):
                sizes.append(len(b) << 3)
            else:
                return self._append_viewed(kind, value, blobs)
        return self._place(kind, value, blobs, sizes)

    def _append_viewed(self, kind: int, value: int, blobs: Sequence[Any]) -> bool:
        views = [_view(b) for b in blobs]
        try:
            return self._place(kind, value, views, [len(v) for v in views])
        finally:  # a view left exported would stop the engine from growing its token array
            for v in views:
                if type(v) is memoryview:
                    v.release()

    def _place(self, kind: int, value: int, views: Sequence[Any], sizes: Sequence[int]) -> bool:
        count = len(views)
        head = _align(_HEAD.size + 4 * count)
        length = head + 15
        for n in sizes:
            length += _align(n)
        length &= ~15  # a tail left is >= one head
        size, write = self.size, self._write
        at = write % size
        pad = size - at if at + length > size else 0
        if not self._room(write, length + pad):
            return False
        buf = self.buf
        if pad:
            _HEAD.pack_into(buf, HEADER_BYTES + at, pad, PAD, 0, 0)
            write, at = write + pad, 0
        base = HEADER_BYTES + at
        _HEAD.pack_into(buf, base, length, kind, count, value)
        if count:
            _LENGTHS[count].pack_into(buf, base + _HEAD.size, *sizes)
            pos = base + head
            for v, n in zip(views, sizes, strict=True):
                if not n:
                    continue
                t = type(v)
                if t is bytes or t is memoryview:
                    buf[pos : pos + n] = v
                else:  # int64 (an array may be strided: gathered in place)
                    self.i64[pos >> 3 : (pos >> 3) + (n >> 3)] = v
                pos += _align(n)
        self._write = write = write + length
        self._store(_WRITE, write)
        self.written += 1
        return True

    def acknowledged(self) -> int:
        """The last flush number the consumer has acknowledged."""
        return self._load(_ACK)

    def consumer_counter(self, i: int) -> int:
        return self._load(CONSUMER_COUNTERS + 8 * i)

    @property
    def position(self) -> int:
        """The producer's write position: bytes written since the start, padding included."""
        return self._write

    def backlog(self) -> int:
        """Bytes written and not yet read."""
        return self._write - self._load(_READ)

    # -- consumer ----------------------------------------------------------------------------------
    def poll(self) -> tuple[int, int, list[memoryview], int] | None:
        """The next record (kind, value, blob views, its end position), or None when there is
        none. The views are valid until `release(end)`."""
        read = int(self.words[_READ // 8])  # only this side writes it
        while True:
            write = self._load(_WRITE)
            if read == write:
                return None
            at = read % self.size
            length, kind, count, value = _HEAD.unpack_from(self.memory.buf, HEADER_BYTES + at)
            # Every record is whole, 16-aligned and ends by the write position: anything else
            # would send the reader into the middle of a record (or round the same spot forever).
            if (length < 16 or length & 15 or at + length > self.size or read + length > write or read & 15
                    or count >= len(_LENGTHS)):
                raise RingCorrupt(f"ring {self.name}: no record at position {read} (head length {length}, "
                                  f"kind {kind}; written up to {write})")
            if kind != PAD:
                break
            read += length
            self._store(_READ, read)
        base = HEADER_BYTES + at
        sizes = _LENGTHS[count].unpack_from(self.memory.buf, base + _HEAD.size) if count else ()
        if count and _align(_HEAD.size + 4 * count) + sum(map(_align, sizes)) > length:
            raise RingCorrupt(f"ring {self.name}: the record at position {read} claims more blob bytes than "
                              f"its length ({length})")
        pos = base + _align(_HEAD.size + 4 * count)
        views = []
        for n in sizes:
            views.append(self.memory.buf[pos : pos + n])
            pos += _align(n)
        return kind, value, views, read + length

    def release(self, end: int) -> None:
        self._store(_READ, end)

    def acknowledge(self, flush: int) -> None:
        self._store(_ACK, flush)

    def set_counter(self, i: int, value: int) -> None:
        self._store(CONSUMER_COUNTERS + 8 * i, value)

    def close(self) -> None:
        """Release the mapping (and, on the creating side, the segment). A producer thread
        still offering sees a closed ring and drops."""
        with self._producer:
            if self.closed:
                return
            self.closed = True
        del self.data, self.words, self.i64, self.buf
        self.memory.close()
        if self.owner:
            try:
                self.memory.unlink()
            except FileNotFoundError:
                pass
