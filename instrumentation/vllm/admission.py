"""Which requests vLLM refuses, as pure functions of the cache's shape (no vLLM import).

What vLLM 0.32 does, read in its source:

- Its input processor (`InputProcessor._validate_prompt_len`, v1/engine/input_processor.py)
  refuses an empty prompt, a prompt longer than max_model_len and, for a generating model, a
  prompt of exactly max_model_len ("plus the number of requested output tokens (at least 1)").
  It checks the prompt alone: a larger max_tokens is not refused but clamped (the OpenAI
  server's `get_max_tokens`), and the scheduler stops a request at max_model_len
  (`check_stop`, v1/core/sched/utils.py: FINISHED_LENGTH_CAPPED).
- Its scheduler admits a waiting request only when all of it fits the free blocks
  (`KVCacheManager.allocate_slots` with `full_sequence_must_fit`, on by default), counting each
  group's blocks with the per-request bound its start-up check also uses
  (`SlidingWindowSpec.max_admission_blocks_per_request`, `MambaSpec.max_memory_usage_bytes`).
  A request needing more blocks than the whole pool would wait forever, which vLLM prevents at
  start-up instead: it refuses to start when one max_model_len request does not fit
  (`_check_enough_kv_cache_memory`, v1/core/kv_cache_utils.py). A replay may build a smaller
  cache than vLLM would accept, so it refuses such a request and says so at start.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtrace.instrumentation.refusals import Refusal, RefusalReason


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class CacheLimits:
    """What vLLM's checks depend on: max_model_len and the block pool with its groups."""

    max_model_len: int
    block_size: int
    num_blocks: int  # the pool, with the null block vLLM holds back
    chunk_tokens: int  # tokens scheduled per step: a sliding window's blocks in flight
    window: int = 0  # a sliding-window group's window, 0 when there is none
    mamba: bool = False  # a Mamba group ("align" state caching, no speculative blocks)

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1


def request_blocks(tokens: int, limits: CacheLimits) -> int:
    """Blocks one request holding KV for `tokens` tokens takes at most, over all groups, as vLLM
    counts them to admit it: every full-attention block; a sliding window's in-flight span
    (window - 1 plus a step's tokens, one block more for its unaligned start); two Mamba states."""
    b = limits.block_size
    full = _cdiv(tokens, b)
    blocks = full
    if limits.window:
        span = min(limits.window - 1 + limits.chunk_tokens, limits.max_model_len)
        blocks += min(full, _cdiv(span, b) + 1)
    if limits.mamba:
        blocks += min(full, 2)
    return blocks


def held_tokens(prompt_tokens: int, decode_tokens: int, max_model_len: int) -> int:
    """Tokens whose KV a request holds at its peak: its prompt and all outputs but the last,
    stopped at max_model_len as vLLM's scheduler stops it."""
    return min(prompt_tokens + max(decode_tokens, 1) - 1, max_model_len - 1)


def refusal(prompt_tokens: int, decode_tokens: int, limits: CacheLimits) -> Refusal | None:
    """Why vLLM would not serve this request, or None when it would."""
    if prompt_tokens == 0:
        return Refusal(RefusalReason.EMPTY_PROMPT)
    if prompt_tokens >= limits.max_model_len:
        return Refusal(RefusalReason.OVER_MAX_MODEL_LEN, limits.max_model_len)
    if request_blocks(held_tokens(prompt_tokens, decode_tokens, limits.max_model_len), limits) > limits.usable_blocks:
        return Refusal(RefusalReason.OVER_KV_CACHE, limits.usable_blocks)
    return None


def startup_problem(limits: CacheLimits) -> str:
    """vLLM's start-up check: '' when one max_model_len request fits the pool, else what vLLM says."""
    need = request_blocks(limits.max_model_len, limits)
    if need <= limits.usable_blocks:
        return ""
    fits = 0
    lo, hi = 1, limits.max_model_len
    while lo <= hi:  # the longest request that fits, as vLLM estimates it
        mid = (lo + hi) // 2
        if request_blocks(mid, limits) <= limits.usable_blocks:
            fits, lo = mid, mid + 1
        else:
            hi = mid - 1
    return (f"vLLM would not start with this cache: one request of max_model_len {limits.max_model_len} needs "
            f"{need} blocks, the pool holds {limits.usable_blocks} (the estimated maximum model length is {fits})")
