"""The alert gauges through a real Prometheus (Debian's `prometheus`): it scrapes the alerts
loop's metrics port, and PromQL's `sum by (model)` over the rule values and the firing alerts
equals what kvtrace computed per model. That only works because every dimension is its own
label (empty where a rule does not split by it)."""

from __future__ import annotations

import subprocess
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvtrace.dashboards.alerts import AlertLoop, Evaluator, Status, computed_verdicts, load_rules
from kvtrace.schema.recipes import BUILTIN
from kvtrace.store.client import Store
from tests.alert_helpers import PREFIX, Engine, free_port

RULES = """
rules:
  - {name: div, kind: divergence, threshold: 0.01, window_s: 60}
  - {name: div-by-instance, kind: divergence, threshold: 0.01, window_s: 60, by: [model, instance]}
  - {name: gaps, kind: stream_gap, by: [instance]}
"""
CONFIG = """
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
scrape_configs:
  - job_name: kvtrace-alerts
    static_configs: [{{targets: ["127.0.0.1:{port}"]}}]
"""


class Prometheus:
    def __init__(self, root: Path, target_port: int) -> None:
        (root / "prometheus.yml").write_text(CONFIG.format(port=target_port))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = root / "prometheus.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                ["prometheus", f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'tsdb'}",
                 f"--web.listen-address={self.url.removeprefix('http://')}"], stdout=log, stderr=log)

    def query(self, promql: str) -> dict[str, float]:
        """An instant vector by its `model` label ("" where the series has none)."""
        assert self.proc.poll() is None, self.log.read_text()[-2000:]
        try:
            response = httpx.get(self.url + "/api/v1/query", params={"query": promql}, timeout=5)
        except httpx.HTTPError:
            return {}
        if response.status_code == 503:  # still starting
            return {}
        body = response.json()
        assert body["status"] == "success", body
        return {r["metric"].get("model", ""): float(r["value"][1]) for r in body["data"]["result"]}

    def wait_query(self, promql: str, models: set[str], timeout_s: float = 60.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout_s
        while set(result := self.query(promql)) != models:
            assert time.monotonic() < deadline, (promql, result, self.log.read_text()[-2000:])
            time.sleep(0.2)
        return result


@pytest.fixture
def loop(store: Store) -> Iterator[AlertLoop]:
    """Three engines: two instances of one model with a fault each, one clean model."""
    for instance, fault_at, offset in (("j-0", 10, 0), ("j-1", 11, 5000)):
        engine = Engine(store, instance=instance, prefix=[p + offset for p in PREFIX])
        for t in range(4):
            engine.serve(t)
        engine.serve(fault_at, fault=True)
        engine.emitter.shutdown()
    clean = Engine(store, model="mistral", instance="m-0", prefix=[p + 9000 for p in PREFIX])
    for t in range(6):
        clean.serve(t + 6)
    clean.emitter.shutdown()
    yield AlertLoop(Evaluator(store, load_rules(RULES), computed_verdicts(store, BUILTIN["mamba-hybrid"])),
                    out=lambda line: None)


def test_prometheus_sums_rule_values_and_firing_alerts_by_model(tmp_path: Path, loop: AlertLoop) -> None:
    from prometheus_client import start_http_server

    loop.cycle()
    samples, active = loop.snapshot()
    by_model: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for s in samples:
        by_model[s.rule][dict(s.labels).get("model", "")] += s.value
    firing: dict[str, float] = defaultdict(float)
    for a in active:
        firing[dict(a.labels).get("model", "")] += a.status is Status.FIRING
    # what kvtrace computed: both jamba instances diverge, mistral does not
    per_instance = {dict(s.labels)["instance"]: s.value for s in samples if s.rule == "div-by-instance"}
    assert per_instance["j-0"] > 0.01 and per_instance["j-1"] > 0.01 and per_instance["m-0"] == 0
    assert firing == {"jamba": 3.0}  # div for the model, div-by-instance for each instance

    port = free_port()
    server, _ = start_http_server(port, addr="127.0.0.1", registry=loop.registry)
    prometheus = Prometheus(tmp_path, port)
    try:
        for rule in ("div", "div-by-instance"):
            got = prometheus.wait_query(f'sum by (model) (kvtrace_rule_value{{rule="{rule}"}})', {"jamba", "mistral"})
            assert got == pytest.approx(dict(by_model[rule]), rel=1e-12)
        everything = defaultdict(float)
        for values in by_model.values():
            for model, v in values.items():
                everything[model] += v
        got = prometheus.wait_query("sum by (model) (kvtrace_rule_value)", set(everything))
        assert got == pytest.approx(dict(everything), rel=1e-12)  # the stream rule's series sum under model=""
        assert prometheus.wait_query("sum by (model) (kvtrace_alert_firing)", {"jamba"}) == firing
        # one label per dimension, not one packed label
        series = httpx.get(prometheus.url + "/api/v1/series", params={"match[]": 'kvtrace_rule_value{rule="div"}'},
                           timeout=5).json()["data"]
        assert {s["model"] for s in series} == {"jamba", "mistral"} and "labels" not in series[0]
    finally:
        prometheus.proc.terminate()
        prometheus.proc.wait(30)
        server.shutdown()
