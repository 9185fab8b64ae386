"""What tracing adds to a real vLLM process: no store, DataFrame, query engine or web framework.

The same tiny engine (random-weight Llama, CPU, the engine core in-process) serves the same
requests twice, each time in a fresh interpreter with kvtrace's plugin switched by environment
only: once with KVTRACE_ENABLED=0, once with KVTRACE_ENABLED=1 and the spool sink. vLLM may
import some of those packages itself; what tracing adds is the difference between the two
processes' modules at the end.

This file is also the engine process: `python test_footprint.py WORKDIR` serves the requests and
prints what the process holds as one `RESULT {json}` line. benchmarks/bench_engine_footprint.py
runs it the same way to measure what tracing adds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

# Packages the engine side must never load (the engine-side contract in pyproject.toml).
FORBIDDEN = frozenset({"clickhouse_connect", "chdb", "polars", "pyarrow", "duckdb", "fastapi", "plotly"})
# kvtrace's rooms above the engine side: none of their modules belongs in an engine process.
UPPER_ROOMS = ("kvtrace.store", "kvtrace.analysis", "kvtrace.collector", "kvtrace.dashboards", "kvtrace.cli")

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "vocab_size": 2048, "max_position_embeddings": 1024, "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2,
}
SHARED = list(range(10, 210))
PROMPTS = [SHARED + [5] * 20, SHARED + [6] * 30, SHARED[:100] + [7] * 40, SHARED + [5] * 20,
           list(range(500, 700))]


def engine_env(work: Path, tracing: bool) -> dict[str, str]:
    """The environment of one engine process: vLLM on this CPU, kvtrace's plugin on or off."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTRACE_")}
    env.update({
        "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CACHE_ROOT": str(work / "cache"),
        "KVTRACE_HOME": str(work / "home"), "KVTRACE_ENABLED": "1" if tracing else "0",
        "KVTRACE_SPOOL_DIR": str(work / "spool"), "KVTRACE_INSTANCE": "footprint",
    })
    return env


def serve(work: Path) -> dict:
    """Build the engine, serve PROMPTS one at a time, and say what this process holds. Imports
    nothing of kvtrace's itself: every kvtrace module here is one the plugin loaded."""
    started = time.perf_counter()
    from vllm import LLM
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import SamplingParams

    model = work / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(LLAMA))
    imported = time.perf_counter()
    llm = LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True, enable_prefix_caching=True,
              block_size=32, enforce_eager=True, max_model_len=512)
    built = time.perf_counter()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    cached = []
    for p in PROMPTS:
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)
        cached.append(out.num_cached_tokens)
    served = time.perf_counter()
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    # The export path's own imports count too: flush (through the module the plugin loaded, if it
    # did) before looking.
    api = sys.modules.get("kvtrace.instrumentation.api")
    flushed = api.get_emitter().force_flush(timeout_millis=30_000) if api is not None else None
    status = dict(x.split(":", 1) for x in Path("/proc/self/status").read_text().splitlines() if ":" in x)
    return {
        "modules": sorted(sys.modules),
        "rss_kb": int(status["VmRSS"].split()[0]), "peak_rss_kb": int(status["VmHWM"].split()[0]),
        "import_s": imported - started, "build_s": built - imported, "serve_s": served - built,
        "cached": cached, "traced": getattr(scheduler, "_kvtrace_shim", None) is not None, "flushed": flushed,
    }


def run_engine(work: Path, tracing: bool) -> dict:
    proc = subprocess.run([sys.executable, __file__, str(work)], check=False, env=engine_env(work, tracing),
                          capture_output=True, text=True, timeout=600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line is not None, proc.stderr[-4000:]
    return json.loads(line[len("RESULT "):])


def test_tracing_adds_no_store_dataframe_or_web_module_to_the_engine_process(tmp_path: Path) -> None:
    off = run_engine(tmp_path / "off", tracing=False)
    on = run_engine(tmp_path / "on", tracing=True)

    # The same engine both times, serving the same hits; only the traced one has the shim.
    assert off["cached"] == on["cached"] and sum(on["cached"]) > 0
    assert not off["traced"] and on["traced"] and on["flushed"]

    added = sorted(set(on["modules"]) - set(off["modules"]))
    assert "kvtrace.instrumentation.vllm.shim" in added and "kvtrace.instrumentation.sinks.spool" in added
    assert [m for m in added if m.split(".")[0] in FORBIDDEN] == []
    for run in (off, on):  # the plugin, on or off, loads nothing of kvtrace's upper rooms
        assert [m for m in run["modules"] if m.startswith(UPPER_ROOMS)] == []

    # The traced run really traced: a lookup per request in its spool, adopting what vLLM reported.
    from kvtrace.schema import EventKind
    from kvtrace.store.ingest import iter_file_events

    assert not (tmp_path / "off" / "spool").exists()
    events = [e for f in sorted((tmp_path / "on" / "spool").iterdir()) for e in iter_file_events(f)]
    lookups = [e for e in events if e.kind is EventKind.LOOKUP]
    adopts = sorted((e for e in events if e.kind is EventKind.ADOPT), key=lambda e: (e.ts_ns, e.seq))
    assert len(lookups) == len(PROMPTS) and {e.instance for e in events} == {"footprint"}
    assert [sum(e.reused_tokens) for e in adopts] == on["cached"]


if __name__ == "__main__":
    print("RESULT " + json.dumps(serve(Path(sys.argv[1]))))
