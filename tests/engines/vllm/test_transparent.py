"""The plugin never changes what the engine does, proven as operators run it: vLLM's OpenAI
server started twice on the same checkpoint, once with kvtrace off and once with it on by
environment only, each driven through the same runtime operations an operator uses, one at a
time, and each operation's outcome compared: status codes, outputs at temperature 0, cached
tokens, the bodies of the control endpoints, `/metrics`, and an engine that stays alive.

The operations: a request of each API kind (completions from text and from token ids, chat),
loading a LoRA adapter, reloading it in place from rewritten files, loading it again without
`load_inplace` (refused), unloading it twice, `reset_prefix_cache`, a weight reload through
`collective_rpc`, sleep and wake-up, pause and resume (keeping requests, and aborting them with
the cache cleared), a client that drops its stream, `abort_requests` with a request in flight,
and `/metrics`.

With kvtrace on, the engine's events go to a real collector, and the reuse vLLM gets wrong is
caught with no recipe named anywhere: after the adapter's in-place reload vLLM reuses the blocks
the old adapter weights computed (vLLM #30931; its outputs then differ from the same request
after a reset), and after `reload_weights` it reuses blocks of the old weights. kvtrace's adapter
fingerprint and model revision make exactly those two lookups unsafe (identity mismatch), while
the clean repeats before them stay recoverable; `kvtrace alerts` fires and the dashboard lists
them. One module-scoped setup runs both servers (about two minutes on two cores).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest
from collector_proc import free_port
from served import Proc, dump_dom, kvtrace, lora_adapter, metric, start_collector, tiny_llama

MODEL = "tiny-llama"
ADAPTER = "sql"
MAX_MODEL_LEN = 2048
BLOCK = 32
PROMPT_TOKENS = 256  # 7 full blocks are reusable (the last token is always computed): 224 tokens
REUSABLE = (PROMPT_TOKENS - 1) // BLOCK * BLOCK
INSTANCE = "vllm-ops"
TENANT = "ops"
READ_TOKEN, ENGINE_TOKEN = "read-ops-41d2", "engine-ops-8c1e"
START_S = 300
SETTLE_S = 120

BASE = [10 + (i * 7) % 2000 for i in range(PROMPT_TOKENS)]
LORA = [20 + (i * 13) % 2000 for i in range(PROMPT_TOKENS)]


@dataclass(frozen=True)
class Step:
    """One operation and what the server answered, less what differs between any two runs
    (request ids, timestamps)."""

    name: str
    status: int
    said: str


@dataclass
class Run:
    """One server's life under the operations."""

    steps: list[Step] = field(default_factory=list)
    alive: bool = False  # the server process, after the last step
    log: str = ""  # the server's, until it was stopped


class Operator:
    """Drives one server as an operator does, recording each step."""

    def __init__(self, url: str, adapter: Path) -> None:
        """`adapter`: the LoRA adapter's folder, written afresh by `operate` (the same path for
        both servers: vLLM's answers name it)."""
        self.client = httpx.Client(base_url=url, timeout=120)
        self.adapter = adapter
        self.steps: list[Step] = []

    def record(self, name: str, r: httpx.Response, said: Any = None) -> httpx.Response:
        if said is None:
            try:
                body = r.json()
                said = {k: v for k, v in body.items() if k not in ("id", "created")} if isinstance(body, dict) else body
            except ValueError:
                said = r.text
        self.steps.append(Step(name, r.status_code, json.dumps(said, sort_keys=True)))
        return r

    def complete(self, name: str, prompt: list[int] | str, model: str = MODEL, **extra: Any) -> None:
        """A completion at temperature 0, sent with X-Request-Id `name` (the engine's request
        is then cmpl-<name>-0-<suffix>)."""
        r = self.client.post("/v1/completions", headers={"X-Request-Id": name}, json={
            "model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **extra})
        said = None
        if r.status_code == 200:
            body = r.json()
            said = [body["choices"][0]["text"], body["usage"]["prompt_tokens"],
                    body["usage"]["prompt_tokens_details"]["cached_tokens"]]
        self.record(name, r, said)

    def chat(self, name: str, text: str) -> None:
        r = self.client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 6, "temperature": 0})
        body = r.json()
        self.record(name, r, [body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens"]]
                    if r.status_code == 200 else None)

    def post(self, name: str, path: str, body: Any = None, **params: Any) -> None:
        self.record(name, self.client.post(path, json=body, params=params or None))

    def get(self, name: str, path: str) -> None:
        self.record(name, self.client.get(path))

    def stream_then(self, name: str, then: Callable[[], None] | None) -> None:
        """A long streamed completion; after its first chunk either the client goes away
        (`then` None: vLLM aborts the request) or `then()` runs while it is in flight and the
        stream is read to its end."""
        with self.client.stream("POST", "/v1/completions", headers={"X-Request-Id": name}, json={
                "model": MODEL, "prompt": BASE[:64], "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
                "stream": True}) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            first = json.loads(next(lines)[6:])
            if then is None:
                said: Any = ["dropped after", first["choices"][0]["text"]]
            else:
                then()
                chunks = [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]
                reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
                said = ["finished", [r for r in reasons if r]]
        self.record(name, r, said)

    def idle(self) -> None:
        """Wait until the engine runs and queues nothing: a dropped or aborted request is
        finished asynchronously, and the next step must find the engine as the other run did."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            text = self.client.get("/metrics").text
            if metric(text, "vllm:num_requests_running") + metric(text, "vllm:num_requests_waiting") == 0:
                return
            time.sleep(0.1)
        raise AssertionError("the engine never went idle")

    def metrics(self) -> None:
        text = self.client.get("/metrics").text
        self.steps.append(Step("metrics", 200, json.dumps({
            name: metric(text, name) for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                                                  "vllm:request_success_total", "vllm:prompt_tokens_total")})))


def abort_while_paused(op: Operator) -> None:
    """`abort_requests` with a request in flight: paused first (keeping it), so that it cannot
    finish before the abort arrives, however slow the client is."""
    op.post("pause-for-abort", "/pause", mode="keep")
    op.post("abort-requests", "/abort_requests", {})
    op.post("resume-after-abort", "/resume")


def operate(op: Operator) -> None:
    """The operations, in order; the adapter's files are written afresh first."""
    lora_adapter(op.adapter, seed=1)
    op.get("health", "/health")
    op.complete("base-1", BASE)
    op.complete("base-2", BASE)  # reuses what base-1 computed
    op.complete("text-1", "w5 w6 w7 w8 w9")
    op.chat("chat-1", "w10 w11 w12")
    op.post("load", "/v1/load_lora_adapter", {"lora_name": ADAPTER, "lora_path": str(op.adapter)})
    op.record("models", r := op.client.get("/v1/models"),
              sorted((m["id"], m["root"], m["parent"]) for m in r.json()["data"]))
    op.complete("lora-1", LORA, model=ADAPTER)
    op.complete("lora-2", LORA, model=ADAPTER)  # a clean repeat: recoverable
    lora_adapter(op.adapter, seed=2)  # the same adapter, other weights, same name and path
    op.post("load-inplace", "/v1/load_lora_adapter",
            {"lora_name": ADAPTER, "lora_path": str(op.adapter), "load_inplace": True})
    op.complete("lora-3", LORA, model=ADAPTER)  # vLLM reuses the old weights' blocks
    op.post("load-again", "/v1/load_lora_adapter", {"lora_name": ADAPTER, "lora_path": str(op.adapter)})
    op.post("reset", "/reset_prefix_cache")
    op.complete("lora-4", LORA, model=ADAPTER)  # computed afresh with the new weights
    op.post("unload", "/v1/unload_lora_adapter", {"lora_name": ADAPTER})
    op.complete("lora-gone", LORA, model=ADAPTER)
    op.post("unload-again", "/v1/unload_lora_adapter", {"lora_name": ADAPTER})
    op.complete("base-3", BASE)  # computed again: the reset emptied the cache
    op.complete("base-4", BASE)  # a clean repeat
    op.post("reload-weights", "/collective_rpc", {"method": "reload_weights"})
    op.complete("base-5", BASE)  # vLLM reuses blocks of the weights before the reload
    op.post("sleep", "/sleep", level=1)
    op.get("is-sleeping", "/is_sleeping")
    op.post("wake-up", "/wake_up")
    op.get("is-awake", "/is_sleeping")
    op.complete("base-6", BASE)
    op.post("pause-keep", "/pause", mode="keep")
    op.get("is-paused", "/is_paused")
    op.post("resume", "/resume")
    op.post("pause-abort", "/pause")  # the default: abort what runs, clear the cache
    op.post("resume-again", "/resume")
    op.complete("base-7", BASE)
    op.stream_then("dropped-1", None)
    op.idle()
    op.stream_then("aborted-1", lambda: abort_while_paused(op))
    op.idle()
    op.complete("base-8", BASE)
    op.metrics()
    op.get("health-end", "/health")


# -- the two servers -------------------------------------------------------------------------

@dataclass
class Observed:
    off: Run
    on: Run
    verdicts: list[dict[str, Any]]
    alerts: Any
    unsafe_dom: str
    analyze: Any
    analyzed: list[dict[str, Any]]


def serve(root: Path, name: str, env: dict[str, str], model: Path) -> Run:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = Proc(name, [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
        "--model", str(model), "--served-model-name", MODEL, "--block-size", str(BLOCK),
        "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--enable-prefix-caching",
        "--enable-prompt-tokens-details", "--enable-lora", "--max-lora-rank", "8"], env, root)
    run = Run()
    try:
        server.wait_until(lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200, START_S,
                          "a healthy server")
        op = Operator(url, root / "adapter")
        try:
            operate(op)
        finally:
            run.steps = op.steps
        run.alive = server.alive()
    finally:
        run.log = server.log_path.read_text(errors="replace")  # until the stop, whose teardown logs errors
        server.stop()
    return run


def collector_rows(url: str, path: str, **params: Any) -> list[dict[str, Any]]:
    r = httpx.get(f"{url}{path}", params=params, headers={"Authorization": f"Bearer {READ_TOKEN}"}, timeout=30)
    assert r.status_code == 200, f"{path}: {r.status_code} {r.text[:500]}"
    return r.json()


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    root = tmp_path_factory.mktemp("transparent")
    model = tiny_llama(root / MODEL)
    (root / "tokens").write_text(f"{READ_TOKEN} {TENANT}\n{ENGINE_TOKEN} {TENANT}\n")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KVTRACE_", "VLLM_"))}
    base["KVTRACE_HOME"] = str(root / "home")
    vllm_env = {**base, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(root / "vllm-cache"),
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_SERVER_DEV_MODE": "1"}
    off = serve(root, "vllm-off", vllm_env, model)

    dsn = f"chdb://{root / 'store'}"
    cli_env = {**base, "KVTRACE_COLLECTOR_SPOOL_DIR": str(root / "spool")}
    procs: list[Proc] = []
    try:
        collector, collector_url = start_collector(root, dsn, cli_env, root / "tokens")
        procs.append(collector)
        on = serve(root, "vllm-on", {**vllm_env, "KVTRACE_ENABLED": "1", "KVTRACE_COLLECTOR_URL": collector_url,
                                     "KVTRACE_TOKEN": ENGINE_TOKEN, "KVTRACE_INSTANCE": INSTANCE,
                                     "KVTRACE_TENANT": TENANT}, model)
        # SIGTERM left the engine core's journal to its shipper; then every lookup is judged
        journal_dir = root / "home" / "journal"
        deadline = time.monotonic() + SETTLE_S
        while list(journal_dir.glob("*.kvjournal")) and time.monotonic() < deadline:
            time.sleep(0.5)
        tagged = {s.name for s in on.steps if s.name.startswith(("base-", "lora-")) and s.status == 200}

        def settled() -> bool:
            lookups = collector_rows(collector_url, "/v1/events", kind="lookup", limit=10_000)
            verdicts = collector_rows(collector_url, "/v1/verdicts", limit=10_000)
            return len(verdicts) == len(lookups) and tagged <= set(by_request(verdicts))

        collector.wait_until(settled, SETTLE_S, f"verdicts for {sorted(tagged)}")
        verdicts = collector_rows(collector_url, "/v1/verdicts", limit=10_000)
        collector.stop()
        alerts = kvtrace(cli_env, dsn, "alerts", "--once")
        results = root / "analyzed.parquet"
        analyze = kvtrace(cli_env, dsn, "analyze", "-o", str(results))
        analyzed = pq.read_table(results).to_pylist() if analyze.returncode == 0 else []
        dash_port = free_port()
        dashboard = Proc("dashboard", [sys.executable, "-m", "kvtrace.cli.main", "--dsn", dsn, "dashboard", "--port",
                                       str(dash_port)], cli_env, root)
        procs.append(dashboard)
        dash_url = f"http://127.0.0.1:{dash_port}"
        dashboard.wait_until(lambda: httpx.get(f"{dash_url}/api/panels/funnel", timeout=5).status_code == 200, 120,
                             "the dashboard")
        unsafe_dom = dump_dom(f"{dash_url}/unsafe?interval_s=1000000000")
        dashboard.stop()
        yield Observed(off, on, verdicts, alerts, unsafe_dom, analyze, analyzed)
    finally:
        for proc in reversed(procs):
            proc.stop(timeout_s=30)


def by_request(verdicts: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The adopted lookups of the completions sent with an X-Request-Id, by that id."""
    out = {}
    for v in verdicts:
        m = re.fullmatch(r"cmpl-(.+)-0(?:-[0-9a-f]+)?", v["request_id"])
        if m and v["adopt_seen"]:
            assert m.group(1) not in out, f"two adopted lookups for {m.group(1)}"
            out[m.group(1)] = v
    return out


# -- the checks --------------------------------------------------------------------------------

def test_every_operation_has_the_same_outcome_with_the_plugin_on(observed: Observed) -> None:
    off, on = observed.off, observed.on
    assert off.alive and on.alive, (off.log, on.log)
    assert [s.name for s in on.steps] == [s.name for s in off.steps], on.log
    differ = [f"{a.name}: off {a.status} {a.said}, on {b.status} {b.said}"
              for a, b in zip(off.steps, on.steps, strict=True) if a != b]
    assert not differ, "\n".join(differ)
    for run in (off, on):  # nothing failed on the way, in vLLM or in kvtrace
        said = [line for line in run.log.splitlines() if "Traceback" in line or "EngineDeadError" in line
                or "kvtrace: " in line]
        assert not said, said


def test_the_operations_did_what_operators_expect(observed: Observed) -> None:
    """The baseline itself: each operation worked (or was refused) as vLLM documents, so the
    comparison above compared something."""
    steps = {s.name: s for s in observed.off.steps}
    said = {name: json.loads(s.said) for name, s in steps.items()}
    assert all(steps[n].status == 200 for n in steps if n not in ("load-again", "lora-gone", "unload-again")), steps
    assert (steps["load-again"].status, steps["lora-gone"].status, steps["unload-again"].status) == (400, 404, 404)
    assert said["base-2"][2] == said["lora-2"][2] == REUSABLE
    # the in-place reload: vLLM reused the old weights' blocks, and answered otherwise than the
    # same request computed afresh with the new weights after the reset
    assert said["lora-3"][2] == REUSABLE and said["lora-4"][2] == 0
    assert said["lora-3"][0] != said["lora-4"][0]
    assert (said["base-3"][2], said["base-4"][2]) == (0, REUSABLE)
    assert said["base-5"][2] == REUSABLE  # reload_weights keeps the cache
    assert said["base-7"][2] == 0  # the pause that aborts clears it
    assert said["is-sleeping"] == {"is_sleeping": True} and said["is-awake"] == {"is_sleeping": False}
    assert said["dropped-1"][0] == "dropped after" and said["aborted-1"] == ["finished", ["abort"]]


def test_the_reuse_vllm_gets_wrong_is_unsafe_and_the_clean_repeats_recoverable(observed: Observed) -> None:
    rows = by_request(observed.verdicts)
    cached = {s.name: json.loads(s.said)[2] for s in observed.on.steps
              if s.name.startswith(("base-", "lora-")) and s.status == 200}
    assert cached.keys() <= rows.keys()
    for name, n in cached.items():
        assert rows[name]["adopted_tokens"] == n, (name, rows[name])
    # and in all, what vLLM's own counters say it queried and reused, to the token
    books = json.loads(next(s for s in observed.on.steps if s.name == "metrics").said)
    adopted = [v for v in observed.verdicts if v["adopt_seen"]]
    assert sum(v["prompt_tokens"] for v in adopted) == books["vllm:prefix_cache_queries_total"]
    assert sum(v["adopted_tokens"] for v in adopted) == books["vllm:prefix_cache_hits_total"]
    unsafe = {name: (v["recoverable_hit_tokens"], v["adopted_tokens"], v["reason"])
              for name, v in rows.items() if v["unsafe_reuse"]}
    assert unsafe == {"lora-3": (0, REUSABLE, "identity_mismatch"), "base-5": (0, REUSABLE, "identity_mismatch")}
    for clean in ("base-2", "lora-2", "base-4"):
        assert (rows[clean]["recoverable_hit_tokens"], rows[clean]["adopted_tokens"]) == (REUSABLE, REUSABLE), clean
    # what differed: the adapter's files (same name and path), and the weights' revision
    fingerprinted = rf"{ADAPTER}@[0-9a-f]{{12}}"
    assert re.fullmatch(f"adapter: {fingerprinted} != {fingerprinted}", rows["lora-3"]["reason_detail"]), rows["lora-3"]
    assert rows["base-5"]["reason_detail"].startswith("model_revision: "), rows["base-5"]


def test_kvtrace_analyze_alerts_and_the_dashboard_say_so(observed: Observed) -> None:
    assert observed.analyze.returncode == 0, observed.analyze.stderr[-3000:]
    unsafe = sorted(r["request_id"] for r in observed.analyzed if r["unsafe_reuse"])
    assert unsafe == sorted(v["request_id"] for v in observed.verdicts if v["unsafe_reuse"]) and len(unsafe) == 2
    alerts = observed.alerts
    assert alerts.returncode == 0, alerts.stderr[-3000:]
    assert re.search(r"^FIRING\s+unsafe-reuse\b.*value=2\b", alerts.stdout, re.MULTILINE), alerts.stdout
    for rid in unsafe:
        assert rid in observed.unsafe_dom, rid
