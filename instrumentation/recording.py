"""Replays recorded into the store: an emitter sized for a whole trace, and the simulator's
replay through it (what `kvtrace replay` and the demo do, callable from a notebook).

Kept apart from `replay` so that code which only replays (engine drivers, tests) never loads
the store's client.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.replay import ReplayOptions, ReplayReport, replay
from kvtrace.instrumentation.simulator import CacheSimulator, SimConfig
from kvtrace.instrumentation.sinks.store import StoreSink
from kvtrace.instrumentation.traces import TraceRequest
from kvtrace.schema.records import EmitterStats
from kvtrace.store.client import Store

FLUSH_TIMEOUT_MILLIS = 600_000  # a long trace's events may take minutes to insert


def store_emitter(store: Store, instance: str, engine: str) -> BatchEmitter:
    """An emitter straight into `store` whose queue holds a large trace's events: a replay
    outruns the inserts, and dropping would make the stored stream a sample of the replay."""
    config = BatchConfig(max_queue_size=1 << 20, shutdown_timeout_millis=FLUSH_TIMEOUT_MILLIS)
    return BatchEmitter(StoreSink(store), config, instance=instance, engine=engine, register_atexit=False)


@dataclass(frozen=True, slots=True)
class RecordedReplay:
    report: ReplayReport  # what the simulator served
    stats: EmitterStats  # what the emitter stored and dropped


def record_replay(store: Store, trace: Iterable[TraceRequest], config: SimConfig,
                  options: ReplayOptions | None = None,
                  progress: Callable[[int], None] | None = None) -> RecordedReplay:
    """Serve `trace` on the reference simulator built from `config`, its events stored in
    `store` (whose tables must exist: `store.init()`); returns once every event is stored or
    counted as dropped."""
    emitter = store_emitter(store, config.instance, "sim")
    sim = CacheSimulator(config, emitter)
    report = replay(trace, sim, ReplayOptions() if options is None else options, progress=progress)
    emitter.force_flush(timeout_millis=FLUSH_TIMEOUT_MILLIS)
    emitter.shutdown()
    return RecordedReplay(report, emitter.stats())
