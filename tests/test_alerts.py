"""Alert rules end to end: a replay with an injected fault fires the divergence alert to a local
webhook receiver within one evaluation, a clean replay resolves it, an engine that reuses
beyond what is recoverable fires the unsafe-reuse alert; bad rule files name rule and field."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtrace.dashboards.alert_delivery import RetryPolicy
from kvtrace.dashboards.alerts import (
    AlertLoop,
    AlertState,
    Evaluator,
    RuleError,
    Sample,
    Status,
    computed_verdicts,
    load_rules,
)
from kvtrace.instrumentation.simulator import AdoptPolicy
from kvtrace.schema.recipes import BUILTIN
from kvtrace.store.client import Store
from tests.alert_helpers import Engine, Receiver, S

RULES = """
rules:
  - name: divergence
    kind: divergence
    threshold: 0.01
    window_s: 60
  - name: unsafe
    kind: unsafe_reuse
    window_s: 60
    severity: critical
"""


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.server.shutdown()


def loop_for(store: Store, receiver: Receiver) -> AlertLoop:
    rules = load_rules(RULES)
    return AlertLoop(Evaluator(store, rules, computed_verdicts(store, BUILTIN["mamba-hybrid"])), [receiver.url],
                     out=lambda line: None, retry=RetryPolicy(attempts=2, backoff_s=0.01))


def test_divergence_fires_within_one_cycle_and_resolves_after_a_clean_replay(store: Store, receiver: Receiver) -> None:
    engine = Engine(store)
    loop = loop_for(store, receiver)
    for t in range(4):
        engine.serve(t)  # clean: everything hit is recoverable
    assert loop.cycle() == [] and receiver.received == []
    engine.serve(10, fault=True)  # the Mamba checkpoint at the hit boundary is gone
    changed = loop.cycle()
    assert [(a.rule.name, a.status) for a in changed] == [("divergence", Status.FIRING)]
    assert receiver.alerts() == [("firing", "divergence")]
    body = receiver.received[-1]
    assert body["version"] == "4" and body["status"] == "firing"
    assert body["alerts"][0]["labels"] == {"alertname": "divergence", "severity": "warning", "kind": "divergence",
                                           "model": "jamba"}
    assert loop.cycle() == []  # still firing: not sent again
    for t in range(200, 204):  # a clean replay, after the faulty lookup left the window
        engine.serve(t)
    assert [(a.rule.name, a.status) for a in loop.cycle()] == [("divergence", Status.RESOLVED)]
    assert receiver.alerts() == [("firing", "divergence"), ("resolved", "divergence")]
    assert receiver.received[-1]["alerts"][0]["endsAt"] != "0001-01-01T00:00:00Z"


def test_unsafe_reuse_fires(store: Store, receiver: Receiver) -> None:
    engine = Engine(store, adopt=AdoptPolicy.LOGICAL)  # an engine that trusts the hash hit
    loop = loop_for(store, receiver)
    engine.serve(0)
    engine.serve(1, fault=True)
    fired = {a.rule.name for a in loop.cycle() if a.status is Status.FIRING}
    assert "unsafe" in fired
    unsafe = next(a for body in receiver.received for a in body["alerts"] if a["labels"]["alertname"] == "unsafe")
    assert unsafe["labels"]["severity"] == "critical" and float(unsafe["annotations"]["value"]) >= 1


def test_routing_regret_fires_for_the_instance_sent_requests_another_could_resume_further(store: Store) -> None:
    from tests.dashboard_fill import replay

    replay(store)  # two engines of one model; verdicts judged with the fleet view
    (rule,) = load_rules("rules: [{name: regret, kind: routing_regret, threshold: 0.01, window_s: 900, "
                         "by: [instance]}]")
    samples = {dict(s.labels)["instance"]: s for s in Evaluator(store, [rule]).evaluate()}
    # over the requests' first admissions, as the engine counts them (the replay re-admits a few)
    rows = store.query_polars(f"SELECT * FROM {store.db}.verdicts FINAL WHERE instance = 'engine-b' "
                              "AND preemptions = 0")
    share = rows["routing_regret_tokens"].sum() / rows["prompt_tokens"].sum()
    assert samples["engine-b"].breaching and samples["engine-b"].value == pytest.approx(share) and share > 0.01
    assert not samples["engine-a"].breaching and samples["engine-a"].value == 0


def test_pending_until_the_condition_holds_for_its_duration() -> None:
    (rule,) = load_rules("rules: [{name: d, kind: divergence, threshold: 0.1, for_s: 30}]")
    state = AlertState()
    breach = [Sample("d", (("model", "m"),), 0.5, True)]
    assert state.update([rule], breach, 0) == []  # pending
    assert state.update([rule], breach, 29 * S) == []
    (fired,) = state.update([rule], breach, 30 * S)
    assert fired.status is Status.FIRING
    assert state.update([rule], [Sample("d", (("model", "m"),), 0.5, True)], 40 * S) == []
    (resolved,) = state.update([rule], [Sample("d", (("model", "m"),), 0.0, False)], 50 * S)
    assert resolved.status is Status.RESOLVED
    # a breach that clears while pending never reaches the receiver
    assert state.update([rule], breach, 60 * S) == [] and state.update([rule], [], 61 * S) == []


@pytest.mark.parametrize("text, where", [
    ("rules: [{name: a, kind: divergence, threshold: -1}]", "rule a: threshold:"),
    ("rules: [{name: a, kind: divergance}]", "rule a: kind:"),
    ("rules: [{name: a, kind: divergence, windw_s: 5}]", "rule a: windw_s:"),
    ("rules: [{kind: divergence}]", "rule #1: name:"),
    ("rules: [{name: a, kind: divergence}, {name: a, kind: unsafe_reuse}]", "rule a: name:"),
    ("rules: [{name: g, kind: stream_gap}]", "rule g: by:"),
    ("rules: [{name: b, kind: recoverable_drop, window_s: 600, baseline_s: 60}]", "rule b: baseline_s:"),
    ("rules: [{name: c, kind: divergence, severity: loud}]", "rule c: severity:"),
    ("- just a list", "expected a mapping"),
])
def test_bad_rule_files_name_the_rule_and_field(text: str, where: str) -> None:
    with pytest.raises(RuleError) as err:
        load_rules(text, "rules.yaml")
    assert str(err.value).startswith("rules.yaml: ") and where in str(err.value)


def test_stream_health_rules_find_gaps_silence_and_drops(store: Store) -> None:
    from kvtrace.schema.events import Event
    from kvtrace.schema.kinds import EventKind
    from kvtrace.schema.records import EmitterStats

    t0 = 1_760_000_000 * S

    def lookups(instance: str, source: int, seqs: range | list[int], at_s: float) -> list[Event]:
        return [Event(kind=EventKind.LOOKUP, ts_ns=t0 + int(at_s * S) + i, source_id=source, seq=q, instance=instance,
                      model="m", request_id=f"{instance}-{q}", prompt_tokens=16) for i, q in enumerate(seqs)]

    store.insert_events(lookups("steady", 1, range(0, 50), 0) + lookups("steady", 1, range(50, 100), 290))
    store.insert_events(lookups("gappy", 2, [0, 1, 2, 6, 7], 280))  # 3 events never arrived
    store.insert_events(lookups("quiet", 3, range(10), 100))  # nothing in the last 120 s
    store.insert_stats([EmitterStats(ts_ns=t0 + 200 * S, source_id=1, instance="steady", dropped_queue_full=0),
                        EmitterStats(ts_ns=t0 + 290 * S, source_id=1, instance="steady", dropped_queue_full=5)])
    rules = load_rules("""
rules:
  - {name: gaps, kind: stream_gap, by: [instance], window_s: 300}
  - {name: silent, kind: silent, by: [instance], window_s: 120}
  - {name: drops, kind: emitter_drops, by: [instance], window_s: 300}
""")
    samples = Evaluator(store, rules).evaluate()
    breaching = sorted((s.rule, dict(s.labels)["instance"], s.value) for s in samples if s.breaching)
    assert breaching == [("drops", "steady", 5.0), ("gaps", "gappy", 3.0),
                         ("silent", "quiet", pytest.approx(190, abs=1))]


def test_a_failed_webhook_delivery_is_retried_next_cycle(store: Store, receiver: Receiver) -> None:
    engine = Engine(store)
    loop = loop_for(store, receiver)
    engine.serve(0)
    engine.serve(10, fault=True)
    receiver.status = 503
    assert [a.rule.name for a in loop.cycle()] == ["divergence"]
    (line,) = loop.last_failures
    assert line == f"alert delivery to webhook {receiver.url} failed after 2 attempts: HTTP 503 Service Unavailable"
    assert receiver.received == [] and len(loop.outboxes[0].queued) == 1
    receiver.status = 200
    assert loop.cycle() == [] and loop.last_failures == []  # nothing changed; the undelivered notice goes now
    assert receiver.alerts() == [("firing", "divergence")] and loop.outboxes[0].queued == []
    receiver.status = 400  # a receiver that refuses the request is not asked again
    for t in range(200, 203):
        engine.serve(t)
    loop.cycle()
    (line,) = loop.last_failures
    assert "failed after 1 attempt: HTTP 400" in line and loop.outboxes[0].queued == []


def test_the_outbox_is_bounded() -> None:
    from kvtrace.dashboards.alert_delivery import Notice, Outbox, Receiver, ReceiverKind

    box = Outbox(Receiver(ReceiverKind.WEBHOOK, "http://127.0.0.1:9/"), limit=3)
    box.add(Notice(labels={"alertname": str(i)}, annotations={}, firing=True, starts_at_s=i) for i in range(5))
    assert [n.labels["alertname"] for n in box.queued] == ["2", "3", "4"] and box.dropped == 2


def test_alertmanager_gets_firing_alerts_again_before_they_expire(store: Store, receiver: Receiver) -> None:
    from kvtrace.dashboards.alert_delivery import Receiver as To

    clock = [1_800_000_000.0]
    engine = Engine(store)
    loop = AlertLoop(Evaluator(store, load_rules(RULES), computed_verdicts(store, BUILTIN["mamba-hybrid"])),
                     [To.alertmanager(receiver.url.removesuffix("/alerts"))], out=lambda line: None,
                     interval_s=30, resend_s=60, clock=lambda: clock[0])
    engine.serve(0)
    engine.serve(10, fault=True)
    loop.cycle()
    (sent,) = receiver.received[0]
    assert sent["startsAt"] == "2027-01-15T08:00:00.000Z"
    assert sent["endsAt"] == "2027-01-15T08:04:00.000Z"  # valid for 4 x max(resend 60 s, interval 30 s)
    assert sent["generatorURL"].startswith("http://127.0.0.1:8050/gaps?from=")
    clock[0] += 30
    loop.cycle()
    assert len(receiver.received) == 1  # not due yet
    clock[0] += 30
    loop.cycle()
    (again,) = receiver.received[1]
    assert again["startsAt"] == sent["startsAt"] and again["endsAt"] == "2027-01-15T08:05:00.000Z"
    clock[0] += 5
    for t in range(200, 203):
        engine.serve(t)
    loop.cycle()
    (resolved,) = receiver.received[2]
    assert resolved["endsAt"] == "2027-01-15T08:01:05.000Z" and resolved["labels"] == sent["labels"]


def test_fingerprints_are_alertmanagers() -> None:
    from kvtrace.dashboards.alert_delivery import fingerprint

    # as a real Alertmanager 0.25 reported them for these label sets
    assert fingerprint({"alertname": "x", "model": "m"}) == "fb3d3aa8d643071c"
    assert fingerprint({"model": "m", "alertname": "x"}) == "fb3d3aa8d643071c"
    assert fingerprint({}) == "cbf29ce484222325"


@pytest.mark.parametrize("rule, labels, page, span_s", [
    ("{name: d, kind: divergence, window_s: 300}", (("model", "m"),), "gaps", 300),
    ("{name: r, kind: recoverable_drop, window_s: 300, baseline_s: 3600}", (("model", "m"),), "gaps", 3600),
    ("{name: u, kind: unsafe_reuse, by: [model, tenant]}", (("model", "m"), ("tenant", "")), "unsafe", 300),
    ("{name: g, kind: stream_gap, by: [instance], window_s: 120}", (("instance", "i-1"),), "health", 120),
    ("{name: f, kind: routing_regret, by: [instance]}", (("instance", "i-1"),), "fleet", 300),
])
def test_generator_urls_point_at_the_page_showing_the_cause(rule: str, labels: tuple, page: str,
                                                             span_s: int) -> None:
    from urllib.parse import parse_qs, urlsplit

    from kvtrace.dashboards.alerts import Alert, cause_url

    (r,) = load_rules(f"rules: [{rule}]")
    at = 1_750_000_000 * S + 500_000_000
    url = urlsplit(cause_url("http://dash:8050/", Alert(r, labels, Status.FIRING, at, 1.0, fired_ns=at)))
    assert url.path == f"/{page}"
    query = {k: v[0] for k, v in parse_qs(url.query).items()}
    assert query == {"from": str(1_750_000_000 - span_s), "to": str(1_750_000_001), **{k: v for k, v in labels if v}}


def test_run_stops_promptly_from_another_thread(store: Store) -> None:
    import threading
    import time

    loop = AlertLoop(Evaluator(store, load_rules(RULES)), out=lambda line: None)
    stop = threading.Event()
    worker = threading.Thread(target=loop.run, args=(3600, stop))
    worker.start()
    time.sleep(0.5)
    started = time.monotonic()
    stop.set()
    worker.join(5)
    assert not worker.is_alive() and time.monotonic() - started < 5


def test_bad_cli_input_is_refused_with_one_line(store: Store, tmp_path, capsys) -> None:  # noqa: ANN001
    from kvtrace.cli.main import main

    state = tmp_path / "state.json"
    state.write_text("{not json")
    assert main(["--dsn", str(store.dsn), "alerts", "--once", "--state", str(state)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: {state}: not an alert state file")
    assert main(["--dsn", str(store.dsn), "alerts", "--once", "--alertmanager", "am:9093"]) == 2
    assert capsys.readouterr().err.strip() == "error: 'am:9093': expected an http:// or https:// URL"
