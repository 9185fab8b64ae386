"""Requests an engine refuses instead of serving, and the tally a replay keeps of them.

A serving engine checks a request before it reaches the KV cache: vLLM's input processor refuses
a prompt with no room for an output token under max_model_len, SGLang's tokenizer manager one
that reaches the context length and its scheduler one over its input limit. A replay driver
makes the same checks (each engine's are pure functions in its `admission` module) and raises
`RequestRefused` where the engine would refuse; the replay counts it by reason and goes on.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum


class RefusalReason(StrEnum):
    """Why an engine refused a request; the value reads before the limit it broke."""

    EMPTY_PROMPT = "with an empty prompt"  # vLLM: "The decoder prompt cannot be empty"
    OVER_MAX_MODEL_LEN = "longer than max_model_len"  # vLLM: no room for one output token
    OVER_KV_CACHE = "larger than the whole cache"  # vLLM: more blocks than the pool holds
    OVER_CONTEXT_LEN = "longer than the context length"  # SGLang's tokenizer manager
    OVER_INPUT_LIMIT = "over the scheduler's input limit"  # SGLang's scheduler: aborted


_UNITS = {RefusalReason.OVER_KV_CACHE: "blocks"}


@dataclass(frozen=True, slots=True)
class Refusal:
    """A reason and the limit the request broke (tokens; blocks for the whole cache)."""

    reason: RefusalReason
    limit: int = 0

    def describe(self) -> str:
        if self.reason is RefusalReason.EMPTY_PROMPT:
            return self.reason.value
        unit = _UNITS.get(self.reason)
        return f"{self.reason.value} ({self.limit} {unit})" if unit else f"{self.reason.value} {self.limit}"


class RequestRefused(ValueError):
    """Raised by a driver for a request its engine would refuse; nothing of it reached the cache
    unless the engine itself runs something for it (SGLang's scheduler aborts do)."""

    def __init__(self, request_id: str, prompt_tokens: int, refusal: Refusal) -> None:
        super().__init__(f"{request_id}: {prompt_tokens}-token prompt refused, {refusal.describe()}")
        self.request_id, self.prompt_tokens, self.refusal = request_id, prompt_tokens, refusal


@dataclass(slots=True)
class RefusalTally:
    """Refused requests by reason (and limit), for a replay's report."""

    counts: Counter[Refusal] = field(default_factory=Counter)

    def add(self, refusal: Refusal) -> None:
        self.counts[refusal] += 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def count(self, reason: RefusalReason) -> int:
        return sum(n for r, n in self.counts.items() if r.reason is reason)

    def summary(self) -> str:
        """'refused 3 requests: 2 longer than max_model_len 4096, 1 larger than the whole cache
        (255 blocks)', reasons in the order of `RefusalReason`; '' when none was refused."""
        if not self.counts:
            return ""
        order = list(RefusalReason)
        ranked = sorted(self.counts.items(), key=lambda item: (order.index(item[0].reason), item[0].limit))
        parts = [f"{n} {r.describe()}" for r, n in ranked]
        total = self.total
        return f"refused {total} request{'' if total == 1 else 's'}: {', '.join(parts)}"
