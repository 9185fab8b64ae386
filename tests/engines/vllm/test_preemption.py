"""vLLM under KV-cache pressure: requests preempted and re-admitted, each re-admission looking
the request up again. vLLM counts a re-admission's lookup apart from its prefix-cache hit rate
(`PrefixCacheStats.preempted_*`); kvtrace's lookups say which admission each one is, and its
numbers equal vLLM's own books on both sides of that line.

In process, the truth is every `PrefixCacheStats.record` the engine makes, summed by the test
(vLLM resets its stats object each step, and its `/metrics` export drops the preempted ones),
what each request had computed at each of its preemptions, and the engine's own evictions: what
a re-admission computes again was evicted while it waited.
As served (`vllm serve` with the plugin on, 8 clients at once, chunked prefill, a KV cache small
enough to preempt), it is `/metrics`: the hit rates the collector, `kvtrace analyze` and the
dashboard show equal `prefix_cache_queries`/`hits` to the token, and their re-admissions equal
`vllm:num_preemptions`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from collector_proc import free_port
from served import LLAMA, Proc, kvtrace, metric, start_collector

from kvtrace.analysis.reconstruct import reconstruct
from kvtrace.instrumentation.api import get_emitter
from kvtrace.instrumentation.replay import tokens_of
from kvtrace.instrumentation.traces import read_trace
from kvtrace.store.ingest import iter_file_events


def test_each_lookup_says_its_admission_and_both_books_match_vllms(tmp_path: Path) -> None:
    """In a process of its own: the plugin attaches once per process, with the sink it was
    first given (another test's, in a shared one)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVTRACE_", "VLLM_"))}
    env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_CACHE_ROOT": str(tmp_path / "cache"), "KVTRACE_ENABLED": "1", "KVTRACE_SINK": "spool",
                "KVTRACE_SPOOL_DIR": str(tmp_path / "spool"), "KVTRACE_INSTANCE": "vllm-preempt",
                "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])})
    done = subprocess.run([sys.executable, __file__, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("CHECKED"), done.stderr[-4000:]


def in_process(root: Path) -> None:
    """The engine in this process under the plugin, and vLLM's own books beside it."""
    from vllm import LLM
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.metrics.stats import PrefixCacheStats

    books: Counter[str] = Counter()  # vLLM's own, every record it makes
    record = PrefixCacheStats.record

    def counting(self: PrefixCacheStats, num_tokens: int, num_hits: int, preempted: bool) -> None:
        side = "preempted" if preempted else "first"
        books[f"{side}_requests"] += 1
        books[f"{side}_queries"] += num_tokens
        books[f"{side}_hits"] += num_hits
        record(self, num_tokens, num_hits, preempted)

    PrefixCacheStats.record = counting  # type: ignore[method-assign]
    preempted: dict[str, list[int]] = {}  # per request, what it had computed at each preemption
    preempt = Scheduler._preempt_request

    def noting(self: Scheduler, request, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        preempted.setdefault(request.request_id, []).append(request.num_computed_tokens)
        return preempt(self, request, *args, **kwargs)

    Scheduler._preempt_request = noting  # type: ignore[method-assign]
    spool = root / "spool"
    model = root / "llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA))
    # 40 blocks of 32 tokens for 16 requests of 288-416 tokens that grow by 160: vLLM must preempt
    llm = LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True, enable_prefix_caching=True,
              block_size=32, enforce_eager=True, max_model_len=1024, num_gpu_blocks_override=40,
              max_num_batched_tokens=256, max_num_seqs=8, disable_log_stats=False)
    shared = list(range(10, 266))
    prompts = [shared[: 128 + 32 * (i % 5)] + [300 + 7 * i + t for t in range(160)] for i in range(16)]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(max_tokens=160, ignore_eos=True), use_tqdm=False)
    assert get_emitter().force_flush(timeout_millis=30_000)
    assert books["preempted_requests"] > 0, f"vLLM preempted nothing: {books}"
    assert books["first_requests"] == len(prompts), books

    events = sorted((e for f in sorted(spool.iterdir()) for e in iter_file_events(f) if e.model == str(model)),
                    key=lambda e: (e.ts_ns, e.source_id, e.seq))
    results = [r for r in reconstruct(events) if r.adopt_seen]
    first = [r for r in results if r.preemptions == 0]
    again = [r for r in results if r.preemptions > 0]
    mine = Counter(first_requests=len(first), first_queries=sum(r.prompt_tokens for r in first),
                   first_hits=sum(r.adopted_tokens for r in first), preempted_requests=len(again),
                   preempted_queries=sum(r.prompt_tokens for r in again),
                   preempted_hits=sum(r.adopted_tokens for r in again))
    assert mine == books
    # one first admission per request (the engine's id is the output's with a suffix), whose
    # cached tokens are what vLLM reported for it
    by_output = {r.request_id.rsplit("-", 1)[0]: r for r in first}
    assert len(by_output) == len(first) and by_output.keys() == {o.request_id for o in outs}
    assert all(by_output[o.request_id].adopted_tokens == o.num_cached_tokens for o in outs)
    assert not any(r.unsafe_reuse for r in results)
    # each re-admission says how many times its request was preempted and what it had computed
    # then; what it computes again is that less what it reuses on resume
    readmitted: dict[str, list[tuple[int, int]]] = {}
    for r in again:
        readmitted.setdefault(r.request_id, []).append((r.preemptions, r.computed_before_preemption))
    assert readmitted == {rid: list(enumerate(computed, start=1)) for rid, computed in preempted.items()}
    assert sum(max(r.computed_before_preemption - r.adopted_tokens, 0) for r in again) > 0
    # and why it computed them again: the first block it had computed and did not reuse was
    # evicted for want of room after its preemption, before it came back
    lookup_of = {(e.source_id, e.seq): e for e in events if e.kind.value == "lookup"}
    evicted = [(e.ts_ns, k) for e in events if e.kind.value == "evict" and e.reason.value == "capacity"
               for k in (e.block_key, *e.more_keys)]
    checked = 0
    for r in again:
        first_lost, had = r.adopted_tokens // 32, r.computed_before_preemption // 32
        if first_lost >= had:
            continue  # it reused all it had computed in whole blocks
        lookup = lookup_of[(r.source_id, r.seq)]
        key = lookup.group_block_keys[0][first_lost]
        assert any(k == key and ts < lookup.ts_ns for ts, k in evicted), r.request_id
        checked += 1
    assert checked > 0
    print("CHECKED")


# -- as served ---------------------------------------------------------------------------------

TRACE = Path(__file__).parent / "data" / "mooncake_synthetic_head.jsonl.gz"
MODEL = "tiny-llama"
REQUESTS, CLIENTS, PROMPT_CUT, MAX_TOKENS = 60, 8, 1500, 256
TENANT, READ_TOKEN, ENGINE_TOKEN = "load", "read-load-1c7e", "engine-load-5b90"


SYSTEM = list(range(3, 3 + 256))  # a system prompt every request starts with: hits to count


def workload() -> list[tuple[str, list[int]]]:
    """The trace's first requests behind a shared system prompt, cut to leave room for the
    outputs. Short and long ones are mixed: the short ones take the room a long one then needs to
    grow into, and vLLM preempts."""
    return [(f"load-{r.line}", (SYSTEM + tokens_of(r, vocab_size=int(LLAMA["vocab_size"])))[:PROMPT_CUT])
            for r in list(read_trace(TRACE, "mooncake"))[:REQUESTS]]


@dataclass
class UnderLoad:
    usage: dict[str, tuple[int, int]]  # X-Request-Id -> (prompt tokens, cached tokens) as answered
    books: dict[str, int]  # vLLM's /metrics after the last response
    rates: list[dict[str, Any]]  # the collector's /v1/hit-rates
    verdicts: list[dict[str, Any]]
    headline: list[dict[str, Any]]  # the dashboard's panels
    preemption: list[dict[str, Any]]
    analyze: Any


@pytest.fixture(scope="module")
def under_load(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UnderLoad]:
    root = tmp_path_factory.mktemp("served-preemption")
    (root / MODEL).mkdir()
    (root / MODEL / "config.json").write_text(json.dumps(LLAMA))
    (root / "tokens").write_text(f"{READ_TOKEN} {TENANT}\n{ENGINE_TOKEN} {TENANT}\n")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KVTRACE_", "VLLM_"))}
    base["KVTRACE_HOME"] = str(root / "home")
    dsn = f"chdb://{root / 'store'}"
    cli_env = {**base, "KVTRACE_COLLECTOR_SPOOL_DIR": str(root / "spool")}
    prompts = workload()
    procs: list[Proc] = []
    try:
        collector, collector_url = start_collector(root, dsn, cli_env, root / "tokens")
        procs.append(collector)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = Proc("vllm", [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
            "--model", str(root / MODEL), "--served-model-name", MODEL, "--load-format", "dummy",
            "--skip-tokenizer-init", "--block-size", "32", "--max-model-len", "2048", "--enforce-eager",
            "--enable-prefix-caching", "--enable-prompt-tokens-details", "--max-num-batched-tokens", "256",
            "--num-gpu-blocks-override", "80"],
            {**base, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(root / "vllm-cache"),
             "KVTRACE_ENABLED": "1", "KVTRACE_COLLECTOR_URL": collector_url, "KVTRACE_TOKEN": ENGINE_TOKEN,
             "KVTRACE_INSTANCE": "vllm-load", "KVTRACE_TENANT": TENANT}, root)
        procs.append(server)
        server.wait_until(lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200, 300, "a healthy server")

        def send(client: httpx.Client, rid: str, prompt: list[int]) -> tuple[int, int]:
            r = client.post(f"{url}/v1/completions", headers={"X-Request-Id": rid}, timeout=300, json={
                "model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0})
            assert r.status_code == 200, f"{rid}: {r.status_code} {r.text[:300]}"
            usage = r.json()["usage"]
            return int(usage["prompt_tokens"]), int(usage["prompt_tokens_details"]["cached_tokens"])

        # No kept-alive connections: one the server closes while idle (its 5 s keep-alive) could
        # be picked for a request, which then fails without reaching the engine.
        with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as client, \
                ThreadPoolExecutor(CLIENTS) as pool:
            usage = dict(zip((rid for rid, _ in prompts),
                             pool.map(lambda p: send(client, *p), prompts), strict=True))
        text = httpx.get(f"{url}/metrics", timeout=30).text
        books = {name: metric(text, f"vllm:{name}") for name in (
            "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
            "request_num_preemptions_sum")}
        server.stop()
        journal = root / "home" / "journal"
        deadline = time.monotonic() + 120
        while list(journal.glob("*.kvjournal")) and time.monotonic() < deadline:
            time.sleep(0.5)

        def rows(path: str, **params: Any) -> list[dict[str, Any]]:
            r = httpx.get(f"{collector_url}{path}", params=params, timeout=30,
                          headers={"Authorization": f"Bearer {READ_TOKEN}"})
            assert r.status_code == 200, r.text[:300]
            return r.json()

        def settled() -> bool:
            lookups = rows("/v1/events", kind="lookup", limit=10_000)
            return len(rows("/v1/verdicts", limit=10_000)) == len(lookups) > 0

        # every request's admission stored and judged (the spool drains into the store behind
        # the acknowledgements), and then every lookup judged
        collector.wait_until(lambda: sum(r["lookups"] for r in rows("/v1/hit-rates", by="instance")) >= REQUESTS,
                             120, "a verdict for every request")
        collector.wait_until(settled, 120, "a verdict for every lookup")
        rates, verdicts = rows("/v1/hit-rates", by="instance"), rows("/v1/verdicts", limit=10_000)
        collector.stop()
        analyze = kvtrace(cli_env, dsn, "analyze", "--by", "instance")
        dash_url = f"http://127.0.0.1:{(dash_port := free_port())}"
        dashboard = Proc("dashboard", [sys.executable, "-m", "kvtrace.cli.main", "--dsn", dsn, "dashboard", "--port",
                                       str(dash_port)], cli_env, root)
        procs.append(dashboard)
        view = {"interval_s": 1_000_000_000}
        dashboard.wait_until(lambda: httpx.get(f"{dash_url}/api/panels/headline", params=view,
                                               timeout=5).status_code == 200, 120, "the dashboard")
        headline = httpx.get(f"{dash_url}/api/panels/headline", params=view, timeout=30).json()
        preempted = httpx.get(f"{dash_url}/api/panels/preemption", params=view, timeout=30).json()
        yield UnderLoad(usage, books, rates, verdicts, headline, preempted, analyze)
    finally:
        for proc in reversed(procs):
            proc.stop(timeout_s=30)


def test_served_under_preemption_the_rates_are_vllms_own(under_load: UnderLoad) -> None:
    books = under_load.books
    print(f"vLLM's books: {books}; the collector's rates: {under_load.rates}")
    assert books["num_preemptions_total"] > 0, f"vLLM preempted nothing: {books}"
    assert books["prefix_cache_hits_total"] > 0, f"vLLM reused nothing: {books}"
    (rates,) = under_load.rates
    assert (rates["lookups"], rates["prompt_tokens"], rates["adopted_tokens"]) == (
        REQUESTS, books["prefix_cache_queries_total"], books["prefix_cache_hits_total"]), (rates, books)
    # per request, its first admission is what its response said
    first = {v["request_id"].split("-0-")[0].removeprefix("cmpl-"): v for v in under_load.verdicts
             if v["adopt_seen"] and v["preemptions"] == 0}
    assert {rid: (v["prompt_tokens"], v["adopted_tokens"]) for rid, v in first.items()} == under_load.usage
    (headline,) = under_load.headline
    assert headline["lookups"] == REQUESTS
    assert headline["adopted_rate"] == pytest.approx(books["prefix_cache_hits_total"]
                                                     / books["prefix_cache_queries_total"], rel=1e-12)


def test_served_under_preemption_the_readmissions_are_vllms_preemptions(under_load: UnderLoad) -> None:
    books = under_load.books
    (rates,) = under_load.rates
    assert rates["readmissions"] == books["num_preemptions_total"] == books["request_num_preemptions_sum"]
    again = [v for v in under_load.verdicts if v["adopt_seen"] and v["preemptions"] > 0]
    assert len(again) == rates["readmissions"]
    assert rates["readmitted_adopted_tokens"] == sum(v["adopted_tokens"] for v in again)
    assert all(v["computed_before_preemption"] > 0 for v in again)
    assert not any(v["unsafe_reuse"] for v in under_load.verdicts)
    (headline,) = under_load.headline
    assert headline["readmissions"] == rates["readmissions"]
    assert sum(r["readmissions"] for r in under_load.preemption) == rates["readmissions"]
    computed_again = sum(max(v["computed_before_preemption"] - v["adopted_tokens"], 0) for v in again)
    assert sum(r["recomputed_tokens"] for r in under_load.preemption) == computed_again > 0
    out = under_load.analyze
    assert out.returncode == 0, out.stderr[-3000:]
    assert "preemption: requests admitted again" in out.stdout, out.stdout


if __name__ == "__main__":
    in_process(Path(sys.argv[1]))
