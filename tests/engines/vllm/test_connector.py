"""The connector shim around vLLM's example disk connector, in a real engine (one per process:
vLLM's KV-transfer group is process-global, so each run is a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec

from kvtrace.analysis.reconstruct import reconstruct
from kvtrace.schema import EventKind, Tier
from kvtrace.schema.recipes import Recipe
from kvtrace.schema.verdicts import Verdict
from kvtrace.store.ingest import iter_file_events

PREFIX = list(range(10, 266))  # 256 tokens: 8 blocks of 32


def child(root: str, wrapped: str) -> None:
    os.environ.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                       "VLLM_CACHE_ROOT": f"{root}/cache", "KVTRACE_ENABLED": "1", "KVTRACE_SINK": "spool",
                       "KVTRACE_SPOOL_DIR": f"{root}/spool", "KVTRACE_INSTANCE": "conn"})
    from transformers import LlamaConfig, LlamaForCausalLM
    from vllm import LLM
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import SamplingParams

    from kvtrace.instrumentation.api import get_emitter
    from kvtrace.instrumentation.vllm.recipe import recipe_from_kv_cache_config

    model = Path(root).parent / "model"  # shared by both runs
    if not model.exists():  # random weights with a wide init: outputs depend on the KV they read
        import torch

        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=32, vocab_size=2048, max_position_embeddings=1024,
                                     initializer_range=0.2)).save_pretrained(model, safe_serialization=True)
    extra = {"shared_storage_path": f"{root}/disk-{wrapped}"}
    name, module = "ExampleConnector", None
    if wrapped == "yes":
        extra["kvtrace_inner"] = name
        name, module = "KvtraceConnector", "kvtrace.instrumentation.vllm.connector"
    llm = LLM(model=str(model), skip_tokenizer_init=True, enable_prefix_caching=True, block_size=32,
              enforce_eager=True, max_model_len=384, num_gpu_blocks_override=16, dtype="float32",
              kv_transfer_config=KVTransferConfig(kv_connector=name, kv_connector_module_path=module,
                                                  kv_role="kv_both", kv_connector_extra_config=extra))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out = {}
    for label, prompt in (("a", PREFIX + [7] * 10), ("b", PREFIX + [9] * 10)):
        (r,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        out[label] = {"cached": r.num_cached_tokens, "tokens": list(r.outputs[0].token_ids)}
        llm.reset_prefix_cache()  # the device cache only: b must come back from disk
    get_emitter().force_flush(timeout_millis=30_000)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    out["recipe"] = json.loads(msgspec.json.encode(
        recipe_from_kv_cache_config(scheduler.kv_cache_manager.kv_cache_config)))
    out["bytes_per_block"] = scheduler.connector._bytes_per_block[0] if wrapped == "yes" else 0
    print("RESULT " + json.dumps(out))


def run(root: Path, wrapped: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, str(root), wrapped], capture_output=True, text=True, timeout=600)
    line = next((line for line in proc.stdout.splitlines() if line.startswith("RESULT ")), None)
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(line[7:])


def test_wrapped_disk_connector_reports_offloads_and_loads_and_changes_nothing(tmp_path: Path) -> None:
    plain, wrapped = run(tmp_path / "plain", "no"), run(tmp_path / "wrapped", "yes")
    assert plain["b"]["cached"] == wrapped["b"]["cached"] == 256  # all from disk after the reset
    assert plain["a"]["tokens"] == wrapped["a"]["tokens"] and plain["b"]["tokens"] == wrapped["b"]["tokens"]

    spool = tmp_path / "wrapped" / "spool"
    events = sorted((e for f in sorted(spool.iterdir()) for e in iter_file_events(f)),
                    key=lambda e: (e.ts_ns, e.source_id, e.seq))
    per_block = wrapped["bytes_per_block"]
    loads = [e for e in events if e.kind is EventKind.LOAD]
    offloads = [e for e in events if e.kind is EventKind.OFFLOAD]
    (load,) = loads
    assert (load.src_tier, load.dst_tier, load.in_flight) == (Tier.DISK, Tier.DEVICE, False) and load.duration_ns > 0
    assert len((load.block_key, *load.more_keys)) == 8 and load.nbytes == per_block > 0  # per block, in a run too
    stored = {k for e in offloads for k in (e.block_key, *e.more_keys)}
    assert {load.block_key, *load.more_keys} <= stored
    assert all(e.dst_tier is Tier.DISK and e.nbytes == per_block for e in offloads)

    recipe = msgspec.convert(wrapped["recipe"], Recipe)
    results = sorted((r for r in reconstruct(events, recipe) if r.adopt_seen), key=lambda r: r.seq)
    b = results[-1]
    assert b.adopted_tokens == b.recoverable_hit_tokens == 256 and not b.unsafe_reuse
    assert b.verdict is Verdict.PARTIAL and b.resident_hit_tokens == 0 and b.restore_disk_bytes == 8 * per_block


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2])


def test_the_wrapper_forwards_every_method_of_the_connector_api() -> None:
    """vLLM's base class has a default for almost every method: one not forwarded would silently
    run the default instead of the wrapped connector."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvtrace.instrumentation.vllm.connector import KvtraceConnector, KvtraceConnectorHMA

    for cls in (KvtraceConnector, KvtraceConnectorHMA):
        assert not cls.__abstractmethods__
        missing = [name for name, value in vars(KVConnectorBase_V1).items()
                   if not name.startswith("__") and (callable(value) or isinstance(value, property))
                   and name not in ("role", "_get_connector_metadata")
                   and not any(name in vars(k) for k in cls.__mro__ if k is not KVConnectorBase_V1)]
        assert missing == [], missing
