"""The shared-memory record ring: records come out as they went in, across the wrap and across
processes; a full ring drops and counts instead of waiting."""

from __future__ import annotations

import numpy as np
import pytest

from kvtrace.instrumentation.ring import Ring, RingCorrupt


def _drain(ring: Ring) -> list[tuple[int, int, list[bytes]]]:
    out = []
    while (got := ring.poll()) is not None:
        kind, value, views, end = got
        out.append((kind, value, [bytes(v) for v in views]))
        for v in views:
            v.release()
        ring.release(end)
    return out


def test_records_round_trip_across_the_wrap() -> None:
    ring = Ring.create(4096)
    try:
        sent, got = [], []
        rng = np.random.default_rng(7)
        for i in range(400):  # ~60 laps of the buffer, records of uneven sizes
            blobs = [rng.integers(0, 255, int(rng.integers(0, 300)), dtype=np.uint8).tobytes() for _ in range(i % 3)]
            assert ring.offer(i % 7 + 1, i - 200, blobs)
            sent.append((i % 7 + 1, i - 200, blobs))
            if i % 5 == 4:
                got += _drain(ring)
        got += _drain(ring)
        assert got == sent
        assert ring.dropped == 0
    finally:
        ring.close()


@pytest.mark.parametrize("where", ["misaligned", "overwritten"])
def test_a_reader_off_the_record_stream_stops_instead_of_spinning(where: str) -> None:
    """A read position inside a record (seen once in an orphaned resolver, which then read the
    same zero-length 'record' forever at full CPU), or a head overwritten with garbage: the
    consumer raises rather than guessing or going round the same spot."""
    ring = Ring.create(4096)
    try:
        for i in range(3):
            assert ring.offer(1, i, [np.arange(8, dtype=np.int64)])
        kind, value, views, end = ring.poll()
        for v in views:
            v.release()
        if where == "misaligned":
            ring.release(end + 4)
        else:
            ring.release(end)
            ring.buf[256 + end : 256 + end + 16] = b"\x00" * 16  # the next head: length 0
        with pytest.raises(RingCorrupt, match="no record at position"):
            ring.poll()
    finally:
        ring.close()


def test_numpy_blobs_are_their_bytes() -> None:
    ring = Ring.create(4096)
    try:
        keys = np.arange(5, dtype=np.int64) * -3
        assert ring.offer(2, 0, [keys, b"abc"])
        ((kind, value, (raw, text)),) = _drain(ring)
        assert np.frombuffer(raw, dtype=np.int64).tolist() == keys.tolist() and text == b"abc"
    finally:
        ring.close()


def test_strided_int64_blobs_are_gathered_and_other_arrays_copied_as_bytes() -> None:
    """Page starts travel as a strided view of a slot array (every page's first slot)."""
    ring = Ring.create(4096)
    try:
        slots = np.arange(160, dtype=np.int64) + 1000
        small = np.arange(6, dtype=np.int32)[::2]  # not int64, not contiguous: copied as its bytes
        assert ring.offer(3, 7, [slots[::16], slots[5:9], small])
        ((kind, value, (pages, run, ints)),) = _drain(ring)
        assert (kind, value) == (3, 7)
        assert np.frombuffer(pages, dtype=np.int64).tolist() == list(range(1000, 1160, 16))
        assert np.frombuffer(run, dtype=np.int64).tolist() == [1005, 1006, 1007, 1008]
        assert np.frombuffer(ints, dtype=np.int32).tolist() == [0, 2, 4]
        with pytest.raises(ValueError, match="at most 255 blobs"):
            ring.offer(1, 0, [b"x"] * 300)
    finally:
        ring.close()


def test_a_full_ring_drops_and_counts_without_waiting() -> None:
    ring = Ring.create(4096)
    try:
        payload = bytes(1000)
        accepted = sum(ring.offer(1, 0, [payload]) for _ in range(10))
        assert accepted == 4 and ring.dropped == 6
        assert len(_drain(ring)) == 4
        assert ring.offer(1, 0, [payload])  # room again once read
        with pytest.raises(ValueError, match="at least 4096"):
            Ring.create(100)
    finally:
        ring.close()


CONSUMER = """
import sys
import numpy as np
from kvtrace.instrumentation.ring import Ring
ring = Ring.attach(sys.argv[1], own_tracker=True)
total, seen, count = 0, 0, int(sys.argv[2])
while seen < count:
    got = ring.poll()
    if got is None:
        continue
    kind, value, views, end = got
    total += value + int(np.frombuffer(views[0], dtype=np.int64).sum())
    for v in views:
        v.release()
    ring.release(end)
    seen += 1
ring.acknowledge(count)
ring.close()
print(total)
"""


def test_another_process_reads_what_this_one_wrote() -> None:
    """As the resolver does: a fresh interpreter attaches by name and reads while this one
    writes, through many wraps of a small ring."""
    import subprocess
    import sys

    ring = Ring.create(1 << 16)
    child = subprocess.Popen([sys.executable, "-c", CONSUMER, ring.name, "2000"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        want, sent = 0, 0
        while sent < 2000:
            block = np.arange(sent % 50, dtype=np.int64)
            if ring.offer(1, sent, [block]):
                want += sent + int(block.sum())
                sent += 1
            elif child.poll() is not None:
                break
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        assert int(out) == want
        assert ring.acknowledged() == 2000
    finally:
        if child.poll() is None:
            child.kill()
        ring.close()


def test_threads_of_the_producing_process_take_turns() -> None:
    import threading

    ring = Ring.create(1 << 20)
    try:
        def produce(tag: int) -> None:
            for i in range(2000):
                assert ring.offer(tag, i, [np.full(i % 17, tag, dtype=np.int64)])

        threads = [threading.Thread(target=produce, args=(tag,)) for tag in (1, 2, 3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seen: dict[int, list[int]] = {1: [], 2: [], 3: []}
        for kind, value, (raw,) in _drain(ring):
            assert np.frombuffer(raw, dtype=np.int64).tolist() == [kind] * (value % 17)  # no torn record
            seen[kind].append(value)
        assert all(values == list(range(2000)) for values in seen.values())
    finally:
        ring.close()
