"""Requests vLLM refuses: the pure checks, and the driver refusing them as vLLM does, on vLLM's
own KV-cache manager (what it admits is served without running out of blocks)."""

from __future__ import annotations

import random

import pytest

from kvtrace.instrumentation.refusals import Refusal, RefusalReason, RefusalTally, RequestRefused
from kvtrace.instrumentation.vllm.admission import CacheLimits, held_tokens, refusal, request_blocks, startup_problem
from kvtrace.instrumentation.vllm.driver import Driver, DriverConfig, Layout, build_manager, cache_limits


def limits(**kw: int) -> CacheLimits:
    return CacheLimits(**{"max_model_len": 4096, "block_size": 16, "num_blocks": 1024, "chunk_tokens": 256, **kw})


def test_prompt_checks_follow_the_input_processor() -> None:
    dense = limits()
    assert refusal(0, 4, dense) == Refusal(RefusalReason.EMPTY_PROMPT)
    assert refusal(1, 4, dense) is None
    assert refusal(4095, 4, dense) is None  # one output token fits; the rest is capped at max_model_len
    assert refusal(4096, 4, dense) == Refusal(RefusalReason.OVER_MAX_MODEL_LEN, 4096)  # no room for one output
    assert refusal(10_000, 4, dense) == Refusal(RefusalReason.OVER_MAX_MODEL_LEN, 4096)


def test_blocks_are_counted_per_group_as_vllm_admits() -> None:
    assert held_tokens(100, 4, 4096) == 103 and held_tokens(4095, 4, 4096) == 4095 and held_tokens(5, 0, 64) == 5
    assert request_blocks(103, limits()) == 7
    # a 64-token window with 256 tokens a step holds at most cdiv(63 + 256, 16) + 1 = 21 blocks
    assert request_blocks(103, limits(window=64)) == 7 + 7
    assert request_blocks(4000, limits(window=64)) == 250 + 21
    assert request_blocks(4000, limits(mamba=True)) == 250 + 2 and request_blocks(10, limits(mamba=True)) == 1 + 1


def test_larger_than_the_whole_cache() -> None:
    small = limits(num_blocks=65)  # 64 usable: 1,024 tokens of KV
    assert refusal(1021, 4, small) is None  # 1,024 tokens held at its peak
    assert refusal(1022, 4, small) == Refusal(RefusalReason.OVER_KV_CACHE, 64)
    assert refusal(1022, 1, small) is None  # fewer outputs, fewer blocks
    assert startup_problem(limits()) == ""
    problem = startup_problem(small)
    assert "max_model_len 4096 needs 256 blocks, the pool holds 64" in problem
    assert "estimated maximum model length is 1024" in problem


def test_tally_reports_counts_by_reason() -> None:
    tally = RefusalTally()
    assert tally.summary() == ""
    for r in (Refusal(RefusalReason.OVER_KV_CACHE, 255), Refusal(RefusalReason.OVER_MAX_MODEL_LEN, 4096),
              Refusal(RefusalReason.OVER_MAX_MODEL_LEN, 4096)):
        tally.add(r)
    assert tally.total == 3 and tally.count(RefusalReason.OVER_MAX_MODEL_LEN) == 2
    assert tally.summary() == ("refused 3 requests: 2 longer than max_model_len 4096, "
                               "1 larger than the whole cache (255 blocks)")


def _engine_admission_blocks(config: DriverConfig, tokens: int) -> int:
    """What vLLM's own admission gate counts for a fresh request of `tokens` tokens."""
    manager = build_manager(config)
    return manager.coordinator.get_num_blocks_to_allocate(
        request_id="probe", num_tokens=tokens, new_computed_blocks=manager.empty_kv_cache_blocks.blocks,
        num_encoder_tokens=0, total_computed_tokens=0, num_local_computed_tokens=0, num_tokens_main_model=tokens,
        apply_admission_cap=True, prefill_end=tokens)


@pytest.mark.parametrize("layout", list(Layout))
def test_block_count_is_vllms_admission_count(layout: Layout) -> None:
    config = DriverConfig(layout=layout, num_blocks=4096, max_model_len=8192, chunk_tokens=512)
    for tokens in (1, 15, 16, 17, 100, 575, 576, 577, 2000, 8191):
        ours, vllm = request_blocks(tokens, cache_limits(config)), _engine_admission_blocks(config, tokens)
        if layout is Layout.MAMBA:  # vLLM reserves a Mamba checkpoint block only where one is taken
            assert vllm <= ours <= vllm + 1, tokens
        else:
            assert ours == vllm, tokens


@pytest.mark.parametrize("layout", list(Layout))
def test_a_request_that_just_fits_is_served(layout: Layout) -> None:
    """On a pool of exactly the blocks the check counts, the request is served (no 'out of KV
    blocks'); one block less and it is refused before it touches the manager."""
    for prompt in (1, 16, 17, 255, 700, 1500, 2043, 2046, 2047):
        probe = DriverConfig(layout=layout, max_model_len=2048, chunk_tokens=256, window=64)
        need = request_blocks(held_tokens(prompt, probe.decode_tokens, 2048), cache_limits(probe))
        config = DriverConfig(layout=layout, max_model_len=2048, chunk_tokens=256, window=64, num_blocks=need + 1)
        driver = Driver(build_manager(config), config)
        served = driver.serve(f"r{prompt}", list(range(100, 100 + prompt)))
        assert served.prompt_tokens == prompt
        assert driver.manager.block_pool.get_num_free_blocks() == need  # all back: nothing held

        tight = DriverConfig(layout=layout, max_model_len=2048, chunk_tokens=256, window=64, num_blocks=need)
        with pytest.raises(RequestRefused) as refused:
            Driver(build_manager(tight), tight).serve("r", list(range(100, 100 + prompt)))
        assert refused.value.refusal == Refusal(RefusalReason.OVER_KV_CACHE, need - 1)


@pytest.mark.parametrize("layout", list(Layout))
def test_admitted_requests_never_run_out_on_a_warm_cache(layout: Layout) -> None:
    """Requests with shared prefixes (hits), some too long or too large, on a small pool: each is
    refused by the check or served to the end, and a refused one leaves vLLM's counters alone."""
    rng = random.Random(7)
    config = DriverConfig(layout=layout, num_blocks=50, max_model_len=1024, chunk_tokens=128, window=32)
    driver = Driver(build_manager(config), config)
    prefixes = [[rng.randrange(100, 30_000) for _ in range(rng.randrange(1, 600))] for _ in range(5)]
    served, tally = 0, RefusalTally()
    for i in range(120):
        tokens = rng.choice(prefixes) + [rng.randrange(100, 30_000) for _ in range(rng.randrange(0, 900))]
        try:
            driver.serve(f"r{i}", tokens)
            served += 1
        except RequestRefused as exc:
            assert exc.refusal == driver.check(len(tokens))
            tally.add(exc.refusal)
    assert served + tally.total == 120 and served > 30
    assert tally.count(RefusalReason.OVER_MAX_MODEL_LEN) > 0 and tally.count(RefusalReason.OVER_KV_CACHE) > 0
    stats = driver.stats()
    assert stats.requests == served


def test_decode_stops_at_max_model_len() -> None:
    """A prompt one token short of max_model_len is served: its one output token ends it, as
    vLLM's scheduler caps a request at max_model_len."""
    for layout in Layout:
        config = DriverConfig(layout=layout, num_blocks=512, max_model_len=1024, decode_tokens=8)
        driver = Driver(build_manager(config), config)
        for prompt in (1016, 1020, 1023):
            assert driver.serve(f"r{prompt}", list(range(100, 100 + prompt))).prompt_tokens == prompt
        assert driver.stats().requests == 3
