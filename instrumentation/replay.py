"""Replay a request trace through an engine: today the reference simulator.

Requests arrive in trace time (scaled by `speed`) or as fast as possible (`speed=0`). Tokens
come from `synthesize_tokens`, cached per hash id, so a long trace costs one synthesis per
distinct block, not per request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import lru_cache

from kvtrace.instrumentation.fleet import FleetSimulator
from kvtrace.instrumentation.simulator import CacheSimulator, SimRequest
from kvtrace.instrumentation.traces import TraceRequest, synthesize_tokens


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    speed: float = 0.0  # 0: as fast as possible; 1: trace time; 10: ten times faster
    vocab_size: int = 32_000
    tenant: str = ""  # for requests whose trace names none


@dataclass(slots=True)
class ReplayReport:
    requests: int = 0
    prompt_tokens: int = 0
    adopted_tokens: int = 0
    events: int = 0
    seconds: float = 0.0
    behind_ns: int = 0  # how late the last request went out, when pacing to trace time
    occupancy: list[tuple[int, dict[str, int]]] = field(default_factory=list)  # (trace ns, bytes per tier)


@lru_cache(maxsize=1 << 16)
def _block(hash_id: int, block_tokens: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(synthesize_tokens((hash_id,), block_tokens, block_tokens, vocab_size))


def tokens_of(req: TraceRequest, vocab_size: int = 32_000) -> list[int]:
    """The same tokens as `synthesize_tokens`, assembled from cached blocks."""
    out: list[int] = []
    for h in req.hash_ids:
        out.extend(_block(h, req.block_tokens, vocab_size))
    del out[req.input_length :]
    return out


def replay(
    trace: Iterable[TraceRequest],
    sim: CacheSimulator | FleetSimulator,
    options: ReplayOptions = ReplayOptions(),
    progress: Callable[[int], None] | None = None,
    sample_every: int = 25,
) -> ReplayReport:
    """Serve every request of `trace` on `sim` (one engine, or a fleet behind its router);
    `progress(n)` is called after each request."""
    serve = sim.serve_request if isinstance(sim, FleetSimulator) else sim.serve
    report = ReplayReport()
    start_wall = time.monotonic_ns()
    base = sim.now_ns
    for req in trace:
        if options.speed > 0:
            due = start_wall + int(req.arrival_ns / options.speed)
            now = time.monotonic_ns()
            if due > now:
                time.sleep((due - now) / 1e9)
            else:
                report.behind_ns = now - due
        outcome = serve(
            SimRequest(req.request_id, tokens_of(req, options.vocab_size), tenant=req.tenant or options.tenant,
                       arrival_ns=base + req.arrival_ns)
        )
        report.requests += 1
        report.prompt_tokens += outcome.prompt_tokens
        report.adopted_tokens += outcome.adopted_tokens
        if report.requests % sample_every == 0:
            report.occupancy.append((req.arrival_ns, {t.value: n for t, n in sim.used_bytes.items()}))
        if progress is not None:
            progress(report.requests)
    report.events = sim.events
    report.seconds = (time.monotonic_ns() - start_wall) / 1e9
    return report
