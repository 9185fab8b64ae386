"""Which requests SGLang refuses, as pure functions of its limits (no SGLang import).

What SGLang 0.5.23 does, read in its source (without --allow-auto-truncate, off by default;
with it SGLang truncates the prompt instead):

- Its tokenizer manager (`TokenizerManager._validate_one_request`, srt/managers/
  tokenizer_manager.py) raises for a prompt of the context length or more ("The input (N
  tokens) is longer than the model's context length"), and for a prompt plus max_new_tokens
  over it. The request never reaches the scheduler: nothing touches the cache.
- Its scheduler (`validate_input_length`, srt/managers/utils.py) aborts a prompt of
  `max_req_input_len` tokens or more: min(context length - 1, KV pool tokens - 1) - 5
  (`TpModelWorker.get_worker_info`, srt/managers/tp_worker.py). The abort
  (`Req.set_finish_with_abort`, srt/managers/schedule_batch.py) logs an error, replaces the
  prompt with the single token 0 "to skip the long prefill" and queues the request: that
  one-token stub is matched, prefilled, released into the tree and finished as aborted like
  any request, so a traced SGLang records its lookup.
- At start-up it warns when the KV pool holds fewer tokens than the context length.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtrace.instrumentation.refusals import Refusal, RefusalReason

ABORT_STUB = (0,)  # the prompt SGLang's scheduler gives an aborted request


@dataclass(frozen=True, slots=True)
class InputLimits:
    context_len: int  # the model's context length
    pool_tokens: int  # the device KV pool, in tokens (whole pages)

    @property
    def max_req_input_len(self) -> int:
        """The scheduler's input limit: a prompt this long or longer is aborted."""
        return min(self.context_len - 1, self.pool_tokens - 1) - 5


def refusal(prompt_tokens: int, max_new_tokens: int | None, limits: InputLimits) -> Refusal | None:
    """Why SGLang would not serve this request, or None when it would. OVER_CONTEXT_LEN is its
    tokenizer manager's refusal; OVER_INPUT_LIMIT its scheduler's abort (the stub runs)."""
    over_total = max_new_tokens is not None and prompt_tokens + max_new_tokens > limits.context_len
    if prompt_tokens >= limits.context_len or over_total:
        return Refusal(RefusalReason.OVER_CONTEXT_LEN, limits.context_len)
    if prompt_tokens >= limits.max_req_input_len:
        return Refusal(RefusalReason.OVER_INPUT_LIMIT, limits.max_req_input_len)
    return None


def startup_warning(limits: InputLimits) -> str:
    """SGLang's start-up warning for a pool smaller than the context length, or ''."""
    if limits.pool_tokens >= limits.context_len:
        return ""
    return (f"KV pool holds {limits.pool_tokens} tokens, fewer than the context length {limits.context_len}: "
            f"SGLang refuses prompts of {limits.max_req_input_len} tokens or more")
