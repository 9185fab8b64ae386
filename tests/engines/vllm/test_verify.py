"""The correctness oracle on a real vLLM engine (tiny random-weight checkpoints, CPU).

Clean prefix hits must equal recompute; a weight update that vLLM does not treat as a cache
invalidation (`reload_weights` after the checkpoint changed, no reset) reuses stale KV, which
kvtrace flags as an identity mismatch and re-execution shows as divergence; with the cache reset
on the update the same flow is clean. Each model runs in its own process (one engine, clean
environment), which prints its verification rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from kvtrace.schema.verdicts import Agreement, GapReason, Verdict, Verification

SHAPE = dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, max_position_embeddings=1024)


def save_checkpoint(kind: str, path: Path, seed: int) -> None:
    """Random weights, spread enough that outputs depend on the KV they read."""
    import torch

    torch.manual_seed(seed)
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**SHAPE, num_hidden_layers=2, initializer_range=0.2,
                                             bos_token_id=1, eos_token_id=2))
    else:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        model = Gemma3ForCausalLM(Gemma3TextConfig(
            **SHAPE, num_hidden_layers=4, sliding_window=64, query_pre_attn_scalar=32, initializer_range=0.05,
            layer_types=["sliding_attention"] * 3 + ["full_attention"], bos_token_id=2, eos_token_id=1,
            pad_token_id=0))
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)


def save_adapter(path: Path, seed: int, rank: int = 8) -> None:
    """A LoRA adapter for the tiny Llama (q and v projections), written as PEFT lays it out."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for layer in range(2):
        for module, out in (("q_proj", 128), ("v_proj", 64)):
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = (torch.randn(rank, 128) * 0.3).to(torch.bfloat16)
            tensors[f"{name}.lora_B.weight"] = (torch.randn(out, rank) * 0.3).to(torch.bfloat16)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "bias": "none",
        "lora_dropout": 0.0, "task_type": "CAUSAL_LM"}))


def child(kind: str, root: str) -> None:
    os.environ.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                       "VLLM_CACHE_ROOT": f"{root}/cache", "KVTRACE_ENABLED": "1", "KVTRACE_SINK": "spool",
                       "KVTRACE_SPOOL_DIR": f"{root}/spool", "KVTRACE_INSTANCE": f"verify-{kind}"})
    from vllm import LLM

    from kvtrace.analysis.oracle import engine_request, verification
    from kvtrace.analysis.reconstruct import reconstruct
    from kvtrace.instrumentation.api import get_emitter
    from kvtrace.instrumentation.vllm.recipe import recipe_from_kv_cache_config
    from kvtrace.instrumentation.vllm.verify import noise_pairs, verify_prompts
    from kvtrace.schema.divergence import noise_floor
    from kvtrace.store.ingest import iter_file_events

    model = Path(root) / "model"
    save_checkpoint(kind.split("-")[0], model, seed=0)
    transfer = None
    if kind.endswith("-offload"):  # vLLM's CPU offloading behind kvtrace's connector shim: a host tier
        from vllm.config import KVTransferConfig

        sys.path.insert(0, str(Path(__file__).parent))  # the engine imports the host copy spec by name
        transfer = KVTransferConfig(
            kv_connector="KvtraceConnectorHMA", kv_connector_module_path="kvtrace.instrumentation.vllm.connector",
            kv_role="kv_both", kv_connector_extra_config={"cpu_bytes_to_use": 16 << 20, "spec_name": "HostCopySpec",
                                                          "spec_module_path": "test_connector_offloading",
                                                          "kvtrace_inner": "OffloadingConnector"})
    lora = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2} if kind == "llama-lora" else {}
    llm = LLM(model=str(model), skip_tokenizer_init=True, enable_prefix_caching=True, block_size=32,
              enforce_eager=True, max_model_len=512, kv_transfer_config=transfer, **lora)
    shared = [100 + (7 * i) % 1500 for i in range(256)]
    generate = lambda tokens: verify_prompts(llm, [tokens], n_gen=1)  # noqa: E731 - a warm-up request
    generate(shared + [5] * 20)
    phases: dict[str, list] = {}
    if lora:  # an adapter rewritten and reloaded in place: vLLM keys its blocks by name and path only
        from vllm.lora.request import LoRARequest

        adapter = Path(root) / "adapter"
        save_adapter(adapter, seed=1)
        a1 = LoRARequest("a1", 1, str(adapter))
        verify_prompts(llm, [shared + [5] * 20], n_gen=1, lora=a1)
        phases["adapter_clean"] = verify_prompts(llm, [shared + [6] * 30], lora=a1)
        noise = noise_pairs(llm, [shared + [8] * 10], lora=a1)
        save_adapter(adapter, seed=2)
        phases["adapter_stale"] = verify_prompts(llm, [shared + [7] * 30],
                                                 lora=LoRARequest("a1", 1, str(adapter), load_inplace=True))
    elif transfer is not None:  # the device copy goes; the next request restores the prefix from host
        assert llm.reset_prefix_cache()
        phases["partial"] = verify_prompts(llm, [shared + [6] * 30])
        noise = noise_pairs(llm, [shared + [8] * 10])
    else:
        phases["clean"] = verify_prompts(llm, [shared + [6] * 30, shared[:128] + [7] * 40])
        noise = noise_pairs(llm, [shared + [8] * 10])
        save_checkpoint(kind, model, seed=1)  # the checkpoint changes under the running engine
        llm.collective_rpc("reload_weights")
        phases["stale"] = verify_prompts(llm, [shared + [9] * 30])
        assert llm.reset_prefix_cache()  # what a careful deployment does on a weight update
        generate(shared + [5] * 20)
        phases["after_reset"] = verify_prompts(llm, [shared + [10] * 30])
    assert get_emitter().force_flush(timeout_millis=30_000)

    spool = Path(root) / "spool"
    events = sorted((e for f in sorted(spool.iterdir()) for e in iter_file_events(f)),
                    key=lambda e: (e.ts_ns, e.source_id, e.seq))
    recipe = recipe_from_kv_cache_config(
        llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.kv_cache_config)
    results = list(reconstruct(events, recipe))
    floor = noise_floor(noise)
    rows = {}
    for phase, pairs in phases.items():
        rows[phase] = []
        for pair in pairs:
            result = engine_request(results, pair.request_id)
            assert result is not None, pair.request_id
            rows[phase].append(verification(result, pair.cached, pair.fresh, floor, run_id=kind, ts_ns=result.ts_ns))
    revisions = sorted({e.model_revision for e in events if e.model_revision})
    print("RESULT " + json.dumps({"floor": floor, "revisions": revisions,
                                  "rows": {k: json.loads(msgspec.json.encode(v)) for k, v in rows.items()}}))


@pytest.mark.parametrize("kind", ["llama", "gemma3", "llama-offload", "llama-lora"])
def test_verify_confirms_clean_hits_and_catches_stale_weights(kind: str, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, __file__, kind, str(tmp_path)], capture_output=True, text=True,
                          timeout=900)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line is not None, proc.stderr[-4000:]
    got = json.loads(line[len("RESULT "):])
    rows = {k: [msgspec.convert(r, Verification) for r in v] for k, v in got["rows"].items()}
    assert got["floor"] == 0.0  # CPU kernels are deterministic: two fresh runs are bit-identical
    if kind == "llama-lora":  # blocks from before an in-place adapter reload are another identity
        (clean,) = rows["adapter_clean"]
        assert clean.adopted_tokens == 256 and clean.agreement is Agreement.IDENTICAL
        (stale,) = rows["adapter_stale"]
        assert stale.adopted_tokens == 256 and stale.unsafe_reuse and stale.reason is GapReason.IDENTITY_MISMATCH
        assert stale.agreement is Agreement.ALARM_CONFIRMED and "adapter" in stale.detail
        return
    if kind.endswith("-offload"):  # restored from the host tier: PARTIAL, and identical to recompute
        (partial,) = rows["partial"]
        assert partial.verdict is Verdict.PARTIAL and partial.adopted_tokens == 256 and not partial.unsafe_reuse
        assert partial.agreement is Agreement.IDENTICAL and partial.positions > 0
        return
    assert all(r for r in got["revisions"])  # never empty
    if kind in ("llama", "gemma3"):
        assert len(got["revisions"]) == 2  # moved by the reload

    clean = rows["clean"]
    # A whole-prefix hit, and one on half the prefix: full attention keeps every block, while the
    # sliding window keeps no window state at 128 tokens, so Gemma-3 recomputes that one.
    assert [r.adopted_tokens for r in clean] == ([256, 128] if kind == "llama" else [256, 0])
    for r in clean:
        assert r.agreement is (Agreement.IDENTICAL if r.adopted_tokens else Agreement.NOTHING_REUSED), r.detail
        assert r.max_abs_diff == 0.0 and r.positions > 0 and not r.unsafe_reuse

    (stale,) = rows["stale"]
    assert stale.adopted_tokens == 256 and stale.unsafe_reuse
    assert stale.reason is GapReason.IDENTITY_MISMATCH
    assert stale.agreement is Agreement.ALARM_CONFIRMED and stale.max_abs_diff > 0.5
    assert "model_revision" in stale.detail

    (after,) = rows["after_reset"]
    assert after.adopted_tokens == 256 and not after.unsafe_reuse
    assert after.agreement is Agreement.IDENTICAL


def test_the_verify_command_stores_its_judgements(tmp_path: Path) -> None:
    """`kvtrace verify` end to end: serve the prompts, pick per class, re-execute, store rows."""
    model, prompts = tmp_path / "model", tmp_path / "prompts.jsonl"
    save_checkpoint("llama", model, seed=0)
    shared = [100 + (7 * i) % 1500 for i in range(256)]
    rows = [shared + [10 + t] * (20 + t) for t in range(4)] + [list(range(600, 800))]
    prompts.write_text("".join(json.dumps({"prompt_token_ids": r}) + "\n" for r in rows))
    dsn = f"chdb:///{tmp_path}/db"
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "kvtrace.cli.main", "--dsn", dsn, "verify", str(model), "--prompts",
                           str(prompts), "--max-model-len", "512", "--per-class", "2"],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "verified 4 of 5 requests" in proc.stdout and "recoverable_identical 4" in proc.stdout

    from kvtrace.store.client import Store

    with Store(dsn) as store:
        got = store.query_polars(f"SELECT agreement, adopted_tokens FROM {store.db}.verifications")
        assert got["agreement"].to_list() == ["recoverable_identical"] * 4
        assert store.count_events() > 0  # the events the verdicts came from are stored beside them


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2])
