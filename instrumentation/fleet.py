"""Several reference engines behind a router: the fleet's ground truth for every request.

Routers (llm-d, NVIDIA Dynamo, SGLang's router) send a request to the instance they predict
holds its prefix. `FleetSimulator` serves requests on N `CacheSimulator`s of one model behind a
router with a chosen policy, all on one clock, and keeps what was true for each request at its
lookup: the longest prefix any instance had cached by hash (seen anywhere), the longest
recoverable on the best instance (recoverable anywhere), the longest recoverable on the
instance the router chose, and what that instance adopted. The analysis must find the same
numbers from the events alone, so these are computed from the simulators' own blocks, never
from events.

One clock: before each request every simulator's time is set to the newest of them, so every
event of an earlier request, on any instance, comes before this request's lookup, and each
instance's state at the lookup is its state now.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from kvtrace.instrumentation.api import Emitter
from kvtrace.instrumentation.simulator import CacheSimulator, SimConfig, SimOutcome, SimRequest
from kvtrace.schema.kinds import Tier


class RoutePolicy(StrEnum):
    """How the simulated router picks an instance."""

    RANDOM = "random"
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"  # the fewest tokens computed lately
    # The least tokens to compute plus those computed lately, as KV-aware routers weigh an
    # instance's predicted hit (its index of block hashes) against its load.
    PREFIX_AWARE = "prefix_aware"


@dataclass(frozen=True, slots=True)
class FleetTruth:
    """What was true for one request when it was looked up, in tokens."""

    request_id: str
    instance: str  # where the router sent it
    prompt_tokens: int
    seen_anywhere: int  # the longest hash hit on any instance
    recoverable_anywhere: int  # the longest recoverable prefix on any instance
    best_instance: str  # an instance holding `recoverable_anywhere` ("" when it is 0)
    recoverable_here: int  # on the chosen instance
    adopted: int  # what the chosen instance reused
    here_ns: float = 0.0  # serving it on the chosen instance, by the simulators' cost parameters
    best_ns: float = 0.0  # and on the best instance (`CacheSimulator.truth_serve_ns`)

    @property
    def regret(self) -> int:
        """Tokens recoverable elsewhere and not here: what the routing decision cost."""
        return self.recoverable_anywhere - self.recoverable_here


class FleetSimulator:
    """`instances` simulators of `config` (named `<config.instance>/<i>`), one emitter each,
    behind a router with `policy`; `serve` one request at a time."""

    def __init__(self, config: SimConfig, emitters: Sequence[Emitter], policy: RoutePolicy, seed: int = 0,
                 window: int = 0) -> None:
        if not emitters:
            raise ValueError("a fleet needs at least one instance (one emitter each)")
        self.policy = RoutePolicy(policy)
        self.sims = [CacheSimulator(replace(config, instance=f"{config.instance}/{i}"), emitter)
                     for i, emitter in enumerate(emitters)]
        # Load: the tokens each instance computed for the last `window` requests the fleet served
        # (no queues are simulated; this is the work recently given to each).
        self.window = window or 4 * len(self.sims)
        self._recent: deque[tuple[int, int]] = deque()
        self.load = [0] * len(self.sims)
        self._rng = random.Random(seed)
        self._next = 0

    @property
    def names(self) -> list[str]:
        return [s.config.instance for s in self.sims]

    # What a replay reads from the engine it drives (`instrumentation.replay`), for the fleet.
    @property
    def now_ns(self) -> int:
        return max(s.now_ns for s in self.sims)

    @property
    def events(self) -> int:
        return sum(s.events for s in self.sims)

    @property
    def used_bytes(self) -> dict[Tier, int]:
        total: dict[Tier, int] = {}
        for sim in self.sims:
            for tier, n in sim.used_bytes.items():
                total[tier] = total.get(tier, 0) + n
        return total

    def serve_request(self, request: SimRequest) -> SimOutcome:
        """Serve one request where the router sends it (the truth is left out)."""
        return self.serve(request)[1]

    def serve(self, request: SimRequest) -> tuple[FleetTruth, SimOutcome]:
        now = max(max(s.now_ns for s in self.sims), request.arrival_ns)
        for sim in self.sims:
            sim.now_ns = now
        logical = [sim.truth_logical(request) for sim in self.sims]
        recoverable = [sim.truth_recoverable(request) for sim in self.sims]
        chosen = self._route(logical, len(request.tokens))
        best = max(range(len(self.sims)), key=lambda i: (recoverable[i], i == chosen, -i))
        here_ns = self.sims[chosen].truth_serve_ns(request, recoverable[chosen])
        best_ns = here_ns if best == chosen else self.sims[best].truth_serve_ns(request, recoverable[best])
        outcome = self.sims[chosen].serve(request)
        self._recent.append((chosen, outcome.recomputed_tokens))
        self.load[chosen] += outcome.recomputed_tokens
        if len(self._recent) > self.window:
            old, tokens = self._recent.popleft()
            self.load[old] -= tokens
        truth = FleetTruth(
            request_id=request.request_id, instance=self.sims[chosen].config.instance,
            prompt_tokens=outcome.prompt_tokens, seen_anywhere=max(logical),
            recoverable_anywhere=recoverable[best],
            best_instance=self.sims[best].config.instance if recoverable[best] else "",
            recoverable_here=recoverable[chosen], adopted=outcome.adopted_tokens,
            here_ns=here_ns, best_ns=best_ns,
        )
        return truth, outcome

    def serve_all(self, requests: Iterable[SimRequest]) -> list[FleetTruth]:
        return [self.serve(r)[0] for r in requests]

    def _route(self, logical: list[int], prompt: int) -> int:
        n = len(self.sims)
        if self.policy is RoutePolicy.RANDOM:
            return self._rng.randrange(n)
        if self.policy is RoutePolicy.ROUND_ROBIN:
            self._next = (self._next + 1) % n
            return (self._next - 1) % n
        if self.policy is RoutePolicy.LEAST_LOADED:
            return min(range(n), key=lambda i: (self.load[i], i))
        return min(range(n), key=lambda i: (prompt - logical[i] + self.load[i], i))
