"""Replays recorded into the store: an emitter sized for a whole trace, and the simulator's
replay through it (what `kvtrace replay` and the demo do, callable from a notebook).

Kept apart from `replay` so that code which only replays (engine drivers, tests) never loads
the store's client.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import msgspec

from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.fleet import FleetSimulator, RoutePolicy
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
    return record_fleet_replay(store, trace, config, 1, RoutePolicy.ROUND_ROBIN, options, progress)


def record_fleet_replay(store: Store, trace: Iterable[TraceRequest], config: SimConfig, instances: int,
                        route: RoutePolicy, options: ReplayOptions | None = None,
                        progress: Callable[[int], None] | None = None) -> RecordedReplay:
    """The same, on `instances` simulators behind a router with policy `route` (one emitter
    each; instances `<config.instance>/<i>`); one instance is the plain simulator."""
    if instances < 1:
        raise ValueError(f"a fleet needs at least one instance, not {instances}")
    names = [config.instance] if instances == 1 else [f"{config.instance}/{i}" for i in range(instances)]
    emitters = [store_emitter(store, name, "sim") for name in names]
    sim: CacheSimulator | FleetSimulator = CacheSimulator(config, emitters[0]) if instances == 1 else \
        FleetSimulator(config, emitters, route)
    report = replay(trace, sim, ReplayOptions() if options is None else options, progress=progress)
    for emitter in emitters:
        emitter.force_flush(timeout_millis=FLUSH_TIMEOUT_MILLIS)
        emitter.shutdown()
    stats = [e.stats() for e in emitters]
    return RecordedReplay(report, stats[0] if instances == 1 else _sum_stats(stats))


def _sum_stats(stats: list[EmitterStats]) -> EmitterStats:
    """The fleet's emitters' counters added up (the first one's identity)."""
    first = stats[0]
    counters = {f: sum(getattr(s, f) for s in stats) for f in first.__struct_fields__
                if f not in ("ts_ns", "source_id") and isinstance(getattr(first, f), int)
                and not isinstance(getattr(first, f), bool)}
    return msgspec.structs.replace(first, **counters)
