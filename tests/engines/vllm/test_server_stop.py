"""vLLM's OpenAI server stopped as it stops in production: every request's events survive.

The server runs its engine core in a process of its own, the plugin on by environment only, and
is stopped with SIGTERM right after its last response. With its default shutdown timeout of 0 s
it sends its engine core SIGTERM and kills its process tree in the same moment, so nothing the
engine core's emitter still held could be flushed; the emitter's schedule is set to a minute
here, so it had shipped nothing at all. Every lookup and adopt must still reach the spool, from
the engine core's journal, by the shipper it started outside that process tree.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kvtrace.instrumentation.journal import journals
from kvtrace.schema import EventKind
from kvtrace.schema.kinds import Ending
from kvtrace.schema.records import EmitterStats
from kvtrace.schema.wire import SPOOL_SUFFIX, decode_batch, read_spool
from kvtrace.store.ingest import iter_file_events

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 2048,
    "max_position_embeddings": 1024, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _counter(metrics: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_sigterm_right_after_the_last_response_loses_no_request(tmp_path: Path) -> None:
    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA))
    spool, journal_dir = tmp_path / "spool", tmp_path / "journal"
    port = _free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CACHE_ROOT=str(tmp_path / "cache"),
               KVTRACE_ENABLED="1", KVTRACE_SINK="spool", KVTRACE_SPOOL_DIR=str(spool),
               KVTRACE_JOURNAL_DIR=str(journal_dir), KVTRACE_INSTANCE="vllm-server",
               KVTRACE_SCHEDULE_DELAY_MILLIS="60000")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the engine core in its own process, as in production
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115 - closed below
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--load-format", "dummy",
         "--skip-tokenizer-init", "--block-size", "32", "--enforce-eager", "--enable-prefix-caching",
         "--max-model-len", "512", "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 420
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            try:
                if _get(base + "/health") is not None:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(1)

        shared = list(range(10, 210))
        prompts = [shared + [5] * 20, shared + [6] * 30, shared[:100] + [7] * 40, shared + [5] * 20,
                   list(range(500, 700)), shared + [6] * 30]
        for prompt in prompts:  # one at a time: each is looked up once
            out = _post(base + "/v1/completions", {"model": str(model), "prompt": prompt, "max_tokens": 2,
                                                   "ignore_eos": True})
            assert out["choices"], out
        metrics = _get(base + "/metrics")
        queries = _counter(metrics, "vllm:prefix_cache_queries_total")
        assert queries == sum(len(p) for p in prompts), metrics[-3000:]

        server.send_signal(signal.SIGTERM)  # right after the last response
        server.wait(120)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(30)
        log.close()

    deadline = time.monotonic() + 120
    while journals(journal_dir) and time.monotonic() < deadline:  # the shipper drains, then removes it
        time.sleep(0.2)
    assert not journals(journal_dir), (tmp_path / "server.log").read_text()[-4000:]

    events = [e for f in sorted(spool.glob(f"*{SPOOL_SUFFIX}")) for e in iter_file_events(f)]
    lookups = [e for e in events if e.kind is EventKind.LOOKUP]
    adopts = {e.request_id for e in events if e.kind is EventKind.ADOPT}
    assert len({e.request_id for e in lookups}) == len(prompts) == len(lookups)
    assert {e.request_id for e in lookups} == adopts
    assert sum(e.prompt_tokens for e in lookups) == queries
    assert {e.instance for e in events} == {"vllm-server"}

    stats: list[EmitterStats] = []
    for f in sorted(spool.glob(f"*{SPOOL_SUFFIX}")):
        with f.open("rb") as stream:
            stats += [s for p in read_spool(stream).payloads if (s := decode_batch(p).stats) is not None]
    final = max(stats, key=lambda s: s.ts_ns)
    assert final.ended in (Ending.CLEAN, Ending.UNCLEAN) and final.dropped == 0
    # at least once: a batch the engine core sent as it was killed may have been shipped again
    assert final.exported >= final.emitted == len({(e.source_id, e.seq) for e in events})
