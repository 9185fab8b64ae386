"""The connector shim around vLLM's own OffloadingConnector, in a real engine, on a dense model
and on a hybrid one (sliding window + full attention, several KV-cache groups under HMA).

vLLM's CPU offloading worker needs CUDA or XPU streams, so the connector runs here with a small
offloading spec defined below: vLLM's scheduler side is untouched (its CPU offloading manager:
LRU, chunk allocation, asynchronous loads), only the worker is a plain torch copy between the
engine's KV tensors and a host buffer. The worker records what each job moved per group, which
is what the shim's events are checked against. One engine per process (vLLM's KV-transfer
group is process-global), so each run is a subprocess."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from kvtrace.analysis.reconstruct import reconstruct
from kvtrace.schema import ComponentKind, EventKind, Tier
from kvtrace.schema.events import Event
from kvtrace.schema.recipes import Recipe
from kvtrace.store.ingest import iter_file_events

PREFIX = list(range(10, 266))  # 256 tokens: 8 blocks of 32
SPEC_MODULE = Path(__file__).stem  # the engine imports the spec below by module name
VARIANTS = ("none", "plain", "wrapped")  # no connector, OffloadingConnector, the shim around it
# Random weights with a wide init and untied output embeddings: outputs depend on the KV they read.
COMMON = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, vocab_size=2048, max_position_embeddings=1024, initializer_range=0.2,
              tie_word_embeddings=False)
MODELS: dict[str, dict[str, Any]] = {
    "llama": dict(COMMON, num_hidden_layers=2),
    # Four KV-cache groups under HMA: three sliding-window layers of 64 tokens, one full attention.
    "gemma3": dict(COMMON, num_hidden_layers=4, sliding_window=64, query_pre_attn_scalar=32,
                   layer_types=["sliding_attention"] * 3 + ["full_attention"]),
}

MOVED: list[dict[str, Any]] = []
"""What the host worker moved, one record per job: direction and, per group of the transfer
spec, blocks and bytes."""


class HostCopyWorker(OffloadingWorker):
    """Copies whole block rows with torch, synchronously, between the engine's KV tensors and a
    host buffer of one row per chunk (one block per chunk), group by group as vLLM's worker does:
    a group's blocks go through the tensors its layers use."""

    def __init__(self, kv_caches: CanonicalKVCaches, num_chunks: int) -> None:
        self.device = [t.tensor for t in kv_caches.tensors]  # (num_blocks, page bytes), int8 views
        self.host = [torch.zeros((num_chunks, t.shape[1]), dtype=t.dtype) for t in self.device]
        self.refs = kv_caches.group_data_refs
        self.finished: list[TransferResult] = []

    def _transfer(self, job_id: int, gpu: GPULoadStoreSpec, chunks: LoadStoreSpec, to_host: bool) -> bool:
        device_ids, host_ids = [int(i) for i in gpu.block_ids], [int(i) for i in chunks.block_ids]
        if len(device_ids) != len(host_ids):
            raise ValueError(f"{len(device_ids)} blocks for {len(host_ids)} chunks: one block per chunk only")
        blocks, nbytes, at = [], [], 0
        for refs, n in zip(self.refs, gpu.group_sizes, strict=True):
            rows = torch.tensor(device_ids[at : at + n], dtype=torch.long)
            chunk_rows = torch.tensor(host_ids[at : at + n], dtype=torch.long)
            at += n
            moved = 0
            for ref in refs if n else ():
                device, host = self.device[ref.tensor_idx], self.host[ref.tensor_idx]
                if to_host:
                    host.index_copy_(0, chunk_rows, device.index_select(0, rows))
                else:
                    device.index_copy_(0, rows, host.index_select(0, chunk_rows))
                moved += n * device.shape[1] * device.element_size()
            blocks.append(n)
            nbytes.append(moved)
        MOVED.append({"store": to_host, "blocks": blocks, "bytes": nbytes})
        self.finished.append(TransferResult(job_id, True, transfer_size=sum(nbytes), transfer_time=0.0))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._transfer(job_id, src_spec, dst_spec, to_host=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._transfer(job_id, dst_spec, src_spec, to_host=False)

    def get_finished(self) -> list[TransferResult]:
        finished, self.finished = self.finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        return  # every copy is done when submitted


class HostCopySpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec (its scheduler-side manager) with the torch worker above."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self.blocks_per_chunk != 1:
            raise ValueError("HostCopyWorker moves one block per chunk")
        if self._worker is None:
            self._worker = HostCopyWorker(kv_caches, self.num_chunks)  # type: ignore[assignment]
        return self._worker  # type: ignore[return-value]


def make_model(path: Path, name: str) -> None:
    torch.manual_seed(0)
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**MODELS[name]))
    else:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        model = Gemma3ForCausalLM(Gemma3TextConfig(**MODELS[name]))
    model.save_pretrained(path, safe_serialization=True)


def child(root: str, name: str, variant: str) -> None:
    os.environ.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                       "VLLM_CACHE_ROOT": f"{root}/cache", "KVTRACE_ENABLED": str(int(variant == "wrapped")),
                       "KVTRACE_SINK": "spool", "KVTRACE_SPOOL_DIR": f"{root}/spool",
                       "KVTRACE_INSTANCE": "offload"})
    sys.path.insert(0, str(Path(__file__).parent))  # for the engine to import the spec by name
    from vllm import LLM
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import get_offloading_group_ids
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import SamplingParams

    from kvtrace.instrumentation.api import get_emitter
    from kvtrace.instrumentation.vllm.recipe import recipe_from_kv_cache_config

    model = Path(root).parent / "model"  # shared by the runs of one model
    if not model.exists():
        make_model(model, name)
    transfer = None
    if variant != "none":
        extra: dict[str, Any] = {"cpu_bytes_to_use": 16 << 20, "spec_name": "HostCopySpec",
                                 "spec_module_path": SPEC_MODULE}
        connector, module = "OffloadingConnector", None
        if variant == "wrapped":
            extra["kvtrace_inner"] = connector
            connector, module = "KvtraceConnectorHMA", "kvtrace.instrumentation.vllm.connector"
        transfer = KVTransferConfig(kv_connector=connector, kv_connector_module_path=module,
                                    kv_role="kv_both", kv_connector_extra_config=extra)
    llm = LLM(model=str(model), skip_tokenizer_init=True, enable_prefix_caching=True, block_size=32,
              enforce_eager=True, max_model_len=384, num_gpu_blocks_override=64, dtype="float32",
              kv_transfer_config=transfer)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out: dict[str, Any] = {}
    for label, prompt in (("a", PREFIX + [7] * 10), ("b", PREFIX + [9] * 10)):
        (r,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        out[label] = {"cached": r.num_cached_tokens, "tokens": list(r.outputs[0].token_ids)}
        assert llm.reset_prefix_cache()  # the device cache only: b must come back from the host
    if variant == "wrapped":
        get_emitter().force_flush(timeout_millis=30_000)
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        config = scheduler.kv_cache_manager.kv_cache_config
        out["recipe"] = json.loads(msgspec.json.encode(recipe_from_kv_cache_config(config)))
        # A block of a group spans its layers (the scheduler's config has one spec per group).
        out["bytes_per_block"] = [g.kv_cache_spec.page_size_bytes * len(g.layer_names)
                                  for g in config.kv_cache_groups]
        out["spec_groups"] = list(get_offloading_group_ids(config))  # the groups of a transfer spec, in order
        out["errors"] = [scheduler.connector.errors, scheduler._kvtrace_shim.errors]
        out["moved"] = importlib.import_module(SPEC_MODULE).MOVED
    print("RESULT " + json.dumps(out))


def run(root: Path, name: str, variant: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, str(root), name, variant], capture_output=True,
                          text=True, timeout=600)
    line = next((line for line in proc.stdout.splitlines() if line.startswith("RESULT ")), None)
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(line[7:])


def per_group(events: list[Event], kind: EventKind) -> dict[int, list[Event]]:
    out: dict[int, list[Event]] = {}
    for e in events:
        if e.kind is kind:
            out.setdefault(e.group_id, []).append(e)
    return out


def keys(events: list[Event]) -> list[int]:
    return [k for e in events for k in (e.block_key, *e.more_keys)]


def worker_totals(wrapped: dict[str, Any], store: bool) -> tuple[Counter[int], Counter[int]]:
    """Blocks and bytes the host worker moved per KV-cache group, in one direction."""
    blocks: Counter[int] = Counter()
    nbytes: Counter[int] = Counter()
    for job in wrapped["moved"]:
        if job["store"] is store:
            for group, n, b in zip(wrapped["spec_groups"], job["blocks"], job["bytes"], strict=True):
                blocks[group] += n
                nbytes[group] += b
    return +blocks, +nbytes


@pytest.mark.parametrize("name", list(MODELS))
def test_wrapped_offloading_connector_reports_every_group_and_changes_nothing(name: str,
                                                                              tmp_path: Path) -> None:
    none, plain, wrapped = (run(tmp_path / variant, name, variant) for variant in VARIANTS)
    for label in "ab":  # the shim changes nothing, and the reloaded KV is the KV recomputed
        assert none[label]["tokens"] == plain[label]["tokens"] == wrapped[label]["tokens"], label
    assert plain["b"]["cached"] == wrapped["b"]["cached"] == 256 and none["b"]["cached"] == 0
    assert wrapped["errors"] == [0, 0]

    recipe = msgspec.convert(wrapped["recipe"], Recipe)
    groups = recipe.groups
    if name == "gemma3":  # HMA kept the groups apart
        sliding, full = ComponentKind.SLIDING_WINDOW, ComponentKind.FULL_ATTENTION
        assert [g.component for g in groups] == [sliding] * 3 + [full]
    spool = tmp_path / "wrapped" / "spool"
    events = sorted((e for f in sorted(spool.iterdir()) for e in iter_file_events(f)),
                    key=lambda e: (e.ts_ns, e.source_id, e.seq))
    per_block = wrapped["bytes_per_block"]
    offloads, loads = per_group(events, EventKind.OFFLOAD), per_group(events, EventKind.LOAD)
    commits = per_group(events, EventKind.COMMIT)

    # Offloads: every group, as the worker moved it, keyed as the cache-manager shim keys its commits.
    stored_blocks, stored_bytes = worker_totals(wrapped, store=True)
    assert set(offloads) == set(stored_blocks) == {g.group_id for g in groups}
    for g in groups:
        runs = offloads[g.group_id]
        assert all((e.component, e.block_size, e.nbytes) == (g.component, g.block_size, per_block[g.group_id])
                   for e in runs)
        assert all((e.src_tier, e.dst_tier) == (Tier.DEVICE, Tier.HOST) for e in runs)
        assert len(keys(runs)) == stored_blocks[g.group_id]
        assert sum(e.nbytes * (1 + len(e.more_keys)) for e in runs) == stored_bytes[g.group_id] > 0
        assert set(keys(runs)) <= set(keys(commits[g.group_id]))
        assert all(e.token_end - e.token_start >= g.block_size * (1 + len(e.more_keys)) for e in runs)

    # Loads: b's, asynchronous, every group that moved, with what the worker moved into it.
    loaded_blocks, loaded_bytes = worker_totals(wrapped, store=False)
    assert set(loads) == set(loaded_blocks) == {g.group_id for g in groups}
    for g in groups:
        (load,) = loads[g.group_id]
        assert (load.src_tier, load.dst_tier, load.in_flight) == (Tier.HOST, Tier.DEVICE, True)
        assert load.duration_ns > 0 and load.request_id == loads[groups[0].group_id][0].request_id
        assert (load.component, load.nbytes) == (g.component, per_block[g.group_id])
        n = 1 + len(load.more_keys)
        assert n == loaded_blocks[g.group_id] and n * load.nbytes == loaded_bytes[g.group_id]
        assert set(keys([load])) <= set(keys(offloads[g.group_id]))
        assert load.token_end == 256 and load.token_end - load.token_start == n * g.block_size
        if g.component is ComponentKind.FULL_ATTENTION:
            assert load.token_start == 0 and n == 8
        else:  # a sliding window moves its window, not the prefix
            assert load.token_start > 0 and n < 8

    # The analysis: b could reuse all 256 tokens, from the host, and did.
    results = sorted((r for r in reconstruct(events, recipe) if r.adopt_seen), key=lambda r: r.seq)
    b = results[-1]
    assert b.adopted_tokens == b.recoverable_hit_tokens == 256 and b.resident_hit_tokens == 0
    assert not b.unsafe_reuse and b.restore_disk_bytes == b.restore_remote_bytes == 0
    assert b.restore_host_bytes == sum(per_block[g.group_id] * len(g.needed(256)) for g in groups) > 0


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2], sys.argv[3])
