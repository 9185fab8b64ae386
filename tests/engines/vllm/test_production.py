"""The production path as a new user runs it, every part a real process: `kvtrace collector` with
bearer tokens, vLLM's OpenAI server with the plugin on by environment only, requests over HTTP
built from a Mooncake trace for two tenants (`cache_salt`), each server stopped with SIGTERM
right after its last response, a restart of the server under the same instance name, a third
server killed with SIGKILL in the middle of its load, then `kvtrace db status`, `kvtrace
analyze`, `kvtrace alerts` and `kvtrace dashboard` on the store the collector filled. No recipe
is named anywhere: kvtrace judges the lookups by the one the engine published when it attached,
and a wrong one given by hand is refused.

One module-scoped setup runs the whole scenario (about four minutes on two cores, most of it
vLLM starting three times) and records what each part said; the tests below check it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest
from collector_proc import free_port
from served import LLAMA, Proc, dump_dom, kvtrace, metric

from kvtrace.instrumentation.replay import tokens_of
from kvtrace.instrumentation.traces import read_trace

TRACE = Path(__file__).parent / "data" / "mooncake_synthetic_head.jsonl.gz"
MODEL = "tiny-llama"
MAX_MODEL_LEN = 4096
MAX_TOKENS = 2
INSTANCE = "vllm-prod"
TENANTS = ("tenant-a", "tenant-b")
READ_TOKENS = {"tenant-a": "read-a-5f1c", "tenant-b": "read-b-93d0"}
ENGINE_TOKEN = "engine-7a2e"  # writes both tenants' namespaces
FIRST_RUN_LINES = 400  # the trace's first 400 lines go to the first server, the next 200 to the restarted one
KILLED_RUN = 3  # the third server gets the first run's requests again and is killed in the middle of them
KILL_AFTER = 20  # responses the third server gives before it is killed
IN_FLIGHT = 4  # requests the client keeps open at once
START_S = 300  # bound on vLLM's start-up (about 40 s on two busy cores)
SETTLE_S = 120  # bound on the collector storing and judging what the engine sent


# -- the workload ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Sent:
    run: int
    tenant: str
    header_id: str  # sent as X-Request-Id: vLLM names the engine's request cmpl-<this>-0-<random suffix>
    prompt: list[int]


def workload() -> list[Sent]:
    """The trace's requests whose first 512-token block another of its first 600 requests shares,
    each for both tenants: token ids from the hash ids as replays make them, cut to leave room
    for the output tokens. Those after line 400 go to the restarted server; some of them repeat
    prefixes the first server cached."""
    trace = list(read_trace(TRACE, "mooncake"))
    firsts = Counter(r.hash_ids[0] for r in trace)
    out = []
    for req in trace:
        if firsts[req.hash_ids[0]] < 2:
            continue
        prompt = tokens_of(req, vocab_size=int(LLAMA["vocab_size"]))[: MAX_MODEL_LEN - MAX_TOKENS]
        run = 1 if req.line <= FIRST_RUN_LINES else 2
        out.extend(Sent(run, tenant, f"r{run}-{tenant}-{req.line}", prompt) for tenant in TENANTS)
    return out


# -- what each part said -----------------------------------------------------------------------

@dataclass
class Served:
    """One vLLM server's life: its /metrics counters after the last response, and per request
    (X-Request-Id) what its response said."""

    queries: int = 0
    hits: int = 0
    usage: dict[str, tuple[str, int, int]] = field(default_factory=dict)  # id -> (tenant, prompt, cached)
    exit_code: int | None = None  # after SIGTERM


@dataclass
class Observed:
    """What each part said, for the checks."""

    runs: list[Served] = field(default_factory=list)
    verdicts: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # tenant -> its token's rows
    hit_rates: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # tenant -> its token's rows
    collector_exit: int | None = None
    collector_log: str = ""
    status: subprocess.CompletedProcess[str] | None = None
    analyzed: list[dict[str, Any]] = field(default_factory=list)
    analyze: subprocess.CompletedProcess[str] | None = None
    dashboard_dom: str = ""
    unsafe_dom: str = ""
    refusal: subprocess.CompletedProcess[str] | None = None
    answered_before_kill: list[str] = field(default_factory=list)  # X-Request-Ids the killed server answered
    journals_left: list[str] = field(default_factory=list)  # after the shippers had their time
    alerts: subprocess.CompletedProcess[str] | None = None
    health_dom: str = ""


def send(client: httpx.Client, url: str, sent: Sent) -> tuple[str, int, int]:
    r = client.post(f"{url}/v1/completions", headers={"X-Request-Id": sent.header_id}, timeout=120, json={
        "model": MODEL, "prompt": sent.prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
        "cache_salt": sent.tenant})
    assert r.status_code == 200, f"{sent.header_id}: {r.status_code} {r.text[:500]}"
    usage = r.json()["usage"]
    return sent.tenant, int(usage["prompt_tokens"]), int(usage["prompt_tokens_details"]["cached_tokens"])


def collector_rows(url: str, path: str, tenant: str, **params: Any) -> list[dict[str, Any]]:
    r = httpx.get(f"{url}{path}", params=params, headers={"Authorization": f"Bearer {READ_TOKENS[tenant]}"},
                  timeout=30)
    assert r.status_code == 200, f"{path} as {tenant}: {r.status_code} {r.text[:500]}"
    return r.json()


def judged(url: str, tenant: str) -> int:
    """Lookups of `tenant` the collector has judged with their adopt (what /v1/hit-rates counts)."""
    return sum(r["lookups"] for r in collector_rows(url, "/v1/hit-rates", tenant, by="tenant"))


def judged_all(url: str, tenant: str) -> bool:
    """Every lookup of `tenant` the collector stored has its verdict."""
    lookups = collector_rows(url, "/v1/events", tenant, kind="lookup", limit=10_000)
    return len(collector_rows(url, "/v1/verdicts", tenant, limit=10_000)) == len(lookups)


@dataclass
class Setup:
    """Where everything lives, and the processes started (each stopped in the end)."""

    root: Path
    dsn: str
    cli_env: dict[str, str]
    vllm_env: dict[str, str]
    collector_url: str
    procs: list[Proc] = field(default_factory=list)

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> Proc:
        proc = Proc(name, argv, env, self.root)
        self.procs.append(proc)
        return proc

    def kvtrace_process(self, name: str, *argv: str) -> Proc:
        return self.start(name, [sys.executable, "-m", "kvtrace.cli.main", "--dsn", self.dsn, *argv], self.cli_env)


def start_server(setup: Setup, run: int) -> tuple[Proc, str]:
    """vLLM's OpenAI server, healthy."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    model_dir = setup.root / MODEL
    server = setup.start(f"vllm-{run}", [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
        "--model", str(model_dir), "--served-model-name", MODEL, "--load-format", "dummy", "--skip-tokenizer-init",
        "--block-size", "32", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--enable-prefix-caching",
        "--enable-prompt-tokens-details"], setup.vllm_env)
    server.wait_until(lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200, START_S, "a healthy server")
    return server, url


def serve_run(setup: Setup, collector: Proc, run: int, batch: list[Sent], judged_before: Counter[str]) -> Served:
    """Start vLLM's OpenAI server, send the run's requests, read /metrics after the last
    response and stop the server at once with SIGTERM, as an operator would (vLLM then kills its
    engine core, whose emitter has had no time to flush); then wait until the collector has
    judged every request."""
    server, url = start_server(setup, run)
    served = Served()
    with httpx.Client() as client, ThreadPoolExecutor(IN_FLIGHT) as pool:
        for sent, usage in zip(batch, pool.map(lambda s: send(client, url, s), batch), strict=True):
            served.usage[sent.header_id] = usage
    text = httpx.get(f"{url}/metrics", timeout=30).text
    served.exit_code = server.stop()
    served.queries = metric(text, "vllm:prefix_cache_queries_total")
    served.hits = metric(text, "vllm:prefix_cache_hits_total")
    # Every request's lookup and adopt are stored once the collector has judged them all.
    expected = judged_before + Counter(s.tenant for s in batch)
    collector.wait_until(
        lambda: all(judged(setup.collector_url, t) >= expected[t] for t in TENANTS), SETTLE_S,
        lambda: (f"verdicts of {dict(expected)} requests, {({t: judged(setup.collector_url, t) for t in TENANTS})} "
                 f"judged; the server's log ends:\n{server.tail(2000)}"))
    return served


def kill_mid_load(setup: Setup, batch: list[Sent]) -> list[str]:
    """A server killed with SIGKILL, the whole process group at once (what an OOM kill of the
    container's engine or `kill -9` does), while requests are in flight; the X-Request-Ids it
    answered before."""
    server, url = start_server(setup, KILLED_RUN)
    answered: list[str] = []
    lock = threading.Lock()

    def attempt(client: httpx.Client, sent: Sent) -> None:
        try:
            send(client, url, sent)
        except (httpx.HTTPError, AssertionError):
            return  # in flight when the server died, or sent after
        with lock:
            answered.append(sent.header_id)

    with httpx.Client() as client, ThreadPoolExecutor(IN_FLIGHT) as pool:
        futures = [pool.submit(attempt, client, s) for s in batch]
        server.wait_until(lambda: len(answered) >= KILL_AFTER, SETTLE_S, f"{KILL_AFTER} responses")
        os.killpg(server.proc.pid, signal.SIGKILL)
        for f in futures:
            f.result()
    server.stop()
    assert len(answered) < len(batch), "the server answered everything before it was killed"
    return answered


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    root = tmp_path_factory.mktemp("production")
    (root / MODEL).mkdir()
    (root / MODEL / "config.json").write_text(json.dumps(LLAMA))
    tokens_file = root / "tokens"
    tokens_file.write_text("".join(f"{token} {tenant}\n" for tenant, token in READ_TOKENS.items())
                           + f"{ENGINE_TOKEN} {','.join(TENANTS)}\n")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KVTRACE_", "VLLM_"))}
    base["KVTRACE_HOME"] = str(root / "home")
    collector_port = free_port()
    collector_url = f"http://127.0.0.1:{collector_port}"
    setup = Setup(root=root, dsn=f"chdb://{root / 'store'}", collector_url=collector_url,
                  cli_env={**base, "KVTRACE_COLLECTOR_SPOOL_DIR": str(root / "spool")},
                  vllm_env={**base, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(root / "vllm-cache"),
                            "KVTRACE_ENABLED": "1", "KVTRACE_COLLECTOR_URL": collector_url,
                            "KVTRACE_TOKEN": ENGINE_TOKEN, "KVTRACE_INSTANCE": INSTANCE})
    requests = workload()
    out = Observed()
    try:
        collector = setup.kvtrace_process("collector", "collector", "--port", str(collector_port),
                                          "--tokens-file", str(tokens_file))
        collector.wait_until(lambda: httpx.get(f"{collector_url}/readyz", timeout=2).status_code == 200, 120,
                             "readiness")
        judged_so_far: Counter[str] = Counter()
        for run in (1, 2):  # the second server is a restart under the same instance name
            batch = [s for s in requests if s.run == run]
            out.runs.append(serve_run(setup, collector, run, batch, judged_so_far))
            judged_so_far.update(s.tenant for s in batch)
        served_until = int(time.time())  # what the two servers served, for the dashboard's parity view
        again = [dataclasses.replace(s, run=KILLED_RUN, header_id=f"r{KILLED_RUN}-" + s.header_id.split("-", 1)[1])
                 for s in requests if s.run == 1]
        out.answered_before_kill = kill_mid_load(setup, again)
        journal_dir = Path(setup.vllm_env["KVTRACE_HOME"]) / "journal"
        # the shipper the killed engine core started outside its process tree delivers what its
        # journal held, its counters marked unclean, and removes the journal
        deadline = time.monotonic() + SETTLE_S
        while list(journal_dir.glob("*.kvjournal")) and time.monotonic() < deadline:
            time.sleep(0.5)
        out.journals_left = sorted(p.name for p in journal_dir.glob("*.kvjournal"))
        # and the collector judges every lookup it stored, those the kill left without an adopt
        # too: its emitter's last stats say it ended
        collector.wait_until(lambda: all(judged_all(collector_url, t) for t in TENANTS), SETTLE_S,
                             "a verdict for every lookup stored")
        for tenant in TENANTS:
            out.verdicts[tenant] = collector_rows(collector_url, "/v1/verdicts", tenant, limit=10_000)
            out.hit_rates[tenant] = collector_rows(collector_url, "/v1/hit-rates", tenant, by="tenant")
        out.collector_exit = collector.stop()
        out.collector_log = collector.log_path.read_text(errors="replace")

        # The embedded store serves one process at a time: now the operator's commands on it.
        out.status = kvtrace(setup.cli_env, setup.dsn, "db", "status")
        out.alerts = kvtrace(setup.cli_env, setup.dsn, "alerts", "--once")
        results = root / "analyzed.parquet"
        out.analyze = kvtrace(setup.cli_env, setup.dsn, "analyze", "--by", "tenant", "-o", str(results))
        if out.analyze.returncode == 0:
            out.analyzed = pq.read_table(results).to_pylist()
        out.refusal = kvtrace(setup.cli_env, setup.dsn, "analyze", "--recipe", f"{MODEL}=dense")

        dash_port = free_port()
        dash_url = f"http://127.0.0.1:{dash_port}"
        dashboard = setup.kvtrace_process("dashboard", "dashboard", "--port", str(dash_port))
        dashboard.wait_until(lambda: httpx.get(f"{dash_url}/api/panels/funnel", timeout=5).status_code == 200, 120,
                             "the dashboard")
        # one time bucket over what the first two servers served: the rates of their totals
        view = f"interval_s=1000000000&to={served_until}"
        out.dashboard_dom = dump_dom(f"{dash_url}/?{view}")
        out.unsafe_dom = dump_dom(f"{dash_url}/unsafe?{view}")
        out.health_dom = dump_dom(f"{dash_url}/health")
        dashboard.stop()
        yield out
    finally:
        for proc in reversed(setup.procs):
            proc.stop(timeout_s=30)


# -- the checks --------------------------------------------------------------------------------

def by_request(observed: Observed) -> dict[str, dict[str, Any]]:
    """The collector's judged lookups by the X-Request-Id they were sent with."""
    rows: dict[str, dict[str, Any]] = {}
    for tenant, verdicts in observed.verdicts.items():
        for v in verdicts:
            assert v["tenant"] == tenant, f"{tenant}'s token read a row of {v['tenant']}"
            if not v["adopt_seen"]:
                continue
            m = re.fullmatch(r"cmpl-(.+)-0(?:-[0-9a-f]+)?", v["request_id"])
            assert m, v["request_id"]
            assert m.group(1) not in rows, f"two adopted lookups for {m.group(1)}"
            rows[m.group(1)] = v
    return rows


def test_every_requests_prompt_and_hit_tokens_match_vllm_exactly(observed: Observed) -> None:
    rows = by_request(observed)
    for run, served in enumerate(observed.runs, start=1):
        assert served.hits > 0, f"run {run}: vLLM reused nothing; the workload shares no prefix"
        mine = {rid: rows.get(rid) for rid in served.usage}
        missing = sorted(rid for rid, v in mine.items() if v is None)
        assert not missing, f"run {run}: no verdict for {len(missing)} requests, e.g. {missing[:3]}"
        for rid, (tenant, prompt, cached) in served.usage.items():
            v = mine[rid]
            assert (v["tenant"], v["prompt_tokens"], v["adopted_tokens"]) == (tenant, prompt, cached), rid
        assert sum(v["prompt_tokens"] for v in mine.values()) == served.queries, f"run {run}: queried tokens"
        assert sum(v["adopted_tokens"] for v in mine.values()) == served.hits, f"run {run}: hit tokens"


def test_no_unsafe_or_missed_reuse_across_the_restart(observed: Observed) -> None:
    rows = list(by_request(observed).values())
    unsafe = [v["request_id"] for v in rows if v["unsafe_reuse"]]
    missed = [(v["request_id"], v["recoverable_hit_tokens"], v["adopted_tokens"], v["reason"])
              for v in rows if v["missed_reuse"] or v["recoverable_hit_tokens"] != v["adopted_tokens"]]
    assert not unsafe, unsafe
    assert not missed, missed[:5]
    # The restarted server recomputed the prompts the first one had cached, and rightly: their
    # blocks hash-match, but the restart emptied the cache, whichever tenant's they were.
    second = [v for rid, v in by_request(observed).items() if rid.startswith("r2-")]
    repeats = [v for v in second if v["logical_hit_tokens"] > v["recoverable_hit_tokens"]]
    assert {v["tenant"] for v in repeats} == set(TENANTS)
    assert {(v["reason"], v["recoverable_hit_tokens"], v["adopted_tokens"]) for v in repeats} == {("invalidated", 0, 0)}
    assert any(v["adopted_tokens"] > 0 for v in second)  # and reused what it cached itself


def test_each_server_emitted_from_its_engine_core_alone_and_attached_with_its_recipe(observed: Observed) -> None:
    """vLLM loads the plugin in its API server, engine core and worker processes: only the
    engine core (which has the scheduler) emits, one source per start (three), and nothing was refused,
    quarantined or dropped on the way. `kvtrace db status` shows the engine as it attached."""
    import vllm

    for run, served in enumerate(observed.runs, start=1):
        assert served.exit_code == 0, f"vLLM server {run} did not stop cleanly on SIGTERM: {served.exit_code}"
    rows = by_request(observed)
    sources = [{v["source_id"] for rid, v in rows.items() if rid.startswith(f"r{run}-")} for run in (1, 2)]
    assert [len(s) for s in sources] == [1, 1] and sources[0] != sources[1], sources
    status = observed.status
    assert status is not None and status.returncode == 0, status
    assert re.search(r"^event sources:\s+3$", status.stdout, re.MULTILINE), status.stdout  # the killed one too
    assert re.search(r"^dropped events:\s+0 ", status.stdout, re.MULTILINE), status.stdout
    assert re.search(r"^\s+quarantine\s+0 rows", status.stdout, re.MULTILINE), status.stdout
    line = next((ln for ln in status.stdout.splitlines() if ln.strip().startswith(INSTANCE)), "")
    assert f"vllm {vllm.__version__}  {MODEL}  [full_attention/32], max_model_len {MAX_MODEL_LEN}" in line, \
        status.stdout


def test_the_collectors_live_hit_rates_equal_kvtrace_analyze(observed: Observed) -> None:
    assert observed.collector_exit in (0, -signal.SIGTERM), observed.collector_log[-3000:]
    assert "spool drained" in observed.collector_log
    assert observed.analyze is not None and observed.analyze.returncode == 0, observed.analyze.stderr[-3000:]
    live = {(v["source_id"], v["seq"]): v for vs in observed.verdicts.values() for v in vs}
    offline = {(r["source_id"], r["seq"]): r for r in observed.analyzed}
    assert live.keys() == offline.keys()
    fields = ("request_id", "tenant", "prompt_tokens", "reported_hit_tokens", "logical_hit_tokens",
              "recoverable_hit_tokens", "resident_hit_tokens", "adopted_tokens", "adopt_seen", "verdict", "reason",
              "unsafe_reuse", "missed_reuse")
    for key, v in live.items():
        assert {f: v[f] for f in fields} == {f: offline[key][f] for f in fields}, key
    for tenant, rates in observed.hit_rates.items():
        (row,) = rates
        mine = [r for r in observed.analyzed if r["tenant"] == tenant and r["adopt_seen"]]
        assert (row["key"], row["lookups"], row["prompt_tokens"], row["logical_hit_tokens"],
                row["recoverable_hit_tokens"], row["adopted_tokens"], row["unsafe_reuse"]) == (
            tenant, len(mine), sum(r["prompt_tokens"] for r in mine), sum(r["logical_hit_tokens"] for r in mine),
            sum(r["recoverable_hit_tokens"] for r in mine), sum(r["adopted_tokens"] for r in mine), 0)


def figure_series(dom: str) -> dict[str, list[float]]:
    """The plotted series of a page's first chart, as the page handed them to plotly."""
    m = re.search(r"const f=(\{.*?\});const el=", dom, re.DOTALL)
    assert m, "no chart on the page"
    return {t["name"]: t["y"] for t in json.loads(m.group(1))["data"]}


def test_the_dashboard_shows_the_rates_vllm_counted(observed: Observed) -> None:
    from kvtrace.dashboards.queries import by_key

    funnel = by_key("funnel")
    series = figure_series(observed.dashboard_dom)
    queries = sum(r.queries for r in observed.runs)
    hits = sum(r.hits for r in observed.runs)
    adopted, recoverable = series[funnel.label("adopted")], series[funnel.label("recoverable")]
    assert adopted == [pytest.approx(hits / queries, rel=1e-12)], (series, hits, queries)
    assert recoverable == adopted
    tile = re.search(r'data-stat="adopted_rate" data-value="([^"]+)"', observed.dashboard_dom)
    assert tile and float(tile.group(1)) == pytest.approx(hits / queries, rel=1e-9), "the headline tile"

    unsafe = by_key("unsafe").title  # the DOM as Chromium serializes it: double quotes
    assert re.search(rf'<h2>{re.escape(unsafe)}</h2>(<p class="desc">[^<]*</p>)?<div class="none" data-points="0">',
                     observed.unsafe_dom), "the unsafe reuse page lists requests, or does not say none"


def test_a_recipe_the_engine_contradicts_is_refused(observed: Observed) -> None:
    r = observed.refusal
    assert r is not None and r.returncode == 2, r
    assert f"recipe 'dense' given for model '{MODEL}' contradicts what its engine reported" in r.stderr, r.stderr
    assert "group 0: the recipe's block_size is 16, the engine's 32" in r.stderr, r.stderr


def test_a_server_killed_mid_load_is_reported_never_silent(observed: Observed) -> None:
    """SIGKILL to the whole server while requests were in flight: the engine core's journal
    outlived it, its shipper delivered it, and `kvtrace db status`, the alert rules and the
    dashboard say that this instance's emitter ended unclean, with its sequence gap: nothing
    missing, every request it answered before the kill looked up and adopted."""
    assert not observed.journals_left, f"journals left undelivered: {observed.journals_left}"
    rows = by_request(observed)
    answered = observed.answered_before_kill
    assert len(answered) >= KILL_AFTER and all(rid in rows for rid in answered), \
        sorted(set(answered) - rows.keys())[:5]
    sources = {rows[rid]["source_id"] for rid in answered}
    assert len(sources) == 1, sources
    source = sources.pop()
    status = observed.status
    assert status is not None and status.returncode == 0, status
    line = next((ln for ln in status.stdout.splitlines() if f"source {source:016x})" in ln), "")
    assert line.strip().startswith(f"{INSTANCE} (vllm, source {source:016x}): ended "), status.stdout
    emitted = re.search(r"([\d,]+) emitted, ([\d,]+) stored, nothing missing", line)
    assert emitted and emitted.group(1) == emitted.group(2), line
    alerts = observed.alerts
    assert alerts is not None and alerts.returncode == 0, alerts
    fired = re.search(rf"^FIRING\s+engine-ended-unclean instance={INSTANCE} value=\d+: (.*)$", alerts.stdout,
                      re.MULTILINE)
    assert fired and f"vllm source {source:016x} ended unclean" in fired.group(1), alerts.stdout
    row = re.search(rf"<tr><td>[^<]*</td><td>{INSTANCE}</td><td>vllm</td><td>unclean</td>"
                    rf"<td>{source:016x}</td><td>(\d+)</td><td>(\d+)</td><td>0</td>", observed.health_dom)
    assert row and row.group(1) == row.group(2) == emitted.group(1).replace(",", ""), observed.health_dom[-3000:]
