"""The hit rates count lookups as the engine counts them: each request once, at its first
admission, with the adopt that admitted it. A lookup made while the request waited for room and
a re-admission after a preemption are judged like any lookup, and counted apart."""

from __future__ import annotations

from kvtrace.analysis.funnel import counted, funnel, preemption, reasons, results_frame
from kvtrace.schema.verdicts import GapReason, LookupResult


def row(seq: int, request: str, prompt: int, adopted: int, recoverable: int, *, seen: bool = True,
        preemptions: int = 0, computed: int = 0, logical: int | None = None) -> LookupResult:
    logical = recoverable if logical is None else logical
    return LookupResult(ts_ns=seq, source_id=1, seq=seq, instance="i", request_id=request, model="m", tenant="t",
                        prompt_tokens=prompt, reported_hit_tokens=adopted, preemptions=preemptions,
                        computed_before_preemption=computed, logical_hit_tokens=logical,
                        recoverable_hit_tokens=recoverable, resident_hit_tokens=recoverable, adopted_tokens=adopted,
                        adopt_seen=seen, unsafe_reuse=adopted > recoverable,
                        reason=GapReason.MISSING_BLOCK if logical > recoverable else GapReason.NONE)


def test_first_admissions_are_the_rates_and_re_admissions_their_own_cost() -> None:
    frame = results_frame([
        row(1, "a", 100, 0, 0),
        row(2, "b", 200, 0, 64, seen=False),  # b waited for room: looked up again at its admission
        row(3, "b", 200, 64, 64),
        row(4, "a", 140, 32, 32, preemptions=1, computed=120),  # a preempted after 120, back: 88 again
        row(5, "a", 150, 96, 64, preemptions=2, computed=130, logical=128),  # unsafe on resume: still an alarm
    ])
    assert counted(frame)["seq"].to_list() == [1, 3]
    (f,) = funnel(frame).to_dicts()
    assert (f["lookups"], f["prompt_tokens"], f["adopted_token_rate"]) == (2, 300, 64 / 300)
    assert (f["readmissions"], f["unsafe_reuse"]) == (2, 1)
    (p,) = preemption(frame).to_dicts()
    assert p == {"readmissions": 2, "requests": 1, "prompt_tokens": 290, "reused_tokens": 128,
                 "recomputed_tokens": (120 - 32) + (130 - 96), "tokens_lost": 64}
    assert reasons(frame).height == 0  # the only gap was a re-admission's: not in the counted reasons
