"""The correctness oracle's judgement: does reusing cached state give what recomputing gives?

A verdict that says "recoverable" is a claim about outputs. `kvtrace verify` re-executes a
sample of requests with the prefix cache bypassed and compares the log-probabilities the
engine gave each prompt token (and the first generated ones) in the cached run and in the
fresh one. Kernels and batch shapes make two fresh runs differ slightly too, so the same
prompts are also computed twice without cache in the same run: that difference is the noise
floor, and only a difference well above it counts as divergence.

Pure functions over plain values: the engine side (`kvtrace.instrumentation.vllm.verify`)
collects the numbers, this module judges them.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvtrace.schema.events import PROBE_PREFIX, Event
from kvtrace.schema.kinds import EventKind
from kvtrace.schema.verdicts import Agreement, LookupResult, Verification


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


def judge(result: LookupResult, div: Divergence, tol: float) -> Agreement:
    """The verdict's claim against what re-execution showed."""
    if result.adopted_tokens == 0:
        return Agreement.NOTHING_REUSED
    diverged = div.max_abs_diff > tol or not div.first_token_match
    if div.positions == 0 and not diverged:
        return Agreement.INCONCLUSIVE
    if result.unsafe_reuse:
        return Agreement.ALARM_CONFIRMED if diverged else Agreement.ALARM_CONSERVATIVE
    return Agreement.DIVERGED if diverged else Agreement.IDENTICAL


def explain(result: LookupResult, agreement: Agreement, div: Divergence, tol: float) -> str:
    """One line a person can act on."""
    if agreement is Agreement.NOTHING_REUSED:
        return "nothing was reused; the cache-free runs only measure noise"
    if agreement is Agreement.INCONCLUSIVE:
        return (f"reused {result.adopted_tokens} tokens, but no position had log-probabilities from both runs: "
                "nothing was compared")
    gap = f"max |d logprob| {div.max_abs_diff:.3g} vs tolerance {tol:.3g} over {div.positions} positions"
    if agreement is Agreement.IDENTICAL:
        return f"reused {result.adopted_tokens} tokens, outputs match recompute: {gap}"
    if agreement is Agreement.DIVERGED:
        return (f"reused {result.adopted_tokens} tokens that kvtrace found valid, yet outputs differ ({gap}): "
                "a reuse bug, or an identity field kvtrace does not track")
    why = f"{result.reason.value}" + (f" ({result.reason_detail})" if result.reason_detail else "")
    if agreement is Agreement.ALARM_CONFIRMED:
        return f"unsafe reuse ({why}) confirmed: outputs differ ({gap})"
    return (f"unsafe reuse ({why}) flagged, yet outputs match ({gap}): the state reused was equal in value "
            "(e.g. the same weights under a new revision), the alarm was conservative")


def verification(result: LookupResult, cached: Scores, fresh: Scores, floor: float, run_id: str, ts_ns: int,
                 factor: float = 4.0, atol: float = 1e-4) -> Verification:
    """The stored row for one verified request."""
    return verification_of(result, divergence(cached, fresh), floor, run_id, ts_ns, factor, atol)


def verification_of(result: LookupResult, div: Divergence, floor: float, run_id: str, ts_ns: int,
                    factor: float = 4.0, atol: float = 1e-4, note: str = "") -> Verification:
    """The stored row for one verified request, from its measured divergence."""
    tol = tolerance(floor, factor, atol)
    agreement = judge(result, div, tol)
    return Verification(
        ts_ns=ts_ns, run_id=run_id, instance=result.instance, request_id=result.request_id, model=result.model,
        tenant=result.tenant, verdict=result.verdict, reason=result.reason, unsafe_reuse=result.unsafe_reuse,
        prompt_tokens=result.prompt_tokens, adopted_tokens=result.adopted_tokens, positions=div.positions,
        max_abs_diff=div.max_abs_diff, mean_kl=div.mean_kl, max_kl=div.max_kl,
        first_token_match=div.first_token_match, noise_floor=floor, tolerance=tol, agreement=agreement,
        detail=note + explain(result, agreement, div, tol))


def probe_divergence(probe: Event) -> Divergence:
    """What a canary measured in the engine, as the judgement reads it."""
    return Divergence(positions=probe.probe_positions, max_abs_diff=probe.probe_max_abs_diff,
                      mean_kl=probe.probe_mean_kl, max_kl=probe.probe_max_kl,
                      first_token_match=not probe.probe_first_token_differs)


def probe_run_id(probe: Event) -> str:
    """One engine process's canary is one run: its rows share a noise-floor measurement."""
    return f"canary-{probe.source_id:016x}"


class ProbeJudge:
    """Turns an engine's probe events into verification rows once the re-run's verdict is known.

    A probe names the re-run that read the cache (its own lookup and adopt went through the
    ordinary pipeline), so the row is the probe's measurement judged against that re-run's
    verdict. The probe is emitted after the re-run finished, so in stream order the verdict
    comes first; probes seen before their verdict wait, a bounded number of them, and so do
    the verdicts a probe may still ask for."""

    def __init__(self, factor: float = 4.0, atol: float = 1e-4, keep: int = 4096) -> None:
        self.factor, self.atol, self.keep = factor, atol, keep
        self._verdicts: OrderedDict[tuple[str, str], LookupResult] = OrderedDict()
        self._waiting: OrderedDict[tuple[str, str], Event] = OrderedDict()
        self.dropped = 0  # probes whose verdict never came within `keep` newer probes

    def verdicts(self, results: Iterable[LookupResult]) -> list[Verification]:
        """Take verdicts (any; only re-runs' are kept); returns rows for probes that waited on them."""
        out = []
        for r in results:
            if not r.request_id.startswith(PROBE_PREFIX):
                continue
            key = (r.instance, r.request_id)
            probe = self._waiting.pop(key, None)
            if probe is not None:
                out.append(self._row(r, probe))
                continue
            self._verdicts[key] = r
            if len(self._verdicts) > self.keep:
                self._verdicts.popitem(last=False)
        return out

    def probes(self, probes: Iterable[Event]) -> list[Verification]:
        """Take probe events; returns rows for those whose verdict is already known."""
        out = []
        for p in probes:
            key = (p.instance, p.request_id)
            result = self._verdicts.pop(key, None)
            if result is not None:
                out.append(self._row(result, p))
                continue
            self._waiting[key] = p
            if len(self._waiting) > self.keep:
                self._waiting.popitem(last=False)
                self.dropped += 1
        return out

    def waiting(self) -> int:
        return len(self._waiting)

    def _row(self, result: LookupResult, probe: Event) -> Verification:
        return verification_of(result, probe_divergence(probe), probe.noise_floor, probe_run_id(probe), probe.ts_ns,
                               self.factor, self.atol, note=f"probe of {probe.probe_of}: ")


def probe_verifications(probes: Iterable[Event], results: Iterable[LookupResult], factor: float = 4.0,
                        atol: float = 1e-4) -> list[Verification]:
    """Rows for the probes (of a batch of events) whose re-run has a verdict among `results`."""
    judge_ = ProbeJudge(factor, atol, keep=1 << 62)
    judge_.verdicts(results)
    return judge_.probes(p for p in probes if p.kind is EventKind.PROBE)


def sample_by_class(results: Sequence[LookupResult], per_class: int) -> list[LookupResult]:
    """Up to `per_class` requests of each verdict class, alarms first (the ones worth the
    compute): unsafe reuse, cross-tenant, identity mismatch, then PARTIAL, HIT and MISS.
    Deterministic: the earliest lookups of each class."""
    from kvtrace.schema.verdicts import GapReason, Verdict

    def cls(r: LookupResult) -> str:
        if r.unsafe_reuse:
            return "unsafe"
        if r.cross_tenant:
            return "cross_tenant"
        if r.reason is GapReason.IDENTITY_MISMATCH:
            return "identity"
        return r.verdict.value

    order = ["unsafe", "cross_tenant", "identity", Verdict.PARTIAL.value, Verdict.HIT.value, Verdict.MISS.value]
    picked: dict[str, list[LookupResult]] = {c: [] for c in order}
    for r in sorted((r for r in results if r.adopt_seen), key=lambda r: (r.ts_ns, r.seq)):
        bucket = picked[cls(r)]
        if len(bucket) < per_class:
            bucket.append(r)
    return [r for c in order for r in picked[c]]


def engine_request(results: Sequence[LookupResult], request_id: str) -> LookupResult | None:
    """The verdict of the request an engine's output names: engines may suffix the id they
    report inside (vLLM adds `-<random>`), so a prefix match on `<id>-` counts."""
    prefix = f"{request_id}-"
    found = [r for r in results if r.adopt_seen and (r.request_id == request_id or r.request_id.startswith(prefix))]
    return max(found, key=lambda r: (r.ts_ns, r.seq)) if found else None
