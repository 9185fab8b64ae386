"""A real vLLM engine (tiny random-weight models, CPU) with the kvtrace plugin switched on by
environment only: the stored events reconstruct what the engine reported for every request."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvtrace.analysis.reconstruct import reconstruct
from kvtrace.instrumentation.api import get_emitter
from kvtrace.instrumentation.vllm.recipe import recipe_from_kv_cache_config
from kvtrace.schema import ComponentKind, EventKind
from kvtrace.store.ingest import iter_file_events

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 2048,
    "max_position_embeddings": 1024, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}
GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 2048,
    "max_position_embeddings": 1024, "sliding_window": 64,
    "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "torch_dtype": "bfloat16", "query_pre_attn_scalar": 32,
    "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
}


@pytest.fixture(scope="module")
def spool(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vllm")
    os.environ.update({
        "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CACHE_ROOT": str(root / "cache"),
        "KVTRACE_ENABLED": "1", "KVTRACE_SINK": "spool", "KVTRACE_SPOOL_DIR": str(root / "spool"),
        "KVTRACE_INSTANCE": "vllm-test",
    })
    return root / "spool"


@pytest.mark.parametrize(("name", "config"), [("llama", LLAMA), ("gemma3", GEMMA3)])
def test_plugin_events_reconstruct_the_engines_cached_tokens(name: str, config: dict, spool: Path,
                                                            tmp_path: Path) -> None:
    from vllm import LLM
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import SamplingParams

    model = tmp_path / name
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    llm = LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True, enable_prefix_caching=True,
              block_size=32, enforce_eager=True, max_model_len=512, disable_log_stats=False)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    assert getattr(scheduler, "_kvtrace_shim", None) is not None, "the plugin did not attach"

    shared = list(range(10, 210))
    prompts = [shared + [5] * 20, shared + [6] * 30, shared[:100] + [7] * 40, shared + [5] * 20, list(range(500, 700))]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    reported = []
    for p in prompts:  # one at a time: the engine's order is the submission order
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)
        reported.append(out.num_cached_tokens)
    shim = scheduler._kvtrace_shim
    shim.sample_usage(force=True)  # the pool after the last request: its blocks cached, none held
    pool = scheduler.kv_cache_manager.block_pool
    pool_bytes = (pool.num_gpu_blocks - 1) * shim.pool_block_bytes
    assert get_emitter().force_flush(timeout_millis=30_000)
    assert sum(reported) > 0

    recipe = recipe_from_kv_cache_config(scheduler.kv_cache_manager.kv_cache_config)
    if name == "gemma3":
        assert [g.component for g in recipe.groups] == ([ComponentKind.SLIDING_WINDOW] * 3
                                                        + [ComponentKind.FULL_ATTENTION])
    events = sorted((e for f in sorted(spool.iterdir()) for e in iter_file_events(f) if e.model == str(model)),
                    key=lambda e: (e.ts_ns, e.source_id, e.seq))
    assert {EventKind.LOOKUP, EventKind.ADOPT, EventKind.COMMIT, EventKind.USAGE} <= {e.kind for e in events}
    usage = [e for e in events if e.kind is EventKind.USAGE]
    # the real engine's KV tensors over its blocks: held + evictable + free is the whole pool
    assert all(e.locked_bytes + e.evictable_bytes + e.free_bytes == pool_bytes for e in usage)
    assert usage[-1].locked_bytes == 0 and usage[-1].evictable_bytes > 0
    results = sorted((r for r in reconstruct(events, recipe) if r.adopt_seen), key=lambda r: r.seq)
    assert [r.adopted_tokens for r in results] == reported
    assert [r.recoverable_hit_tokens for r in results] == reported
    assert not any(r.unsafe_reuse for r in results)


def test_every_method_the_plugin_wraps_wears_its_originals_face(spool: Path, tmp_path: Path) -> None:
    """vLLM reads the methods it calls: a utility call's msgpack arguments are converted by the
    annotations of the engine core's method (a bare wrapper on `add_lora` handed the adapter in
    as a list and killed the engine core). Every class patch, every method the shim wrapped on
    the engine's objects and every method of the connector shim has its original's signature,
    annotations, name and docstring."""
    import inspect

    from transparency import unfaithful
    from vllm import LLM
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvtrace.instrumentation.hooks import class_patches
    from kvtrace.instrumentation.vllm.connector import KvtraceConnector, KvtraceConnectorHMA

    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA))
    llm = LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True, enable_prefix_caching=True,
              block_size=32, enforce_eager=True, max_model_len=512)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    patched = {f"{cls.__name__}.{name}" for cls, name, _ in class_patches()}
    assert {"Scheduler.__init__", "EngineCore.collective_rpc", "EngineCore.add_lora",
            "EngineCore.set_weight_version"} <= patched, patched
    assert any(name.endswith(".find_longest_cache_hit") for name in patched), patched
    assert unfaithful(class_patches()) == {}
    wrapped = scheduler._kvtrace_shim.hooks.wrapped()
    assert {name for _, name, _ in wrapped} >= {"get_computed_blocks", "record_prefix_cache_stats",
                                                "reset_prefix_cache"}, wrapped
    assert unfaithful(wrapped) == {}
    base = [(name, value) for name, value in vars(KVConnectorBase_V1).items()
            if inspect.isfunction(value) and not name.startswith("__")]
    assert len(base) > 10
    for connector in (KvtraceConnector, KvtraceConnectorHMA):
        assert unfaithful((connector, name, value) for name, value in base) == {}
