"""The correctness oracle's judgement (pure), and its rows in the embedded store."""

from __future__ import annotations

import math

import pytest

from kvtrace.analysis.oracle import judge, sample_by_class, verification
from kvtrace.schema.arrow import to_arrow
from kvtrace.schema.clickhouse import VERIFICATIONS
from kvtrace.schema.divergence import Scores, divergence, noise_floor, tolerance
from kvtrace.schema.verdicts import Agreement, GapReason, LookupResult, Verdict, Verification
from kvtrace.store.client import Store


def scores(tokens: list[int], shift: float = 0.0, generated: int = 0) -> Scores:
    """A run whose logprobs are a fixed function of position and token, moved by `shift`."""
    chosen = tuple(-1.0 - 0.01 * i + shift for i in range(len(tokens)))
    top = tuple({t: chosen[i], t + 1: chosen[i] - 1.0 + shift, t + 2: chosen[i] - 2.0} for i, t in enumerate(tokens))
    return Scores(tuple(tokens), chosen, top, generated)


def result(**kw: object) -> LookupResult:
    base = dict(ts_ns=1, source_id=1, seq=1, instance="i", request_id="r", model="m", tenant="", prompt_tokens=64,
                reported_hit_tokens=32, logical_hit_tokens=32, recoverable_hit_tokens=32, resident_hit_tokens=32,
                adopted_tokens=32, adopt_seen=True, verdict=Verdict.HIT)
    base.update(kw)
    return LookupResult(**base)  # type: ignore[arg-type]


def test_identical_runs_do_not_diverge() -> None:
    a = scores([5, 6, 7, 8], generated=1)
    d = divergence(a, scores([5, 6, 7, 8], generated=1))
    assert d.positions == 4 and d.max_abs_diff == 0.0 and d.mean_kl == pytest.approx(0.0, abs=1e-12)
    assert d.first_token_match


def test_a_shift_is_measured_and_kl_is_positive() -> None:
    d = divergence(scores([5, 6, 7]), scores([5, 6, 7], shift=0.3))
    assert d.max_abs_diff == pytest.approx(0.6)  # the second-ranked token moved twice the shift
    assert d.mean_kl > 0 and d.max_kl >= d.mean_kl


def test_comparison_stops_where_the_texts_part() -> None:
    cached, fresh = scores([1, 2, 3, 9], generated=1), scores([1, 2, 3, 4], shift=0.0, generated=1)
    d = divergence(cached, fresh)
    assert d.positions == 3 and not d.first_token_match


def test_scores_must_be_one_per_position() -> None:
    with pytest.raises(ValueError, match="one of each per position"):
        Scores((1, 2), (-1.0,), ({}, {}))


def test_noise_floor_and_tolerance() -> None:
    pairs = [(scores([1, 2]), scores([1, 2], shift=1e-6)), (scores([3, 4]), scores([3, 4]))]
    floor = noise_floor(pairs)
    assert floor == pytest.approx(2e-6)
    assert tolerance(floor) == 1e-4  # never below the absolute floor
    assert tolerance(0.01) == pytest.approx(0.04)
    assert noise_floor([]) == 0.0


@pytest.mark.parametrize(("unsafe", "shift", "expected"), [
    (False, 0.0, Agreement.IDENTICAL), (False, 0.5, Agreement.DIVERGED),
    (True, 0.5, Agreement.ALARM_CONFIRMED), (True, 0.0, Agreement.ALARM_CONSERVATIVE),
])
def test_judgement_of_each_class(unsafe: bool, shift: float, expected: Agreement) -> None:
    r = result(unsafe_reuse=unsafe, reason=GapReason.IDENTITY_MISMATCH if unsafe else GapReason.NONE,
               reason_detail="model_revision" if unsafe else "")
    row = verification(r, scores([1, 2, 3], shift=shift), scores([1, 2, 3]), floor=0.0, run_id="v1", ts_ns=5)
    assert row.agreement is expected
    assert judge(r, divergence(scores([1, 2, 3], shift=shift), scores([1, 2, 3])), 1e-4) is expected
    if unsafe:
        assert "model_revision" in row.detail
    assert math.isfinite(row.max_abs_diff) and row.tolerance == 1e-4


def test_nothing_reused_is_a_control() -> None:
    r = result(adopted_tokens=0, verdict=Verdict.MISS)
    assert verification(r, scores([1]), scores([1], shift=2.0), 0.0, "v", 1).agreement is Agreement.NOTHING_REUSED


def test_sampling_takes_alarms_first_and_each_class() -> None:
    rows = [result(request_id=f"h{i}", seq=i, ts_ns=i) for i in range(5)]
    rows += [result(request_id="p", seq=10, ts_ns=10, verdict=Verdict.PARTIAL)]
    rows += [result(request_id="u", seq=11, ts_ns=11, unsafe_reuse=True)]
    rows += [result(request_id="x", seq=12, ts_ns=12, adopt_seen=False)]  # never admitted: skipped
    picked = [r.request_id for r in sample_by_class(rows, per_class=2)]
    assert picked == ["u", "p", "h0", "h1"]


def test_verifications_round_trip_through_the_store(store: Store) -> None:
    row = verification(result(unsafe_reuse=True, reason=GapReason.IDENTITY_MISMATCH), scores([1, 2]),
                       scores([1, 2], shift=0.2), floor=1e-6, run_id="v1", ts_ns=1_700_000_000_000_000_000)
    store.insert_arrow(VERIFICATIONS.name, to_arrow([row], Verification))
    got = store.query_polars(f"SELECT agreement, max_abs_diff, detail FROM {store.db}.verifications")
    assert got["agreement"].to_list() == ["unsafe_diverged"]
    assert got["max_abs_diff"][0] == pytest.approx(row.max_abs_diff)


# -- engine canaries: probe events judged against their re-runs' verdicts ---------------------


def probe(request_id: str = "kvtrace-verify-a", diff: float = 0.0, differs: bool = False, **kw: object):
    from kvtrace.schema.events import Event
    from kvtrace.schema.kinds import EventKind

    fields = dict(kind=EventKind.PROBE, ts_ns=10, source_id=7, seq=3, instance="i", request_id=request_id,
                  probe_of="user-1", prompt_tokens=64, reported_hit_tokens=32, probe_positions=36,
                  probe_max_abs_diff=diff, probe_first_token_differs=differs, noise_floor=0.0)
    fields.update(kw)
    return Event(**fields)  # type: ignore[arg-type]


def test_a_probe_is_judged_against_its_re_runs_verdict_whichever_comes_first() -> None:
    from kvtrace.analysis.oracle import ProbeJudge

    rerun = result(request_id="kvtrace-verify-a")
    early = ProbeJudge()
    assert early.verdicts([rerun, result(request_id="user-1")]) == []  # users' verdicts are not kept
    (row,) = early.probes([probe()])
    assert row.agreement is Agreement.IDENTICAL and row.request_id == "kvtrace-verify-a"
    assert row.run_id == "canary-0000000000000007" and row.detail.startswith("probe of user-1: ")
    late = ProbeJudge()
    assert late.probes([probe(diff=2.0)]) == [] and late.waiting() == 1
    (row,) = late.verdicts([rerun])
    assert row.agreement is Agreement.DIVERGED and row.max_abs_diff == 2.0 and late.waiting() == 0
    flagged = ProbeJudge()
    flagged.verdicts([result(request_id="kvtrace-verify-a", unsafe_reuse=True, reason=GapReason.IDENTITY_MISMATCH)])
    (row,) = flagged.probes([probe(differs=True)])  # a changed first token is divergence on its own
    assert row.agreement is Agreement.ALARM_CONFIRMED


def test_probes_waiting_for_a_verdict_are_bounded_and_counted() -> None:
    from kvtrace.analysis.oracle import ProbeJudge

    judge_ = ProbeJudge(keep=2)
    for i in range(5):
        judge_.probes([probe(request_id=f"kvtrace-verify-{i}")])
    assert judge_.waiting() == 2 and judge_.dropped == 3
    assert [r.request_id for r in judge_.verdicts([result(request_id=f"kvtrace-verify-{i}") for i in range(5)])] \
        == ["kvtrace-verify-3", "kvtrace-verify-4"]


def test_canary_settings_are_validated_by_name() -> None:
    from kvtrace.instrumentation.config import ConfigError
    from kvtrace.instrumentation.vllm.canary import CanarySettings

    assert not CanarySettings.from_env({}).enabled
    s = CanarySettings.from_env({"KVTRACE_VERIFY_RATE": "0.01", "KVTRACE_VERIFY_MAX_PER_MIN": "2"})
    assert s.enabled and s.rate == 0.01 and s.max_per_minute == 2.0
    for env, named in (({"KVTRACE_VERIFY_RATE": "2"}, "KVTRACE_VERIFY_RATE"),
                       ({"KVTRACE_VERIFY_RATE": "lots"}, "KVTRACE_VERIFY_RATE"),
                       ({"KVTRACE_VERIFY_N_GEN": "0"}, "KVTRACE_VERIFY_N_GEN"),
                       ({"KVTRACE_VERIFY_MAX_TOKENS": "1.5"}, "KVTRACE_VERIFY_MAX_TOKENS")):
        with pytest.raises(ConfigError, match=named):
            CanarySettings.from_env(env)


def test_canary_re_runs_stay_out_of_hit_rates_and_alerts() -> None:
    """A canary's re-runs are not users' traffic: the funnel and the alert rates leave them out
    (and the dashboards' verdict queries, by the same prefix)."""
    from kvtrace.analysis.funnel import funnel, results_frame
    from kvtrace.dashboards.alerts import Label, _rates
    from kvtrace.dashboards.queries import filters

    frame = results_frame([result(request_id="user-1", adopted_tokens=0, recoverable_hit_tokens=0),
                           result(request_id="kvtrace-verify-9", unsafe_reuse=True)])
    row = funnel(frame).row(0, named=True)
    assert row["lookups"] == 1 and row["adopted_token_rate"] == 0.0 and row["unsafe_reuse"] == 0
    assert _rates(frame, [Label.MODEL]).row(0, named=True)["unsafe"] == 0
    assert "NOT startsWith(request_id, 'kvtrace-verify-')" in filters("verdicts")
    assert "kvtrace-verify-" not in filters("verifications")  # the canary's own rows are what that table shows


def test_a_reuse_with_nothing_to_compare_is_inconclusive_not_identical() -> None:
    """Positions where one run has no numbers (vLLM computes none for cached prompt tokens) are
    not comparisons; with none left the verdict's claim is neither proven nor refuted."""
    blank = Scores((5, 6), (math.nan, math.nan), ({}, {}))
    d = divergence(blank, scores([5, 6]))
    assert d.positions == 0 and d.max_abs_diff == 0.0
    assert judge(result(), d, tolerance(0.0)) is Agreement.INCONCLUSIVE
    assert divergence(scores([5, 6]), scores([5, 6])).positions == 2
