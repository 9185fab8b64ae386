"""Re-execute requests on a vLLM engine with and without its prefix cache (`kvtrace verify`).

For each prompt, two requests go to the same engine, one after the other:
- the *cached* run: the prompt as users send it, free to reuse the prefix cache. It is an
  ordinary request, so the shim traces it and the analysis gives it a verdict;
- the *fresh* run: the same prompt with the prefix cache bypassed
  (`skip_reading_prefix_cache`) and under its own `cache_salt`, so the blocks it writes never
  mix with users' blocks.
Both decode greedily and return the log-probabilities of the prompt tokens and of the first
generated ones. vLLM gives no prompt log-probabilities for the positions it served from cache
(the values there are not computed), so the comparison starts after the cached run's hit.
The noise floor comes from the same prompts computed fresh twice.

The measure is `kvtrace.schema.divergence` and the judgement `kvtrace.analysis.oracle`; this
module only talks to the engine.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtrace.schema.divergence import Scores

VERIFY_SALT = "kvtrace-verify"
"""The namespace of fresh runs: their blocks (and verdicts, as tenant) stay apart from users'."""


@dataclass(frozen=True, slots=True)
class Pair:
    request_id: str  # the cached run's request id, as vLLM's output names it
    cached_tokens: int  # what the cached run reused (vLLM's own count)
    cached: Scores
    fresh: Scores
    fresh_seconds: float  # what the check cost


def _params(n_gen: int, k: int, fresh: bool) -> Any:
    from vllm.sampling_params import SamplingParams

    # Explicit: vLLM skips the cache for any request asking prompt log-probabilities unless told not to.
    return SamplingParams(max_tokens=n_gen, temperature=0.0, ignore_eos=True, logprobs=k, prompt_logprobs=k,
                          skip_reading_prefix_cache=fresh)


def _run(llm: Any, prompt: Sequence[int], fresh: bool, n_gen: int, k: int, salt: str, lora: Any = None) -> Any:
    from vllm.inputs import TokensPrompt

    request = TokensPrompt(prompt_token_ids=list(prompt), cache_salt=salt) if fresh else \
        TokensPrompt(prompt_token_ids=list(prompt))
    (out,) = llm.generate([request], _params(n_gen, k, fresh), use_tqdm=False, lora_request=lora)
    return out


def serve_prompt(llm: Any, prompt: Sequence[int], n_gen: int = 4, lora: Any = None) -> Any:
    """One ordinary request (greedy, no log-probabilities): traffic whose verdicts get checked."""
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import SamplingParams

    (out,) = llm.generate([TokensPrompt(prompt_token_ids=list(prompt))],
                          SamplingParams(max_tokens=n_gen, temperature=0.0, ignore_eos=True), use_tqdm=False,
                          lora_request=lora)
    return out


def scores_from(prompt: Sequence[int], prompt_row: Callable[[int], dict[int, float]], generated: Sequence[int],
                generated_rows: Sequence[dict[int, float]], start: int) -> Scores:
    """Log-probabilities of prompt positions [start, len) (`prompt_row(j)`: the top-k that scored
    prompt token j) and of the generated tokens; a position with no row gets NaN and no top-k."""
    tokens: list[int] = []
    chosen: list[float] = []
    top: list[dict[int, float]] = []

    def add(token: int, row: dict[int, float]) -> None:
        tokens.append(int(token))
        chosen.append(row.get(token, math.nan))
        top.append(row)

    for j in range(max(start, 1), len(prompt)):
        add(prompt[j], prompt_row(j))
    for i, token in enumerate(generated):
        add(token, generated_rows[i] if i < len(generated_rows) else {})
    return Scores(tuple(tokens), tuple(chosen), tuple(top), generated=len(generated))


def scores_of(output: Any, start: int) -> Scores:
    """Log-probabilities of prompt positions [start, len) and of the generated tokens."""
    table = output.prompt_logprobs or []

    def floats(ranked: Any) -> dict[int, float]:
        return {int(t): float(lp.logprob) for t, lp in (ranked or {}).items()}

    generated = output.outputs[0]
    return scores_from(list(output.prompt_token_ids), lambda j: floats(table[j] if j < len(table) else None),
                       list(generated.token_ids), [floats(r) for r in generated.logprobs or []], start)


def verify_prompts(llm: Any, prompts: Sequence[Sequence[int]], n_gen: int = 4, k: int = 5,
                   salt: str = VERIFY_SALT, lora: Any = None) -> list[Pair]:
    """One cached and one fresh run per prompt (with the same adapter, if any), compared from
    just after the cached run's hit."""
    pairs = []
    for prompt in prompts:
        cached = _run(llm, prompt, False, n_gen, k, salt, lora)
        started = time.perf_counter()
        fresh = _run(llm, prompt, True, n_gen, k, salt, lora)
        seconds = time.perf_counter() - started
        start = int(cached.num_cached_tokens or 0) + 1
        pairs.append(Pair(str(cached.request_id), int(cached.num_cached_tokens or 0), scores_of(cached, start),
                          scores_of(fresh, start), seconds))
    return pairs


def noise_pairs(llm: Any, prompts: Sequence[Sequence[int]], n_gen: int = 4, k: int = 5,
                salt: str = VERIFY_SALT, lora: Any = None) -> list[tuple[Scores, Scores]]:
    """The same prompts computed fresh twice: what kernels and batching alone change."""
    out = []
    for prompt in prompts:
        a, b = (_run(llm, prompt, True, n_gen, k, salt, lora) for _ in range(2))
        out.append((scores_of(a, 1), scores_of(b, 1)))
    return out
