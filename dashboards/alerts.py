"""Alert rules on hit-rate divergence and stream health, evaluated against the store.

Rules live in a YAML file (`DEFAULT_RULES` when none is given). Each evaluation looks at a
window ending at the newest event in the store (so a replayed trace is judged in its own time),
computes one value per label set (model, instance, ...), and moves each (rule, labels) through
pending -> firing -> resolved, the way Prometheus does: a condition must hold for `for_s` before
it fires, a firing alert is not re-sent every cycle, and it resolves once the condition clears.
Transitions go to an Alertmanager-compatible webhook (the JSON Alertmanager posts to its
receivers) and to the log; current values are also Prometheus gauges.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import msgspec
import polars as pl

from kvtrace.analysis.funnel import users
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
    keys = [b.value for b in by]
    frame = users(frame)  # a correctness canary's re-runs are not users' traffic
    prompt = pl.col("prompt_tokens").sum()
    aggs = [pl.len().alias("lookups"), prompt.alias("prompt"),
            ((pl.col("logical_hit_tokens") - pl.col("recoverable_hit_tokens")).sum() / prompt).alias("divergence"),
            (pl.col("recoverable_hit_tokens").sum() / prompt).alias("recoverable_rate"),
            pl.col("unsafe_reuse").cast(pl.Int64).sum().alias("unsafe")]
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
        column = "divergence" if rule.kind is RuleKind.DIVERGENCE else "unsafe"
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


_VERDICT_KINDS = (RuleKind.DIVERGENCE, RuleKind.UNSAFE_REUSE, RuleKind.RECOVERABLE_DROP)
_PER_INSTANCE = (RuleKind.STREAM_GAP, RuleKind.SILENT, RuleKind.EMITTER_DROPS, RuleKind.UNCLEAN_END)


# -- state and delivery ------------------------------------------------------------------------
class Status(StrEnum):
    PENDING = "pending"
    FIRING = "firing"
    RESOLVED = "resolved"


@dataclass(slots=True)
class Alert:
    rule: Rule
    labels: tuple[tuple[str, str], ...]
    status: Status
    since_ns: int  # when the condition started to hold (event time)
    value: float
    fired_ns: int = 0
    resolved_ns: int = 0
    detail: str = ""

    def payload(self) -> dict[str, Any]:
        """One alert as Alertmanager writes it in its webhook payload."""
        def iso(ns: int) -> str:
            return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ns / 1e9)) + f".{ns % 10**9 // 10**6:03d}Z"

        labels = {"alertname": self.rule.name, "severity": self.rule.severity, "kind": self.rule.kind.value,
                  **dict(self.labels)}
        return {"status": "firing" if self.status is Status.FIRING else "resolved", "labels": labels,
                "annotations": {"summary": self.rule.summary or self.rule.kind.value, "value": f"{self.value:.6g}",
                                **({"description": self.detail} if self.detail else {})},
                "startsAt": iso(self.fired_ns or self.since_ns),
                "endsAt": iso(self.resolved_ns) if self.resolved_ns else "0001-01-01T00:00:00Z",
                "generatorURL": "", "fingerprint": f"{self.rule.name}:{json.dumps(labels, sort_keys=True)}"}


@dataclass(slots=True)
class AlertState:
    """Pending and firing alerts across evaluations; returns what changed."""

    active: dict[tuple[str, tuple[tuple[str, str], ...]], Alert] = field(default_factory=dict)

    def update(self, rules: Sequence[Rule], samples: Sequence[Sample], now_ns: int) -> list[Alert]:
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
                alert.value, alert.detail = s.value, s.detail
                if alert.status is Status.PENDING and now_ns - alert.since_ns >= alert.rule.for_s * 1e9:
                    alert.status, alert.fired_ns = Status.FIRING, now_ns
                    changed.append(alert)
            elif alert is not None:
                self._clear(key, alert, now_ns, changed, s.value)
        for key, alert in list(self.active.items()):  # no sample at all any more: the condition is gone
            if key not in seen:
                self._clear(key, alert, now_ns, changed, alert.value)
        return changed

    def _clear(self, key: Any, alert: Alert, now_ns: int, changed: list[Alert], value: float) -> None:
        del self.active[key]
        if alert.status is Status.FIRING:
            alert.status, alert.resolved_ns, alert.value = Status.RESOLVED, now_ns, value
            changed.append(alert)

    def firing(self) -> list[Alert]:
        return [a for a in self.active.values() if a.status is Status.FIRING]


def webhook_payload(alerts: Sequence[Alert], receiver: str = "kvtrace") -> dict[str, Any]:
    """Alertmanager's webhook JSON (version 4), so any receiver built for it accepts ours."""
    firing = any(a.status is Status.FIRING for a in alerts)
    payloads = [a.payload() for a in alerts]
    common = {}
    if payloads:
        common = {k: v for k, v in payloads[0]["labels"].items()
                  if all(p["labels"].get(k) == v for p in payloads)}
    return {"version": "4", "receiver": receiver, "status": "firing" if firing else "resolved",
            "alerts": payloads, "groupLabels": {}, "commonLabels": common,
            "commonAnnotations": {}, "externalURL": "", "groupKey": "kvtrace", "truncatedAlerts": 0}


def post_webhook(url: str, alerts: Sequence[Alert], timeout_s: float = 10.0) -> None:
    body = json.dumps(webhook_payload(alerts)).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        response.read()


def rules_from_path(path: str | Path | None) -> list[Rule]:
    if path is None:
        return load_rules(DEFAULT_RULES, "default rules")
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise RuleError(f"{path}: cannot read: {exc.strerror}") from None
    return load_rules(text, str(path))


class AlertLoop:
    """Evaluate, update state, deliver: one `cycle()` per interval. Gauges mirror every value."""

    def __init__(self, evaluator: Evaluator, webhook: str = "", out: Callable[[str], None] = print) -> None:
        from prometheus_client import CollectorRegistry, Gauge

        self.evaluator = evaluator
        self.state = AlertState()
        self.webhook = webhook
        self.out = out
        self.registry = CollectorRegistry()
        self.values = Gauge("kvtrace_rule_value", "A rule's current value per label set.", ["rule", "labels"],
                            registry=self.registry)
        self.firing = Gauge("kvtrace_alert_firing", "1 while the alert fires.", ["rule", "labels"],
                            registry=self.registry)
        self.delivery_errors = 0

    def cycle(self) -> list[Alert]:
        now = self.evaluator.now_ns()
        samples = self.evaluator.evaluate(now)
        changed = self.state.update(self.evaluator.rules, samples, now)
        for s in samples:
            self.values.labels(s.rule, _label_text(s.labels)).set(s.value)
        for a in changed:
            self.firing.labels(a.rule.name, _label_text(a.labels)).set(1 if a.status is Status.FIRING else 0)
            detail = f": {a.detail}" if a.detail and a.status is Status.FIRING else ""
            self.out(f"{a.status.value.upper():8} {a.rule.name} {_label_text(a.labels)} value={a.value:.6g}{detail}")
        if changed and self.webhook:
            try:
                post_webhook(self.webhook, changed)
            except Exception as exc:  # noqa: BLE001 - a receiver down must not stop evaluation
                self.delivery_errors += 1
                log.warning("alert webhook %s failed: %s", self.webhook, exc)
        return changed

    def run(self, interval_s: float, stop: Callable[[], bool] = lambda: False) -> None:
        while not stop():
            started = time.monotonic()
            try:
                self.cycle()
            except Exception:  # noqa: BLE001 - the store may be briefly away; try next cycle
                log.exception("alert evaluation failed")
            time.sleep(max(0.0, interval_s - (time.monotonic() - started)))


def _label_text(labels: tuple[tuple[str, str], ...]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels)
