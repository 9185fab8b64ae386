"""How far two runs' log-probabilities are apart: the measure a verdict is checked with.

A cached run and a fresh (cache-free) run of the same request are compared position by
position. Both the engine side (the vLLM canary measures in the engine process and sends the
numbers in a probe event) and the analysis (`kvtrace verify`, the oracle's judgement) use the
same measure, so it lives below both, as part of what a probe event's numbers mean.

Pure functions over plain values.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Scores:
    """One run's log-probabilities for a request, position by position: the token the run saw
    (a prompt token, then the ones it generated) and its top-k alternatives."""

    tokens: tuple[int, ...]
    chosen: tuple[float, ...]  # logprob of `tokens[i]` at position i
    top: tuple[dict[int, float], ...]  # top-k logprobs at position i (may include tokens[i])
    generated: int = 0  # how many of the positions (at the end) are generated tokens

    def __post_init__(self) -> None:
        if not len(self.tokens) == len(self.chosen) == len(self.top):
            raise ValueError(f"scores: {len(self.tokens)} tokens, {len(self.chosen)} logprobs, "
                             f"{len(self.top)} top-k lists: one of each per position")
        if not 0 <= self.generated <= len(self.tokens):
            raise ValueError(f"scores: {self.generated} generated tokens among {len(self.tokens)} positions")


@dataclass(frozen=True, slots=True)
class Divergence:
    positions: int  # compared positions (the shorter run's, up to where the tokens agree)
    max_abs_diff: float  # largest |logprob a - logprob b| of a token both runs scored
    mean_kl: float  # KL(b || a) over the top-k, averaged over positions
    max_kl: float
    first_token_match: bool  # both runs generated the same first token


def _kl(p: dict[int, float], q: dict[int, float]) -> float:
    """KL(p || q) over p's top-k tokens, both renormalized there: an approximation of the
    full-vocabulary KL that needs only what the engine returns. A token q did not rank is given
    q's smallest finite listed logprob (at most what it really had)."""
    finite = [v for v in q.values() if math.isfinite(v)]
    if not p or not finite:
        return 0.0
    floor = min(finite)
    ps = {t: math.exp(v) for t, v in p.items() if math.isfinite(v)}
    qs = {t: math.exp(q[t]) if t in q and math.isfinite(q[t]) else math.exp(floor) for t in ps}
    zp, zq = sum(ps.values()), sum(qs.values())
    if zp <= 0 or zq <= 0:
        return 0.0
    return max(sum((pv / zp) * math.log((pv / zp) / (qs[t] / zq)) for t, pv in ps.items() if pv > 0 and qs[t] > 0),
               0.0)


def divergence(cached: Scores, fresh: Scores) -> Divergence:
    """How far the cached run's numbers are from the fresh run's, position by position.

    Positions are compared while both runs saw the same token there (the prompt, then the
    generated tokens up to the first that differs: after that the runs condition on different
    text and their numbers are no longer comparable)."""
    n = 0
    worst = 0.0
    kls: list[float] = []
    for i in range(min(len(cached.tokens), len(fresh.tokens))):
        if cached.tokens[i] != fresh.tokens[i]:
            break
        a, b = cached.chosen[i], fresh.chosen[i]
        ta, tb = cached.top[i], fresh.top[i]
        common = ta.keys() & tb.keys()
        scored = math.isfinite(a) and math.isfinite(b)
        if not (scored or common):
            continue  # a position one run has no numbers for is not a comparison
        if scored:
            worst = max(worst, abs(a - b))
        for t in common:
            worst = max(worst, abs(ta[t] - tb[t]))
        kls.append(_kl(tb, ta))
        n += 1
    first_a = len(cached.tokens) - cached.generated
    first_b = len(fresh.tokens) - fresh.generated
    same_first = (cached.generated == 0 or fresh.generated == 0 or
                  cached.tokens[first_a] == fresh.tokens[first_b])
    return Divergence(positions=n, max_abs_diff=worst, mean_kl=sum(kls) / len(kls) if kls else 0.0,
                      max_kl=max(kls, default=0.0), first_token_match=same_first)


def noise_floor(pairs: Iterable[tuple[Scores, Scores]]) -> float:
    """The largest difference between two cache-free runs of the same prompt."""
    return max((divergence(a, b).max_abs_diff for a, b in pairs), default=0.0)


def tolerance(floor: float, factor: float = 4.0, atol: float = 1e-4) -> float:
    """Above this a difference is divergence: a few times the measured floor, and never below
    `atol` (two bit-identical fresh runs give a floor of 0)."""
    return max(floor * factor, atol)
