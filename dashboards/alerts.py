"""Alert rules on hit-rate divergence and stream health, evaluated against the store.

Rules live in a YAML file (`DEFAULT_RULES` when none is given). Each evaluation looks at a
window ending at the newest event in the store (so a replayed trace is judged in its own time),
computes one value per label set (model, instance, ...), and moves each (rule, labels) through
pending -> firing -> resolved, the way Prometheus does: a condition must hold for `for_s` before
it fires, and it resolves once the condition clears. What receivers see is stamped with the wall
clock (when it fired and resolved here), with the data time as an annotation and a link to the
dashboard page showing the cause. Transitions go to Alertmanagers (their v2 API) and to
Alertmanager-style webhooks (`alert_delivery`) and to the log; current values are also
Prometheus gauges, one label per dimension.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlencode

import msgspec
import polars as pl

from kvtrace.analysis.funnel import admitted, of_counted, users
from kvtrace.dashboards.alert_delivery import (
    DeliveryError,
    Notice,
    Outbox,
    Receiver,
    ReceiverKind,
    RetryPolicy,
    deliver,
    fingerprint,
    rfc3339,
    webhook_payload,
)
from kvtrace.schema.kinds import Ending
from kvtrace.schema.recipes import Recipe, RecipeBook
from kvtrace.store.client import EmitterEnd, Store

log = logging.getLogger("kvtrace.alerts")


class RuleKind(StrEnum):
    DIVERGENCE = "divergence"  # (logical - recoverable) / prompt tokens above threshold
    UNSAFE_REUSE = "unsafe_reuse"  # lookups that adopted beyond what was recoverable, above threshold
    RECOVERABLE_DROP = "recoverable_drop"  # recoverable rate fell this share below its own baseline
    STREAM_GAP = "stream_gap"  # events missing from an emitter's sequence, above threshold
    SILENT = "silent"  # an instance sent nothing for `window_s`, after sending in the baseline
    EMITTER_DROPS = "emitter_drops"  # events the emitters reported dropped, above threshold
    UNCLEAN_END = "unclean_end"  # emitters whose process died before they shut down, above threshold
    ROUTING_REGRET = "routing_regret"  # tokens recoverable on another instance, not the chosen one / prompt tokens


class Label(StrEnum):
    MODEL = "model"
    INSTANCE = "instance"
    TENANT = "tenant"


Share = Annotated[float, msgspec.Meta(ge=0.0)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0)]


class Rule(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: Annotated[str, msgspec.Meta(min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")]
    kind: RuleKind
    threshold: Share = 0.0
    window_s: Annotated[float, msgspec.Meta(gt=0.0)] = 300.0
    for_s: Seconds = 0.0
    baseline_s: Annotated[float, msgspec.Meta(gt=0.0)] = 3600.0
    min_lookups: Annotated[int, msgspec.Meta(ge=0)] = 1
    by: list[Label] = msgspec.field(default_factory=lambda: [Label.MODEL])
    severity: Annotated[str, msgspec.Meta(pattern=r"^(info|warning|critical)$")] = "warning"
    summary: str = ""


class RuleFile(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    rules: list[Rule]


class RuleError(ValueError):
    """A rule file that cannot be used; the message names the rule and the field."""


DEFAULT_RULES = """\
rules:
  - name: recoverable-below-logical
    kind: divergence
    threshold: 0.05          # 5 % of prompt tokens hit by hash but not recoverable
    window_s: 300
    for_s: 60
    summary: hash hits the engine cannot resume from
  - name: unsafe-reuse
    kind: unsafe_reuse
    threshold: 0             # any lookup that reused more than was valid
    window_s: 300
    severity: critical
    summary: state reused beyond what was recoverable (wrong outputs)
  - name: recoverable-rate-drop
    kind: recoverable_drop
    threshold: 0.3           # 30 % below the last hour's rate
    window_s: 300
    baseline_s: 3600
    min_lookups: 20
  - name: event-stream-gaps
    kind: stream_gap
    threshold: 0
    by: [instance]
  - name: instance-silent
    kind: silent
    window_s: 120
    by: [instance]
  - name: emitter-drops
    kind: emitter_drops
    threshold: 0
    by: [instance]
  - name: engine-ended-unclean
    kind: unclean_end
    threshold: 0             # any engine process killed (SIGKILL, OOM) before its emitter shut down
    window_s: 3600
    by: [instance]
    summary: an engine process died without shutting down; the description counts its event gap
  - name: routing-regret
    kind: routing_regret
    threshold: 0.1           # 10 % of prompt tokens were recoverable on another instance, not the chosen one
    window_s: 300
    for_s: 60
    min_lookups: 20
    summary: requests sent away from the instance that held their prefix (verdicts judged with the fleet view)
"""


def load_rules(text: str, source: str = "rules") -> list[Rule]:
    """Parse and check a rule file; errors say which rule (by name, or position) and field."""
    try:
        raw = msgspec.yaml.decode(text)
    except msgspec.DecodeError as exc:
        raise RuleError(f"{source}: not YAML: {exc}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("rules"), list):
        raise RuleError(f"{source}: expected a mapping with a `rules` list")
    for i, item in enumerate(raw["rules"]):
        where = f"{source}: rule {item.get('name') if isinstance(item, dict) and item.get('name') else f'#{i + 1}'}"
        try:
            msgspec.convert(item, Rule)
        except msgspec.ValidationError as exc:
            raise RuleError(f"{where}: {_field_message(str(exc))}") from None
    rules = msgspec.convert(raw, RuleFile).rules
    names = [r.name for r in rules]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise RuleError(f"{source}: rule {dupes[0]}: name: used by more than one rule")
    for r in rules:
        if r.kind is RuleKind.RECOVERABLE_DROP and r.baseline_s <= r.window_s:
            raise RuleError(f"{source}: rule {r.name}: baseline_s: must be longer than window_s ({r.window_s})")
        if r.kind in _PER_INSTANCE and r.by != [Label.INSTANCE]:
            raise RuleError(f"{source}: rule {r.name}: by: {r.kind.value} rules are per instance (by: [instance])")
    return rules


def _field_message(message: str) -> str:
    """msgspec's '... - at `$.threshold`' as 'threshold: ...'."""
    text, _, path = message.partition(" - at `$")
    path = path.rstrip("`").lstrip(".")
    if not path and "field `" in text:  # unknown or missing field
        path = text.split("field `", 1)[1].split("`", 1)[0]
    return f"{path}: {text}" if path else text


# -- evaluation --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Sample:
    """One rule's value for one label set at one evaluation."""

    rule: str
    labels: tuple[tuple[str, str], ...]
    value: float
    breaching: bool
    detail: str = ""  # what the value counts, for the alert's description


VerdictSource = Callable[[int, int], pl.DataFrame]
"""(since_ns, until_ns) -> per-lookup verdict rows in that time range."""


def stored_verdicts(store: Store) -> VerdictSource:
    """The verdicts the collector's live reconstruction wrote."""

    def read(since_ns: int, until_ns: int) -> pl.DataFrame:
        return store.query_polars(
            f"SELECT * FROM {store.db}.verdicts FINAL WHERE ts_ns >= {{a:Int64}} AND ts_ns <= {{b:Int64}}",
            {"a": since_ns, "b": until_ns})

    return read


def computed_verdicts(store: Store, recipes: RecipeBook | Recipe) -> VerdictSource:
    """Verdicts computed in the store from the events (no live reconstruction needed): every
    event up to the window's end builds the state, only the window's lookups are kept."""
    from kvtrace.analysis.sql import clickhouse_results

    def read(since_ns: int, until_ns: int) -> pl.DataFrame:
        frame = clickhouse_results(store, recipes, where=f"ts_ns <= {int(until_ns)}")
        return frame.filter(pl.col("ts_ns") >= since_ns)

    return read


def _labels(row: Mapping[str, Any], by: Sequence[Label]) -> tuple[tuple[str, str], ...]:
    return tuple((b.value, str(row[b.value])) for b in by)


def _rates(frame: pl.DataFrame, by: Sequence[Label]) -> pl.DataFrame:
    """The rates over the lookups the engine counts (`funnel.counted`); unsafe reuse over every
    adopted lookup, re-admissions after a preemption too."""
    keys = [b.value for b in by]
    frame = users(frame)  # a correctness canary's re-runs are not users' traffic
    def of(column: str) -> pl.Expr:
        return of_counted(frame, column)

    prompt = of("prompt_tokens").sum()
    aggs = [admitted(frame, first=True).sum().alias("lookups"), prompt.alias("prompt"),
            ((of("logical_hit_tokens") - of("recoverable_hit_tokens")).sum() / prompt).alias("divergence"),
            (of("recoverable_hit_tokens").sum() / prompt).alias("recoverable_rate"),
            pl.col("unsafe_reuse").cast(pl.Int64).sum().alias("unsafe"),
            (of("routing_regret_tokens").sum() / prompt).alias("routing_regret")]
    return frame.group_by(keys).agg(aggs) if keys else frame.select(aggs)


class Evaluator:
    """Evaluates rules against one store; keeps no state (the AlertState does)."""

    def __init__(self, store: Store, rules: Sequence[Rule], verdicts: VerdictSource | None = None) -> None:
        self.store = store
        self.rules = list(rules)
        self.verdicts = verdicts or stored_verdicts(store)

    def now_ns(self) -> int:
        """The newest event time: the clock rules judge by."""
        return int(self.store.scalar(f"SELECT max(ts_ns) FROM {self.store.db}.events") or 0)

    def evaluate(self, now_ns: int | None = None) -> list[Sample]:
        now = self.now_ns() if now_ns is None else now_ns
        out: list[Sample] = []
        if not now:
            return out
        longest = max((max(r.window_s, r.baseline_s if r.kind is RuleKind.RECOVERABLE_DROP else 0)
                       for r in self.rules if r.kind in _VERDICT_KINDS), default=0.0)
        frame = self.verdicts(now - int(longest * 1e9), now) if longest else pl.DataFrame()
        for rule in self.rules:
            since = now - int(rule.window_s * 1e9)
            if rule.kind in _VERDICT_KINDS:
                out += self._verdict_rule(rule, frame, since, now)
            elif rule.kind is RuleKind.STREAM_GAP:
                out += self._gaps(rule, since, now)
            elif rule.kind is RuleKind.SILENT:
                out += self._silent(rule, since, now)
            elif rule.kind is RuleKind.UNCLEAN_END:
                out += self._unclean(rule, since)
            else:
                out += self._drops(rule, since, now)
        return out

    def _verdict_rule(self, rule: Rule, frame: pl.DataFrame, since: int, now: int) -> list[Sample]:
        if frame.is_empty():
            return []
        window = _rates(frame.filter(pl.col("ts_ns") >= since), rule.by)
        out = []
        if rule.kind is RuleKind.RECOVERABLE_DROP:
            base = _rates(frame.filter((pl.col("ts_ns") >= now - int(rule.baseline_s * 1e9))
                                       & (pl.col("ts_ns") < since)), rule.by)
            baseline = {_labels(r, rule.by): r for r in base.iter_rows(named=True)}
            for r in window.iter_rows(named=True):
                b = baseline.get(_labels(r, rule.by))
                if (b is None or b["lookups"] < rule.min_lookups or r["lookups"] < rule.min_lookups
                        or not b["recoverable_rate"]):
                    continue
                drop = 1.0 - r["recoverable_rate"] / b["recoverable_rate"]
                out.append(Sample(rule.name, _labels(r, rule.by), drop, drop > rule.threshold))
            return out
        column = {RuleKind.DIVERGENCE: "divergence", RuleKind.ROUTING_REGRET: "routing_regret"}.get(rule.kind, "unsafe")
        for r in window.iter_rows(named=True):
            if r["lookups"] < rule.min_lookups:
                continue
            value = float(r[column] or 0)
            out.append(Sample(rule.name, _labels(r, rule.by), value, value > rule.threshold))
        return out

    def _gaps(self, rule: Rule, since: int, now: int) -> list[Sample]:
        rows = self.store.query_arrow(
            "SELECT instance, sum(missing) AS missing FROM (SELECT instance, source_id, "
            "max(seq) - min(seq) + 1 - uniqExact(seq) AS missing "
            f"FROM {self.store.db}.events WHERE ts_ns >= {{a:Int64}} AND ts_ns <= {{b:Int64}} "
            "GROUP BY instance, source_id) GROUP BY instance", {"a": since, "b": now}).to_pylist()
        return [Sample(rule.name, (("instance", r["instance"]),), float(r["missing"]), r["missing"] > rule.threshold)
                for r in rows]

    def _silent(self, rule: Rule, since: int, now: int) -> list[Sample]:
        rows = self.store.query_arrow(
            f"SELECT instance, max(ts_ns) AS last FROM {self.store.db}.events "
            "WHERE ts_ns >= {a:Int64} GROUP BY instance", {"a": now - int(rule.baseline_s * 1e9)}).to_pylist()
        return [Sample(rule.name, (("instance", r["instance"]),), (now - r["last"]) / 1e9, r["last"] < since)
                for r in rows]

    def _drops(self, rule: Rule, since: int, now: int) -> list[Sample]:
        rows = self.store.query_arrow(
            "SELECT instance, sum(d) AS dropped FROM (SELECT instance, source_id, writer, "
            "max(dropped_queue_full + dropped_export_failed + dropped_invalid + dropped_shutdown) - "
            "min(dropped_queue_full + dropped_export_failed + dropped_invalid + dropped_shutdown) AS d "
            f"FROM {self.store.db}.emitter_stats FINAL WHERE ts_ns >= {{a:Int64}} AND ts_ns <= {{b:Int64}} "
            "GROUP BY instance, source_id, writer) GROUP BY instance", {"a": since, "b": now}).to_pylist()
        return [Sample(rule.name, (("instance", r["instance"]),), float(r["dropped"]), r["dropped"] > rule.threshold)
                for r in rows]

    def _unclean(self, rule: Rule, since: int) -> list[Sample]:
        """Unclean endings since the window's start. Not bounded by `now`: an emitter's end is its
        last sign of life, which can come a schedule delay after the newest event stored."""
        by_instance: dict[str, list[EmitterEnd]] = {}
        for end in self.store.emitter_endings(Ending.UNCLEAN):
            if end.ended_ns >= since:
                by_instance.setdefault(end.instance, []).append(end)
        return [Sample(rule.name, (("instance", instance),), float(len(ends)), len(ends) > rule.threshold,
                       "; ".join(_ending(e) for e in ends)) for instance, ends in sorted(by_instance.items())]


def _ending(end: EmitterEnd) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(end.ended_ns / 1e9))
    gap = (f"{end.missing:,} events missing ({end.dropped:,} dropped as counted, {end.unaccounted:,} unaccounted)"
           if end.missing else "no events missing")
    return (f"{end.engine or 'emitter'} source {end.source_id:016x} ended unclean at {when} UTC: {gap}; "
            f"{end.recovered:,} shipped from its journal after it died")


_VERDICT_KINDS = (RuleKind.DIVERGENCE, RuleKind.UNSAFE_REUSE, RuleKind.RECOVERABLE_DROP, RuleKind.ROUTING_REGRET)
_PER_INSTANCE = (RuleKind.STREAM_GAP, RuleKind.SILENT, RuleKind.EMITTER_DROPS, RuleKind.UNCLEAN_END)


# -- state -------------------------------------------------------------------------------------
class Status(StrEnum):
    PENDING = "pending"
    FIRING = "firing"
    RESOLVED = "resolved"


@dataclass(slots=True)
class Alert:
    """One (rule, label set) through pending -> firing -> resolved. Two clocks: the `_ns` times
    are the store's (the data the rule judged), the `_s` times are the wall clock (when it fired
    and resolved here, which is what receivers and people reading them expect)."""

    rule: Rule
    labels: tuple[tuple[str, str], ...]
    status: Status
    since_ns: int  # when the condition started to hold (data time)
    value: float
    fired_ns: int = 0  # data time of the evaluation that fired it
    resolved_ns: int = 0
    detail: str = ""
    starts_at_s: float = 0.0  # wall clock
    ends_at_s: float = 0.0
    data_ns: int = 0  # data time of the latest evaluation that saw it

    @property
    def alert_labels(self) -> dict[str, str]:
        """The labels receivers see; a dimension without a value is left out, as Alertmanager does."""
        return {"alertname": self.rule.name, "severity": self.rule.severity, "kind": self.rule.kind.value,
                **{k: v for k, v in self.labels if v}}

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.alert_labels)

    def payload(self, dashboard_url: str = "") -> dict[str, Any]:
        """The alert as it appears in a webhook notification."""
        return notice(self, dashboard_url or DEFAULT_DASHBOARD_URL).webhook()


@dataclass(slots=True)
class AlertState:
    """Pending and firing alerts across evaluations; returns what changed."""

    active: dict[tuple[str, tuple[tuple[str, str], ...]], Alert] = field(default_factory=dict)

    def update(self, rules: Sequence[Rule], samples: Sequence[Sample], now_ns: int,
               wall_s: float | None = None) -> list[Alert]:
        wall = time.time() if wall_s is None else wall_s
        by_name = {r.name: r for r in rules}
        changed: list[Alert] = []
        seen = set()
        for s in samples:
            key = (s.rule, s.labels)
            seen.add(key)
            alert = self.active.get(key)
            if s.breaching:
                if alert is None:
                    alert = self.active[key] = Alert(by_name[s.rule], s.labels, Status.PENDING, now_ns, s.value)
                alert.value, alert.detail, alert.data_ns = s.value, s.detail, now_ns
                if alert.status is Status.PENDING and now_ns - alert.since_ns >= alert.rule.for_s * 1e9:
                    alert.status, alert.fired_ns, alert.starts_at_s = Status.FIRING, now_ns, wall
                    changed.append(alert)
            elif alert is not None:
                self._clear(key, alert, now_ns, wall, changed, s.value)
        for key, alert in list(self.active.items()):  # no sample at all any more: the condition is gone
            if key not in seen:
                self._clear(key, alert, now_ns, wall, changed, alert.value)
        return changed

    def _clear(self, key: Any, alert: Alert, now_ns: int, wall: float, changed: list[Alert], value: float) -> None:
        del self.active[key]
        if alert.status is Status.FIRING:
            alert.status, alert.resolved_ns, alert.ends_at_s, alert.value = Status.RESOLVED, now_ns, wall, value
            alert.data_ns = now_ns
            changed.append(alert)

    def firing(self) -> list[Alert]:
        return [a for a in self.active.values() if a.status is Status.FIRING]


# -- where the cause is shown ------------------------------------------------------------------
DEFAULT_DASHBOARD_URL = "http://127.0.0.1:8050"  # `kvtrace dashboard`'s default address

_PAGE = {RuleKind.DIVERGENCE: "gaps", RuleKind.RECOVERABLE_DROP: "gaps", RuleKind.UNSAFE_REUSE: "unsafe",
         RuleKind.ROUTING_REGRET: "fleet"}


def cause_url(dashboard_url: str, alert: Alert) -> str:
    """The dashboard page that shows why the alert fired: its page for the rule's kind (stream
    rules: the event streams), filtered to the alert's labels, over the data range the rule judged
    when it fired (Unix seconds of the store's clock, which is the dashboard's)."""
    rule = alert.rule
    page = _PAGE.get(rule.kind, "health")
    span = rule.baseline_s if rule.kind in (RuleKind.RECOVERABLE_DROP, RuleKind.SILENT) else rule.window_s
    at = alert.fired_ns or alert.data_ns or alert.since_ns
    query = {"from": max(0, (at - int(span * 1e9)) // 10**9), "to": -(-at // 10**9),
             **{k: v for k, v in alert.labels if v}}
    return f"{dashboard_url.rstrip('/')}/{page}?{urlencode(query)}"


def notice(alert: Alert, dashboard_url: str = DEFAULT_DASHBOARD_URL) -> Notice:
    """The alert as receivers get it, frozen now."""
    annotations = {"summary": alert.rule.summary or alert.rule.kind.value, "value": f"{alert.value:.6g}",
                   "data_time": rfc3339(alert.data_ns / 1e9) if alert.data_ns else ""}
    if alert.detail:
        annotations["description"] = alert.detail
    return Notice(labels=alert.alert_labels, annotations={k: v for k, v in annotations.items() if v},
                  firing=alert.status is Status.FIRING, starts_at_s=alert.starts_at_s,
                  ends_at_s=alert.ends_at_s if alert.status is Status.RESOLVED else 0.0,
                  generator_url=cause_url(dashboard_url, alert) if dashboard_url else "")


def rules_from_path(path: str | Path | None) -> list[Rule]:
    if path is None:
        return load_rules(DEFAULT_RULES, "default rules")
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise RuleError(f"{path}: cannot read: {exc.strerror}") from None
    return load_rules(text, str(path))


# -- the loop ----------------------------------------------------------------------------------
DIMENSIONS = tuple(label.value for label in Label)


class _Saved(msgspec.Struct, kw_only=True):
    """What `--state` keeps between runs: the active alerts and the undelivered notifications."""

    class Active(msgspec.Struct, kw_only=True):
        rule: str
        labels: list[tuple[str, str]]
        status: Status
        since_ns: int
        value: float
        fired_ns: int = 0
        starts_at_s: float = 0.0
        detail: str = ""
        data_ns: int = 0

    active: list[Active] = []
    queued: dict[str, list[Notice]] = {}
    last_sent_s: dict[str, float] = {}


class AlertLoop:
    """Evaluate, update state, deliver: one `cycle()` per interval.

    Safe to run in a thread of a process that does other work (it installs no signal handlers,
    and `run` returns promptly once `stop` is set). Alertmanagers get every firing alert again
    at least every `resend_s`, each valid for 4 x max(resend, interval) (as Prometheus does), so
    an alert whose source dies resolves there on its own; webhooks get transitions only.
    `registry` holds the gauges, one Prometheus label per dimension."""

    def __init__(self, evaluator: Evaluator, receivers: Sequence[Receiver | str] = (), *,
                 dashboard_url: str = DEFAULT_DASHBOARD_URL, out: Callable[[str], None] = print,
                 interval_s: float = 30.0, resend_s: float = 60.0, retry: RetryPolicy | None = None,
                 state_path: str | Path | None = None, outbox_limit: int = 1000,
                 clock: Callable[[], float] = time.time) -> None:
        from prometheus_client import CollectorRegistry

        self.evaluator = evaluator
        self.state = AlertState()
        self.receivers = [Receiver(ReceiverKind.WEBHOOK, r) if isinstance(r, str) else r for r in receivers]
        self.outboxes = [Outbox(r, outbox_limit) for r in self.receivers]
        self.dashboard_url = dashboard_url
        self.out = out
        self.interval_s = interval_s
        self.resend_s = resend_s
        self.retry = retry or RetryPolicy()
        self.state_path = Path(state_path) if state_path else None
        self.clock = clock
        self.last_sent_s: dict[Receiver, float] = {}
        self.failures: dict[Receiver, int] = dict.fromkeys(self.receivers, 0)
        self.samples: list[Sample] = []
        self.last_failures: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.registry = CollectorRegistry()
        self.registry.register(_Metrics(self))
        if self.state_path is not None and self.state_path.exists():
            self._load(self.state_path)

    @property
    def valid_for_s(self) -> float:
        return 4 * max(self.resend_s, self.interval_s)

    def cycle(self) -> list[Alert]:
        """One evaluation: returns the transitions; `last_failures` holds the deliveries that
        failed (one line each, naming the receiver and the cause)."""
        now = self.evaluator.now_ns()
        wall = self.clock()
        samples = self.evaluator.evaluate(now)
        with self._lock:
            changed = self.state.update(self.evaluator.rules, samples, now, wall)
            self.samples = samples
        for a in changed:
            detail = f": {a.detail}" if a.detail and a.status is Status.FIRING else ""
            self.out(f"{a.status.value.upper():8} {a.rule.name} {_label_text(a.labels)} value={a.value:.6g}{detail} "
                     f"fingerprint={a.fingerprint}")
        self.last_failures = self._deliver([notice(a, self.dashboard_url) for a in changed], wall)
        if self.state_path is not None:
            self._save(self.state_path)
        return changed

    def _deliver(self, notices: list[Notice], wall: float) -> list[str]:
        failures = []
        for box in self.outboxes:
            receiver = box.receiver
            if receiver.kind is ReceiverKind.WEBHOOK:
                box.add(notices)
                if not box.queued:
                    continue
                body: Any = webhook_payload(box.queued)
            else:
                box.add(n for n in notices if not n.firing)  # firing ones are re-read from the state
                firing = [notice(a, self.dashboard_url) for a in self.state.firing()]
                due = notices or box.queued or wall - self.last_sent_s.get(receiver, 0.0) >= self.resend_s
                if not due or not (firing or box.queued):
                    continue
                now_firing = {n.fingerprint for n in firing}
                batch = [n for n in box.queued if n.fingerprint not in now_firing] + firing
                body = [n.alertmanager(wall + self.valid_for_s) for n in batch]
            try:
                deliver(receiver, body, self.retry, sleep=self._stop.wait)
            except DeliveryError as exc:
                self.failures[receiver] += 1
                failures.append(str(exc))
                log.error("%s", exc)
                if not exc.retryable:  # the receiver refuses these: sending them again will not help
                    box.queued.clear()
                continue
            box.queued.clear()
            self.last_sent_s[receiver] = wall
        return failures

    def run(self, interval_s: float, stop: threading.Event | None = None) -> None:
        """Cycle every `interval_s` until `stop` is set; an evaluation that fails (the store
        briefly away) is logged and tried again next interval."""
        self.interval_s = interval_s
        if stop is not None:
            self._stop = stop
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.cycle()
            except Exception:  # noqa: BLE001 - the store may be briefly away; try next cycle
                log.exception("alert evaluation failed")
            self._stop.wait(max(0.0, interval_s - (time.monotonic() - started)))

    def stop(self) -> None:
        self._stop.set()

    def snapshot(self) -> tuple[list[Sample], list[Alert]]:
        with self._lock:
            return list(self.samples), list(self.state.active.values())

    # -- persistence, for `--once` runs from cron --
    def _save(self, path: Path) -> None:
        saved = _Saved(
            active=[_Saved.Active(rule=a.rule.name, labels=list(a.labels), status=a.status, since_ns=a.since_ns,
                                  value=a.value, fired_ns=a.fired_ns, starts_at_s=a.starts_at_s, detail=a.detail,
                                  data_ns=a.data_ns) for a in self.state.active.values()],
            queued={str(box.receiver): box.queued for box in self.outboxes if box.queued},
            last_sent_s={str(r): t for r, t in self.last_sent_s.items()})
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(msgspec.json.encode(saved))
        tmp.replace(path)

    def _load(self, path: Path) -> None:
        try:
            saved = msgspec.json.decode(path.read_bytes(), type=_Saved)
        except (OSError, msgspec.DecodeError) as exc:
            raise AlertStateError(f"{path}: not an alert state file: {exc}") from None
        rules = {r.name: r for r in self.evaluator.rules}
        for a in saved.active:
            if a.rule in rules:  # a rule removed since: its alerts go with it
                labels = tuple(tuple(kv) for kv in a.labels)
                self.state.active[(a.rule, labels)] = Alert(
                    rules[a.rule], labels, a.status, a.since_ns, a.value, fired_ns=a.fired_ns, detail=a.detail,
                    starts_at_s=a.starts_at_s, data_ns=a.data_ns)
        for box in self.outboxes:
            box.add(saved.queued.get(str(box.receiver), []))
        self.last_sent_s = {r: saved.last_sent_s[str(r)] for r in self.receivers if str(r) in saved.last_sent_s}


class AlertStateError(ValueError):
    """A `--state` file that cannot be read back."""


def alert_loop(store: Store, *, rules: Sequence[Rule] | None = None, recipes: RecipeBook | None = None,
               alertmanagers: Sequence[str] = (), webhooks: Sequence[str] = (), **options: Any) -> AlertLoop:
    """The loop over a store, as `kvtrace alerts` builds it: the built-in rules unless given,
    verdicts from the collector's table unless recipes are named (then computed from the
    events), Alertmanagers by base URL, webhooks by URL; `options` go to AlertLoop."""
    verdicts = computed_verdicts(store, recipes) if recipes else None
    evaluator = Evaluator(store, rules_from_path(None) if rules is None else rules, verdicts)
    receivers = [*(Receiver.alertmanager(u) for u in alertmanagers),
                 *(Receiver(ReceiverKind.WEBHOOK, u) for u in webhooks)]
    return AlertLoop(evaluator, receivers, **options)


class _Metrics:
    """The loop's gauges, read at scrape time from the latest evaluation: a label set that is
    gone from the store is gone from the scrape (no stale series). Every dimension is its own
    label, empty where a rule does not split by it, so `sum by (model) (kvtrace_rule_value)`
    works across rules."""

    def __init__(self, loop: AlertLoop) -> None:
        self.loop = loop

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        samples, active = self.loop.snapshot()
        values = GaugeMetricFamily("kvtrace_rule_value", "A rule's current value per label set.",
                                   labels=["rule", *DIMENSIONS])
        for s in samples:
            values.add_metric([s.rule, *_dimensions(s.labels)], s.value)
        firing = GaugeMetricFamily("kvtrace_alert_firing", "1 while the alert fires, 0 while pending.",
                                   labels=["rule", "severity", *DIMENSIONS])
        for a in active:
            firing.add_metric([a.rule.name, a.rule.severity, *_dimensions(a.labels)],
                              1.0 if a.status is Status.FIRING else 0.0)
        failed = CounterMetricFamily("kvtrace_alert_delivery_failures", "Deliveries that failed after retries.",
                                     labels=["receiver"])
        for receiver, count in self.loop.failures.items():
            failed.add_metric([str(receiver)], count)
        return [values, firing, failed]


def _dimensions(labels: tuple[tuple[str, str], ...]) -> list[str]:
    given = dict(labels)
    return [given.get(d, "") for d in DIMENSIONS]


def _label_text(labels: tuple[tuple[str, str], ...]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels)
