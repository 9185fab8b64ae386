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

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvtrace.schema.divergence import Divergence, Scores, divergence, tolerance
from kvtrace.schema.events import PROBE_PREFIX, Event
from kvtrace.schema.kinds import EventKind
from kvtrace.schema.verdicts import Agreement, LookupResult, Verification


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
