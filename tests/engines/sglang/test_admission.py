"""Requests SGLang refuses: the pure checks, and the driver refusing them as SGLang does on its own
radix cache (the tokenizer manager's refusal touches nothing; the scheduler's abort runs the
one-token stub SGLang puts in the request's place)."""

from __future__ import annotations

import pytest

from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.identity import Identity
from kvtrace.instrumentation.refusals import Refusal, RefusalReason, RefusalTally, RequestRefused
from kvtrace.instrumentation.sglang.admission import InputLimits, refusal, startup_warning
from kvtrace.instrumentation.sglang.driver import Driver, DriverConfig, Mix, Route, build_cache
from kvtrace.instrumentation.sglang.shim import RadixCacheShim
from kvtrace.instrumentation.sinks.memory import MemorySink
from kvtrace.schema import EventKind

CONTEXT = Refusal(RefusalReason.OVER_CONTEXT_LEN, 2048)


def test_the_tokenizer_manager_and_the_scheduler_limits() -> None:
    roomy = InputLimits(context_len=2048, pool_tokens=1 << 16)
    assert roomy.max_req_input_len == 2042  # min(context - 1, pool - 1) - 5
    assert refusal(2041, 1, roomy) is None
    assert refusal(2042, 1, roomy) == Refusal(RefusalReason.OVER_INPUT_LIMIT, 2042)  # aborted by the scheduler
    assert refusal(2047, 1, roomy) == Refusal(RefusalReason.OVER_INPUT_LIMIT, 2042)
    assert refusal(2048, 1, roomy) == CONTEXT  # refused before the scheduler
    assert refusal(2000, 100, roomy) == CONTEXT  # prompt plus max_new_tokens over the context length
    assert refusal(2000, None, roomy) is None
    assert startup_warning(roomy) == ""

    small = InputLimits(context_len=2048, pool_tokens=1024)
    assert small.max_req_input_len == 1018
    assert refusal(1017, 1, small) is None and refusal(1018, 1, small) == Refusal(RefusalReason.OVER_INPUT_LIMIT, 1018)
    assert "KV pool holds 1024 tokens, fewer than the context length 2048" in startup_warning(small)


def _shimmed(config: DriverConfig):  # noqa: ANN202
    cache, allocator, pool = build_cache(config)
    sink = MemorySink()
    emitter = BatchEmitter(sink, BatchConfig(), register_atexit=False)
    shim = RadixCacheShim(cache, emitter, Identity(instance="sglang-0")).install()
    return sink, emitter, shim, Driver(cache, allocator, pool, config, shim)


def _serve_all(driver: Driver, prompts: dict[str, int]) -> tuple[dict, RefusalTally]:
    served, tally = {}, RefusalTally()
    for i, (rid, n) in enumerate(prompts.items()):
        try:
            served[rid] = driver.serve(rid, [1000 * i + 100 + t for t in range(n)] if rid.startswith("x")
                                       else list(range(100, 100 + n)))
        except RequestRefused as exc:
            tally.add(exc.refusal)
    return served, tally


PROMPTS = {"a": 300, "x-abort": 1018, "b": 1017, "x-abort-2": 1500, "x-front": 2048, "x-front-2": 9000, "c": 300}


@pytest.mark.parametrize(("mix", "route", "page"), [
    (Mix.FULL, Route.CACHE, 16), (Mix.SWA, Route.CACHE, 16), (Mix.MAMBA, Route.CACHE, 1),
    (Mix.FULL, Route.SCHEDULER, 16), (Mix.FULL, Route.SCHEDULER, 1)])
def test_the_driver_refuses_as_sglang_does(mix: Mix, route: Route, page: int) -> None:
    """A 1,024-slot pool under a 2,048-token context: the replay goes on past every refusal, the
    front end's leave no event, each abort leaves the stub's one-token lookup and nothing else
    of the request, and the requests served see the cache they would see without the refused."""
    config = DriverConfig(mix=mix, route=route, page_size=page, kv_tokens=1024, context_len=2048)
    sink, emitter, shim, driver = _shimmed(config)
    served, tally = _serve_all(driver, PROMPTS)
    assert emitter.shutdown() and shim.errors == 0
    assert sorted(served) == ["a", "b", "c"]
    assert tally.count(RefusalReason.OVER_CONTEXT_LEN) == 2 and tally.count(RefusalReason.OVER_INPUT_LIMIT) == 2
    lookups = [(e.request_id, e.prompt_tokens) for e in sink.events if e.kind is EventKind.LOOKUP]
    assert lookups == [("a", 300), ("x-abort", 1), ("b", 1017), ("x-abort-2", 1), ("c", 300)]
    assert not {e.request_id for e in sink.events} & {"x-front", "x-front-2"}

    _, kept_emitter, _, kept = _shimmed(config)
    kept_served, _ = _serve_all(kept, {k: v for k, v in PROMPTS.items() if not k.startswith("x")})
    assert kept_emitter.shutdown()
    assert kept_served == served


def test_the_abort_stub_holds_no_slot_after_it() -> None:
    config = DriverConfig(page_size=16, kv_tokens=1024, context_len=2048)
    _, emitter, _, driver = _shimmed(config)
    free = driver.allocator.available_size()
    with pytest.raises(RequestRefused) as refused:
        driver.serve("long", list(range(100, 1200)))
    assert refused.value.refusal == Refusal(RefusalReason.OVER_INPUT_LIMIT, 1018)
    assert driver.allocator.available_size() == free
    assert emitter.shutdown()
