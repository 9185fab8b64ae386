"""The KV-event bridge against vLLM's own event stream: same facts as the in-process shim, and
a late subscriber gets the history back from vLLM's replay socket."""

from __future__ import annotations

import socket
import time
from collections import Counter

import msgspec
import pytest
from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.kv_events import KvEventBridge, translate_all
from kvtrace.instrumentation.sinks.memory import MemorySink
from kvtrace.instrumentation.vllm.driver import Driver, DriverConfig, Layout, build_manager
from kvtrace.instrumentation.vllm.shim import CacheManagerShim, Identity
from kvtrace.schema import EventKind


def facts(events, kind):  # noqa: ANN001, ANN201
    return Counter((e.group_id, k) for e in events if e.kind is kind for k in (e.block_key, *e.more_keys))


def workload() -> tuple[list[bytes], list]:
    """Requests sharing prefixes on a small sliding-window hybrid cache: stores, reuse, evictions."""
    config = DriverConfig(layout=Layout.SLIDING, num_blocks=96)
    manager = build_manager(config, enable_kv_cache_events=True)
    sink = MemorySink()
    emitter = BatchEmitter(sink, BatchConfig(schedule_delay_millis=10), register_atexit=False)
    CacheManagerShim(manager, emitter, Identity()).install()
    driver = Driver(manager, config)
    payloads = []
    prefix = list(range(100, 420))
    for n in range(12):
        tokens = prefix[: 160 + 16 * (n % 5)] + [1000 * n + i for i in range(40 + 30 * (n % 3))]
        driver.serve(f"r{n}", tokens)
        payloads.append(msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=manager.take_events())))
    assert emitter.shutdown()
    return payloads, sink.events


def test_bridge_reports_the_same_commits_and_evictions_as_the_shim() -> None:
    payloads, shim_events = workload()
    bridged = translate_all(payloads)
    assert facts(bridged, EventKind.COMMIT) == facts(shim_events, EventKind.COMMIT)
    assert facts(bridged, EventKind.EVICT) == facts(shim_events, EventKind.EVICT)
    assert facts(bridged, EventKind.EVICT)  # the small cache did evict


def test_every_way_the_shim_reads_commits_matches_vllms_events(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shim takes a commit's keys from the request's chain when vLLM's hash map grew by one
    key per block (with or without a window's block mask), and reads the blocks otherwise: the
    workload goes each way, and the commits are vLLM's own either way."""
    taken: Counter[str] = Counter()
    fast, slow = CacheManagerShim._committed_all, CacheManagerShim._committed

    def counted_fast(self, request, blocks, start, stop, block_size, group, mask):  # noqa: ANN001, ANN202
        taken["masked" if mask is not None else "whole"] += 1
        return fast(self, request, blocks, start, stop, block_size, group, mask)

    def counted_slow(self, *args):  # noqa: ANN001, ANN002, ANN202
        taken["read"] += 1
        return slow(self, *args)

    monkeypatch.setattr(CacheManagerShim, "_committed_all", counted_fast)
    monkeypatch.setattr(CacheManagerShim, "_committed", counted_slow)
    payloads, shim_events = workload()
    assert taken["whole"] and taken["masked"] and taken["read"], taken
    assert facts(translate_all(payloads), EventKind.COMMIT) == facts(shim_events, EventKind.COMMIT)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_late_subscriber_recovers_missed_batches_from_the_replay_socket() -> None:
    payloads, _ = workload()
    pub_port, replay_port = _port(), _port()
    publisher = ZmqEventPublisher(0, endpoint=f"tcp://*:{pub_port}", replay_endpoint=f"tcp://*:{replay_port}")
    try:
        batches = [msgspec.msgpack.decode(p, type=KVEventBatch) for p in payloads]
        for batch in batches[:8]:  # nobody listens yet: these are only in the replay buffer
            publisher.publish(batch)
        time.sleep(0.5)
        sink = MemorySink()
        emitter = BatchEmitter(sink, BatchConfig(schedule_delay_millis=10), register_atexit=False)
        bridge = KvEventBridge(f"tcp://127.0.0.1:{pub_port}", emitter, engine="vllm",
                               replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
                               expect_seq=0)
        time.sleep(0.5)  # let the subscription reach the publisher
        for batch in batches[8:]:
            publisher.publish(batch)
        deadline = time.monotonic() + 10
        while bridge.stats.batches < len(batches) and time.monotonic() < deadline:
            bridge.poll(200)
        bridge.close()
        assert bridge.stats.gaps == 1 and bridge.stats.recovered == 8 and bridge.stats.lost == 0
        assert bridge.stats.batches == len(batches)
        assert emitter.shutdown()
        expected = translate_all(payloads)
        assert [(e.kind, e.block_key, e.more_keys) for e in sink.events] == \
            [(e.kind, e.block_key, e.more_keys) for e in expected]
    finally:
        publisher.shutdown()
