"""What kvtrace costs vLLM's OpenAI server: the same load with the plugin off and on, in one run.

Runs in the vLLM venv (`bash scripts/engine-venv.sh vllm` builds it):

    .venvs/vllm/bin/python benchmarks/bench_vllm_serve.py [--requests 48] [--concurrency 4]

Two of vLLM's OpenAI servers run side by side, each with its engine core in its own process, a
random-weight Llama (the shape is printed; its forward pass, not the HTTP path, is what a request
costs, as on a real deployment) and 32-token blocks with prefix caching:

  off  kvtrace installed, KVTRACE_ENABLED unset: what an engine image with kvtrace pays
  on   KVTRACE_ENABLED=1, the spool sink with its journal (the default of an engine that does
       not send to a collector; the collector sink's engine-side work is the same up to the
       HTTP post), into a temporary directory

The requests come from the Mooncake synthetic trace (those whose first 512-token block another
request shares, prompts cut to --max-prompt tokens; the tests' slice of it when the trace is not
beside the checkout), streamed, so time to first token is measured per request. They are sent in
batches of --concurrency; each batch goes to one server and then, the same requests, to the
other, in an order that alternates batch by batch, so both caches see the same sequence and
drift on a shared host lands on both. Only one server works at a time. The table gives each
variant's requests per second (over the time its batches took), its median time to first token,
and on over off ratios: overall, as the median of the per-batch ratios, and as the median over
requests of one request's time to first token on over off (the same request, the same cache
state: the steadiest figure). The `on` server's spool is read back at the end: one lookup per
request, or the run is void.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from kvtrace.instrumentation.replay import tokens_of
from kvtrace.instrumentation.traces import read_trace
from kvtrace.schema import EventKind
from kvtrace.schema.wire import SPOOL_SUFFIX
from kvtrace.store.ingest import iter_file_events

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
SLICE = ROOT / "tests" / "engines" / "vllm" / "data" / "mooncake_synthetic_head.jsonl.gz"  # its first 600 lines
VOCAB = 8192


def llama(hidden: int, layers: int, intermediate: int, max_len: int) -> dict:
    heads = hidden // 64
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": max(1, heads // 4), "head_dim": 64, "vocab_size": VOCAB,
            "max_position_embeddings": max_len, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}


def vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(name: str, model: Path, max_len: int, env: dict[str, str], root: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = (root / f"{name}.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
         "--model", str(model), "--served-model-name", "m", "--load-format", "dummy", "--skip-tokenizer-init",
         "--block-size", "32", "--max-model-len", str(max_len), "--enforce-eager", "--enable-prefix-caching"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(procs: dict[str, tuple[subprocess.Popen, str]], root: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    pending = dict(procs)
    while pending:
        for name, (proc, url) in list(pending.items()):
            if proc.poll() is not None:
                raise SystemExit(f"{name} server exited:\n{(root / f'{name}.log').read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    del pending[name]
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise SystemExit(f"servers not healthy after {timeout_s} s: {sorted(pending)}")
        time.sleep(0.5)


def stream(client: httpx.Client, url: str, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """(time to first token, time to the last) of one streamed completion, in seconds."""
    started = time.perf_counter()
    first = 0.0
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        if response.status_code != 200:
            raise SystemExit(f"{url}: {response.status_code} {response.read()[:300]!r}")
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and not first:
                first = time.perf_counter() - started
    return first, time.perf_counter() - started


def workload(path: Path, limit: int, max_prompt: int) -> list[list[int]]:
    trace = list(read_trace(path, "mooncake"))
    firsts = Counter(r.hash_ids[0] for r in trace)
    prompts = [tokens_of(r, vocab_size=VOCAB)[:max_prompt] for r in trace if firsts[r.hash_ids[0]] >= 2]
    return prompts[:limit]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-prompt", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--trace", type=Path, default=TRACE,
                    help="a Mooncake trace (default: the synthetic one beside the checkout, else the tests' "
                         "slice of it)")
    args = ap.parse_args()

    prompts = workload(args.trace if args.trace.exists() else SLICE, args.requests, args.max_prompt)
    max_len = args.max_prompt + args.max_tokens + 64
    root = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    model = root / "model"
    model.mkdir()
    config = llama(args.hidden, args.layers, args.intermediate, max_len)
    (model / "config.json").write_text(json.dumps(config))
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KVTRACE_", "VLLM_"))}
    base |= {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CACHE_ROOT": str(root / "vllm-cache")}
    spool = root / "spool"
    envs = {"off": base, "on": {**base, "KVTRACE_ENABLED": "1", "KVTRACE_SINK": "spool",
                                "KVTRACE_SPOOL_DIR": str(spool), "KVTRACE_JOURNAL_DIR": str(root / "journal"),
                                "KVTRACE_INSTANCE": "bench"}}
    procs = {name: start(name, model, max_len, env, root) for name, env in envs.items()}
    try:
        wait_healthy(procs, root)
        urls = {name: url for name, (_, url) in procs.items()}
        kv = config["num_key_value_heads"] * 64
        h = args.hidden
        params = args.layers * (2 * h * h + 2 * h * kv + 3 * h * args.intermediate)
        print(f"model: Llama, hidden {args.hidden}, {args.layers} layers, {config['num_attention_heads']} heads "
              f"({config['num_key_value_heads']} KV), intermediate {args.intermediate}, vocab {VOCAB}, bfloat16, "
              f"{params / 1e6:.0f}M parameters outside the embeddings")
        print(f"load: {len(prompts)} requests, {sum(map(len, prompts)):,} prompt tokens, {args.max_tokens} output "
              f"tokens each, {args.concurrency} at a time; vLLM {vllm_version()}")
        warm = [list(range(3000 + 40 * i, 3000 + 40 * i + 300)) for i in range(args.concurrency)]
        with httpx.Client() as client, ThreadPoolExecutor(args.concurrency) as pool:
            for url in urls.values():  # warm-up: prompts that share nothing with the load
                list(pool.map(lambda p, u=url: stream(client, u, p, args.max_tokens), warm))
            ttft: dict[str, list[float]] = {"off": [], "on": []}
            busy = {"off": 0.0, "on": 0.0}
            ratios: list[float] = []
            paired: list[float] = []  # one request's time to first token, on over off (same cache state)
            for b in range(0, len(prompts), args.concurrency):
                batch = prompts[b:b + args.concurrency]
                order = ("off", "on") if (b // args.concurrency) % 2 == 0 else ("on", "off")
                took = {}
                for name in order:
                    started = time.perf_counter()
                    results = list(pool.map(lambda p, u=urls[name]: stream(client, u, p, args.max_tokens), batch))
                    took[name] = time.perf_counter() - started
                    busy[name] += took[name]
                    ttft[name] += [first for first, _ in results]
                ratios.append(took["on"] / took["off"])
                paired += [on / off for on, off in zip(ttft["on"][-len(batch):], ttft["off"][-len(batch):],
                                                       strict=True)]
        rps = {name: len(prompts) / busy[name] for name in busy}
        med = {name: statistics.median(ttft[name]) for name in ttft}
        print(f"\n{'variant':<8} {'req/s':>8} {'median TTFT ms':>15} {'p90 TTFT ms':>12}")
        for name in ("off", "on"):
            p90 = statistics.quantiles(ttft[name], n=10)[-1]
            print(f"{name:<8} {rps[name]:>8.3f} {med[name] * 1e3:>15.1f} {p90 * 1e3:>12.1f}")
        print(f"\non / off: time {busy['on'] / busy['off']:.3f}x (median batch {statistics.median(ratios):.3f}x), "
              f"requests/s {rps['on'] / rps['off']:.3f}x, median TTFT {med['on'] / med['off']:.3f}x "
              f"(median per request {statistics.median(paired):.3f}x)")
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _ in procs.values():
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while list((root / "journal").glob("*.kvjournal")) and time.monotonic() < deadline:
        time.sleep(0.5)
    events = [e for f in sorted(spool.glob(f"*{SPOOL_SUFFIX}")) for e in iter_file_events(f)]
    lookups = sum(e.kind is EventKind.LOOKUP for e in events)
    served = len(prompts) + len(warm)
    print(f"on: {len(events):,} events in the spool, {lookups} lookups for {served} requests served"
          + ("" if lookups == served else "  <- MISMATCH: the run is void"))


if __name__ == "__main__":
    main()
