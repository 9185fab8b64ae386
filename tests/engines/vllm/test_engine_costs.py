"""Cost models on a real engine's recorded events: vLLM with its OffloadingConnector (the host
copy spec of test_connector_offloading) reloads prefixes of ten sizes from the host tier; the
shim's timed loads are fitted, a prefill model is calibrated with torch for the same model
shape, and every reload is priced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import polars as pl
import pytest

from kvtrace.analysis.calibrate import ModelShape, calibrate_prefill
from kvtrace.analysis.costs import PrefillModel, crossover_tokens, fit_prefill, fit_transfers, restore_decisions
from kvtrace.analysis.funnel import results_frame
from kvtrace.analysis.planning import empty_events
from kvtrace.analysis.reconstruct import reconstruct
from kvtrace.schema.arrow import to_arrow
from kvtrace.schema.kinds import Tier
from kvtrace.schema.recipes import Recipe
from kvtrace.schema.records import CalibrationSample
from kvtrace.store.ingest import iter_file_events

BLOCKS = range(2, 12)  # prefixes of 2..11 blocks of 32 tokens
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             num_hidden_layers=2)


def child(root: str) -> None:
    os.environ.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                       "VLLM_CACHE_ROOT": f"{root}/cache", "KVTRACE_ENABLED": "1", "KVTRACE_SINK": "spool",
                       "KVTRACE_SPOOL_DIR": f"{root}/spool", "KVTRACE_INSTANCE": "costs"})
    sys.path.insert(0, str(Path(__file__).parent))  # the engine imports the host copy spec by name
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from vllm import LLM
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import SamplingParams

    from kvtrace.instrumentation.api import get_emitter
    from kvtrace.instrumentation.vllm.recipe import recipe_from_kv_cache_config

    model = Path(root) / "model"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPE, vocab_size=2048, max_position_embeddings=1024)).save_pretrained(
        model, safe_serialization=True)
    extra = {"cpu_bytes_to_use": 16 << 20, "spec_name": "HostCopySpec", "spec_module_path": "test_connector_offloading",
             "kvtrace_inner": "OffloadingConnector"}
    llm = LLM(model=str(model), skip_tokenizer_init=True, enable_prefix_caching=True, block_size=32,
              enforce_eager=True, max_model_len=400, num_gpu_blocks_override=64, dtype="float32",
              kv_transfer_config=KVTransferConfig(kv_connector="KvtraceConnectorHMA", kv_role="kv_both",
                                                  kv_connector_module_path="kvtrace.instrumentation.vllm.connector",
                                                  kv_connector_extra_config=extra))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    cached = []
    for n in BLOCKS:
        prefix = [100 * n + i for i in range(32 * n)]
        for tail in (7, 9):  # the first offloads the prefix; after a device reset the second reloads it
            (r,) = llm.generate([TokensPrompt(prompt_token_ids=prefix + [tail] * 10)], params, use_tqdm=False)
            assert llm.reset_prefix_cache()
        cached.append(r.num_cached_tokens)
    get_emitter().force_flush(timeout_millis=30_000)
    config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.kv_cache_config
    print("RESULT " + json.dumps({"cached": cached,
                                  "recipe": json.loads(msgspec.json.encode(recipe_from_kv_cache_config(config)))}))


def test_costs_fit_a_real_engines_reloads_and_price_them(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, timeout=900)
    line = next((line for line in proc.stdout.splitlines() if line.startswith("RESULT ")), None)
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    out: dict[str, Any] = json.loads(line[7:])
    assert out["cached"] == [32 * n for n in BLOCKS]  # every prefix came back whole from the host

    events = sorted((e for f in sorted((tmp_path / "spool").iterdir()) for e in iter_file_events(f)),
                    key=lambda e: (e.ts_ns, e.source_id, e.seq))
    frame = pl.from_arrow(to_arrow(events))
    (transfer,) = [t for t in fit_transfers(frame) if (t.src, t.dst) == (Tier.HOST, Tier.DEVICE)]
    assert transfer.fit.n == len(BLOCKS) and transfer.latency_s >= 0 and transfer.bytes_per_s > 0

    # vLLM's adopts carry no recompute time: calibrate a prefill for the same shape on this CPU
    shape = ModelShape(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256)
    model = str(tmp_path / "model")
    samples = calibrate_prefill(shape, model, starts=(0, 128, 256), chunks=(32, 64, 128, 256))
    (prefill,) = fit_prefill(empty_events(), calibrations=pl.from_arrow(to_arrow(samples, CalibrationSample)))
    assert isinstance(prefill, PrefillModel) and prefill.seconds(0, 256) > 0
    crossover = crossover_tokens(transfer, prefill, shape.kv_bytes_per_token(), 0)

    results = list(reconstruct(events, msgspec.convert(out["recipe"], Recipe)))
    decisions = restore_decisions(results_frame(results), [transfer], [prefill])
    reloads = decisions.filter(pl.col("restored"))
    assert sorted(reloads["span_tokens"].to_list()) == [32 * n for n in BLOCKS]
    assert (reloads["restore_s"] > 0).all() and (reloads["recompute_s"] > 0).all()
    # The engine's blocks hold the shape's KV bytes per token, so a reload is priced as moving
    # the shape's bytes for its span (the price the crossover assumes).
    per_token = shape.kv_bytes_per_token()
    for span, restore_s in zip(reloads["span_tokens"], reloads["restore_s"], strict=True):
        assert restore_s == pytest.approx(transfer.seconds(span * per_token), rel=1e-9)
    # Where the fitted costs cross once (recompute minus load is increasing), one threshold
    # decides every reload. A calibration on this loaded 2-core machine can fit a negative
    # per-pair cost (noise), and then the curves may cross twice; the prices above still hold.
    f = prefill.fit
    if crossover is not None and f["per_pair_s"] >= 0 and f["per_token_s"] >= per_token / transfer.bytes_per_s:
        assert (reloads["restore_cheaper"] == (reloads["span_tokens"] >= crossover)).all()


if __name__ == "__main__":
    child(sys.argv[1])
