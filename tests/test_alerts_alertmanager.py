"""`kvtrace alerts --once` against a real Alertmanager (Debian's `prometheus-alertmanager`): a
store with an injected fault fires the divergence alert there with the rule's labels, the
fingerprint kvtrace printed (Alertmanager's own hash of the labels), a generatorURL to the
dashboard page and range that show the cause, and wall-clock times; Alertmanager notifies its
webhook receiver; newer healthy data resolves it there. A receiver that is down makes `--once`
exit 1 with one line naming it and the cause."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from tests.alert_helpers import START_NS, Receiver, free_port

HELPERS = Path(__file__).with_name("alert_helpers.py")
RULES = """
rules:
  - {name: divergence, kind: divergence, threshold: 0.01, window_s: 60, summary: hash hits not recoverable}
  - {name: unsafe, kind: unsafe_reuse, window_s: 60, severity: critical}
"""
AM_CONFIG = """
route:
  receiver: hook
  group_by: [alertname]
  group_wait: 100ms
  group_interval: 200ms
  repeat_interval: 1h
receivers:
  - name: hook
    webhook_configs:
      - url: {url}
        send_resolved: true
"""


def wait_for(check: Callable[[], object], timeout_s: float = 30.0) -> object:
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.1)
    return result


class Alertmanager:
    def __init__(self, root: Path, webhook: str) -> None:
        (root / "am.yml").write_text(AM_CONFIG.format(url=webhook))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = root / "alertmanager.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                ["prometheus-alertmanager", f"--config.file={root / 'am.yml'}", f"--storage.path={root / 'am-data'}",
                 f"--web.listen-address={self.url.removeprefix('http://')}", "--cluster.listen-address="],
                stdout=log, stderr=log)

        def ready() -> bool:
            assert self.proc.poll() is None, self.log.read_text()[-2000:]
            try:
                return httpx.get(self.url + "/-/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready)

    def alerts(self) -> list[dict]:
        return httpx.get(self.url + "/api/v2/alerts", timeout=5).json()


@pytest.fixture
def hook() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.server.shutdown()


@pytest.fixture
def alertmanager(tmp_path: Path, hook: Receiver) -> Iterator[Alertmanager]:
    am = Alertmanager(tmp_path, hook.url)
    yield am
    am.proc.terminate()
    am.proc.wait(30)


class OwnStore:
    """A store in its own directory, written and read by subprocesses only."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.dsn = f"chdb://{root / 'db'}"
        (root / "rules.yaml").write_text(RULES)
        self.env = {**os.environ, "KVTRACE_HOME": str(root)}
        self.env.pop("KVTRACE_DSN", None)

    def fill(self, phase: str) -> None:
        subprocess.run([sys.executable, str(HELPERS), self.dsn, phase], env=self.env, check=True, timeout=300)

    def alerts(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kvtrace.cli.main", "--dsn", self.dsn, "alerts", "--once",
             "--recipe", "mamba-hybrid", "--rules", str(self.root / "rules.yaml"),
             "--dashboard-url", "http://dash.example:8050", *args],
            env=self.env, capture_output=True, text=True, timeout=300)


def test_alertmanager_shows_the_fired_alert_and_then_its_resolution(tmp_path: Path, alertmanager: Alertmanager,
                                                                    hook: Receiver) -> None:
    store = OwnStore(tmp_path)
    store.fill("faulty")
    before = time.time()
    run = store.alerts("--alertmanager", alertmanager.url, "--state", str(tmp_path / "state.json"))
    after = time.time()
    assert run.returncode == 0, run.stderr
    printed = re.search(r"^FIRING +divergence model=jamba value=\S+ fingerprint=([0-9a-f]{16})$", run.stdout, re.M)
    assert printed, run.stdout

    (alert,) = alertmanager.alerts()
    assert alert["labels"] == {"alertname": "divergence", "severity": "warning", "kind": "divergence",
                               "model": "jamba"}
    assert alert["fingerprint"] == printed.group(1)  # Alertmanager's hash of the same labels
    assert alert["status"]["state"] == "active"
    assert alert["annotations"]["summary"] == "hash hits not recoverable"
    assert float(alert["annotations"]["value"]) > 0.01
    # the data time (the faulty lookup, trace second 10) is an annotation; the alert's times are wall clock
    fault_s = START_NS // 10**9 + 10
    assert alert["annotations"]["data_time"].startswith(time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(fault_s)))
    starts = _wall(alert["startsAt"])
    assert before - 1 <= starts <= after + 1
    assert _wall(alert["endsAt"]) >= starts + 4 * 60 - 1  # valid for 4 x the 60 s resend interval
    link = urlsplit(alert["generatorURL"])
    assert (link.scheme, link.netloc, link.path) == ("http", "dash.example:8050", "/gaps")
    query = {k: v[0] for k, v in parse_qs(link.query).items()}
    assert query["model"] == "jamba" and set(query) == {"from", "to", "model"}
    assert int(query["from"]) <= fault_s <= int(query["to"]) and int(query["to"]) - int(query["from"]) <= 62

    # Alertmanager routed it to its webhook receiver, fingerprint and link unchanged
    def notified(status: str) -> list[dict]:
        return [a for body in hook.received for a in body["alerts"] if a["status"] == status]

    (sent,) = wait_for(lambda: notified("firing"))
    assert sent["fingerprint"] == printed.group(1) and sent["generatorURL"] == alert["generatorURL"]

    store.fill("healthy")  # newer clean lookups; the faulty one has left the 60 s window
    run = store.alerts("--alertmanager", alertmanager.url, "--state", str(tmp_path / "state.json"))
    assert run.returncode == 0, run.stderr
    assert re.search(rf"^RESOLVED +divergence model=jamba .*fingerprint={printed.group(1)}$", run.stdout, re.M), \
        run.stdout
    assert alertmanager.alerts() == []  # resolved: no longer among the active alerts
    (resolved,) = wait_for(lambda: notified("resolved"))
    assert resolved["fingerprint"] == printed.group(1)
    assert _wall(resolved["endsAt"]) >= _wall(resolved["startsAt"])


def test_an_unreachable_receiver_fails_the_once_run_with_one_line(tmp_path: Path, alertmanager: Alertmanager) -> None:
    store = OwnStore(tmp_path)
    store.fill("faulty")
    dead = f"http://127.0.0.1:{free_port()}"
    run = store.alerts("--alertmanager", dead, "--alertmanager", alertmanager.url)
    assert run.returncode == 1
    (line,) = run.stderr.strip().splitlines()
    assert f"alertmanager {dead}/api/v2/alerts" in line and "failed after 3 attempts" in line, line
    assert "refused" in line.lower(), line
    assert "1 deliveries failed" in run.stdout
    # the receiver that was up got the alert all the same
    assert [a["labels"]["alertname"] for a in alertmanager.alerts()] == ["divergence"]


def _wall(rfc3339: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()
