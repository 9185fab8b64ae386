"""Drive vLLM's own v1 KV-cache manager with no model, the way its scheduler does.

This is how a trace is replayed through the real vLLM cache logic (hashing, hit search and
reconciliation across groups, caching, LRU eviction, sparse retention of window and Mamba
state) in seconds, without weights or a forward pass. One request at a time, synchronous steps:
`new_step_starts` -> `get_computed_blocks` -> `allocate_slots` (the hit plus the first chunk)
-> `record_prefix_cache_stats` -> more chunks -> decode (stopped at max_model_len) -> `free`.

A request vLLM would refuse (an empty prompt, one with no room for an output token under
max_model_len, one larger than the whole cache: see `admission`) raises `RequestRefused`
before it touches the manager, as vLLM's input processor raises before the engine sees it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
    get_mamba_prefill_checkpoint_position,
)
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from kvtrace.instrumentation.refusals import Refusal, RequestRefused  # noqa: E402
from kvtrace.instrumentation.vllm.admission import CacheLimits, refusal  # noqa: E402

HASH_ALGO = "sha256"  # vLLM's default prefix_caching_hash_algo: same hashes in every process


class Layout(StrEnum):
    """The cache-group layouts the replay builds (vLLM chooses groups from the model)."""

    DENSE = "dense"
    SLIDING = "full+sliding"
    MAMBA = "full+mamba"


@dataclass(frozen=True, slots=True)
class DriverConfig:
    layout: Layout = Layout.DENSE
    block_size: int = 16
    window: int = 64
    num_blocks: int = 1024
    max_model_len: int = 1 << 17
    chunk_tokens: int = 2048  # prefill budget per step
    decode_tokens: int = 4
    retention_interval: int | None = 0  # vLLM's engine default: sparse window / Mamba checkpoints


@dataclass(frozen=True, slots=True)
class Served:
    request_id: str
    prompt_tokens: int
    hit_tokens: int  # reconciled hit the manager returned (and the scheduler counted)
    group_hits: tuple[int, ...]  # each group's own hit, before reconciliation


_HASH_FN = get_hash_fn_by_name(HASH_ALGO)
init_none_hash(_HASH_FN)


def build_manager(config: DriverConfig, enable_kv_cache_events: bool = False) -> KVCacheManager:
    b = config.block_size
    full = FullAttentionSpec(block_size=b, num_kv_heads=2, head_size=32, dtype=torch.float16)
    groups = [KVCacheGroupSpec(["layers.0.attn"], full)]
    if config.layout is Layout.SLIDING:
        groups.append(KVCacheGroupSpec(["layers.1.attn"], SlidingWindowSpec(
            block_size=b, num_kv_heads=2, head_size=32, dtype=torch.float16, sliding_window=config.window)))
    elif config.layout is Layout.MAMBA:
        groups.append(KVCacheGroupSpec(["layers.1.mixer"], MambaSpec(
            block_size=b, shapes=((4, 8), (2, 16, 8)), dtypes=(torch.float16, torch.float32),
            mamba_cache_mode="align")))
    kv_config = KVCacheConfig(num_blocks=config.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups,
                              prefix_cache_retention_interval=config.retention_interval)
    # max_in_flight_tokens as vLLM's engine passes it: one step's tokens in flight
    return KVCacheManager(kv_cache_config=kv_config, max_model_len=config.max_model_len, scheduler_block_size=b,
                          hash_block_size=b, enable_caching=True, log_stats=True,
                          enable_kv_cache_events=enable_kv_cache_events, max_in_flight_tokens=config.chunk_tokens)


def cache_limits(config: DriverConfig) -> CacheLimits:
    """What vLLM checks requests against, for the manager `build_manager(config)` builds."""
    return CacheLimits(max_model_len=config.max_model_len, block_size=config.block_size, num_blocks=config.num_blocks,
                       chunk_tokens=config.chunk_tokens, window=config.window if config.layout is Layout.SLIDING else 0,
                       mamba=config.layout is Layout.MAMBA)


class Driver:
    """Serves token-id requests on one manager, one at a time."""

    def __init__(self, manager: KVCacheManager, config: DriverConfig) -> None:
        self.manager = manager
        self.config = config
        self.limits = cache_limits(config)
        self._hasher = get_request_block_hasher(config.block_size, _HASH_FN)

    def check(self, prompt_tokens: int) -> Refusal | None:
        """Why vLLM would refuse a prompt this long, or None."""
        return refusal(prompt_tokens, self.config.decode_tokens, self.limits)

    def request(self, request_id: str, tokens: Sequence[int], cache_salt: str | None = None) -> Request:
        return Request(request_id=request_id, prompt_token_ids=list(tokens),
                       sampling_params=SamplingParams(max_tokens=self.config.decode_tokens), pooling_params=None,
                       cache_salt=cache_salt, block_hasher=self._hasher)

    def _group_hits(self, req: Request, hit: int) -> tuple[int, ...]:
        coordinator = self.manager.coordinator
        if hasattr(coordinator, "find_longest_cache_hit_per_group"):
            _, per_group = coordinator.find_longest_cache_hit_per_group(req.block_hashes, req.num_tokens - 1)
            return tuple(int(h) for h in per_group)
        return (hit,)

    def serve(self, request_id: str, tokens: Sequence[int], cache_salt: str | None = None) -> Served:
        """Serve one request, or raise `RequestRefused` where vLLM would refuse it."""
        refused = self.check(len(tokens))
        if refused is not None:
            raise RequestRefused(request_id, len(tokens), refused)
        mgr, cfg = self.manager, self.config
        req = self.request(request_id, tokens, cache_salt)
        mgr.new_step_starts()
        group_hits = self._group_hits(req, 0)
        blocks, hit, junction = mgr.get_computed_blocks(req)
        if len(group_hits) == 1:
            group_hits = (hit,)
        req.shared_prefix_boundary = junction
        first = True
        while req.num_computed_tokens < req.num_tokens:
            start = req.num_computed_tokens + (hit if first else 0)
            n_new = min(cfg.chunk_tokens, req.num_tokens - start)
            if cfg.layout is Layout.MAMBA:
                n_new = self._mamba_split(req, start, n_new)
            if first:
                out = mgr.allocate_slots(req, n_new, num_new_computed_tokens=hit, new_computed_blocks=blocks)
            else:
                out = mgr.allocate_slots(req, n_new)
            if out is None:
                raise RuntimeError(f"{request_id}: out of KV blocks ({cfg.num_blocks}); raise DriverConfig.num_blocks")
            if first:
                mgr.record_prefix_cache_stats(req, hit)
                req.status = RequestStatus.RUNNING
                first = False
            req.num_computed_tokens = start + n_new
            mgr.new_step_starts()
        for i in range(cfg.decode_tokens):
            req.append_output_token_ids(7 + i)
            if req.num_tokens >= cfg.max_model_len:  # vLLM's check_stop: capped at max_model_len
                break
            if i + 1 < cfg.decode_tokens:
                if mgr.allocate_slots(req, 1) is None:
                    raise RuntimeError(f"{request_id}: out of KV blocks while decoding")
                req.num_computed_tokens += 1
                mgr.new_step_starts()
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        mgr.free(req)
        return Served(request_id, len(tokens), int(hit), group_hits)

    def _mamba_split(self, req: Request, start: int, n_new: int) -> int:
        """Chunk ends on block boundaries, the last cacheable one and the shared-prefix junction,
        as vLLM's scheduler splits prefill for Mamba state caching (no speculative decoding)."""
        b = self.config.block_size
        end = start + n_new
        prefill_end = max(req.num_prompt_tokens, req.num_tokens - 1)
        if start >= prefill_end:
            return n_new
        if end < prefill_end:
            end = max(end // b * b, start)
        stops = [get_mamba_prefill_checkpoint_position(req.num_tokens, b, False)]
        if start % b:
            stops.append((start // b + 1) * b)
        junction = req.shared_prefix_boundary
        if start < junction < end:
            stops.append(start + (junction - start) // b * b)
        end = min((s for s in stops if start < s < end), default=end)
        return end - start

    def stats(self) -> Any:
        """vLLM's PrefixCacheStats since the last call (reading resets them, as in vLLM)."""
        return self.manager.make_prefix_cache_stats()
