"""Two of vLLM's own KV-cache managers behind a round-robin router: kvtrace's fleet view against
what the other manager's own prefix lookup says.

Before each request is served where the router sends it, the other manager is asked, by vLLM's
own hit search (`find_longest_cache_hit`, what `get_computed_blocks` runs, with no side effect),
how much of the request it could have resumed at that moment. kvtrace, from the two managers'
events alone, must find the same: recoverable anywhere is the longer of the two managers' hits,
the best instance is the one holding it, and the routing regret is what the other one had more.

Runs in the vLLM venv: `.venvs/vllm/bin/python -m pytest -o addopts=-ra tests/engines/vllm`.
"""

from __future__ import annotations

from importlib import resources

import pytest

from kvtrace.analysis.evaluate import Policy
from kvtrace.analysis.reconstruct import reconstruct
from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.replay import tokens_of
from kvtrace.instrumentation.sinks.memory import MemorySink
from kvtrace.instrumentation.traces import read_trace
from kvtrace.instrumentation.vllm.driver import Driver, DriverConfig, Layout, build_manager
from kvtrace.instrumentation.vllm.recipe import recipe_from_kv_cache_config
from kvtrace.instrumentation.vllm.shim import CacheManagerShim, Identity

TRACE = resources.files("kvtrace.cli") / "data" / "mooncake_conversation_head.jsonl.gz"
NAMES = ("vllm-a", "vllm-b")


@pytest.mark.parametrize("layout", list(Layout))
def test_recoverable_anywhere_is_what_the_other_manager_s_own_lookup_finds(layout: Layout) -> None:
    # Fewer blocks than the trace needs, so each manager evicts and the two hold different prefixes.
    config = DriverConfig(layout=layout, num_blocks=6144)
    sinks, emitters, drivers, shims = [], [], [], []
    for name in NAMES:
        manager = build_manager(config)
        sink = MemorySink()
        emitter = BatchEmitter(sink, BatchConfig(max_queue_size=1 << 20), register_atexit=False)
        shims.append(CacheManagerShim(manager, emitter, Identity(instance=name, model="tiny")).install())
        sinks.append(sink)
        emitters.append(emitter)
        drivers.append(Driver(manager, config))
    # Each conversation's first turn, round robin, then at once its next turn (the same prompt and
    # more) on the other manager, which holds less of it than the one that served the first.
    first = [(r.request_id, tokens_of(r)) for r in read_trace(str(TRACE), limit=30)]
    turns = []
    for i, (rid, tokens) in enumerate(first):
        turns += [(i % 2, rid, tokens), (1 - i % 2, f"{rid}-next", [*tokens, *range(7, 7 + 40)])]
    expected = {}  # request id -> (sent to, its own hit, the other manager's hit then)
    for to, rid, tokens in turns:
        here, other = drivers[to], drivers[1 - to]
        probe = other.request(rid, tokens)
        elsewhere = int(other.manager.coordinator.find_longest_cache_hit(probe.block_hashes, probe.num_tokens - 1)[1])
        served = here.serve(rid, tokens)
        expected[rid] = (NAMES[to], served.hit_tokens, elsewhere)
    for emitter, shim in zip(emitters, shims, strict=True):
        assert emitter.shutdown() and shim.errors == 0 and emitter.stats().dropped == 0
    events = sorted((e for s in sinks for e in s.events), key=lambda e: (e.ts_ns, e.source_id, e.seq))
    recipe = recipe_from_kv_cache_config(drivers[0].manager.kv_cache_config)

    rows = [r for r in reconstruct(events, recipe, Policy(fleet=True)) if r.adopt_seen]
    assert sorted(r.request_id for r in rows) == sorted(expected)
    regretted = 0
    for row in rows:
        sent, hit, elsewhere = expected[row.request_id]
        other = NAMES[1 - NAMES.index(sent)]
        assert row.instance == sent and row.recoverable_hit_tokens == hit, row
        assert row.recoverable_anywhere_tokens == max(hit, elsewhere), (row, elsewhere)
        assert row.best_instance == ("" if not max(hit, elsewhere) else sent if hit >= elsewhere else other), row
        assert row.routing_regret_tokens == max(elsewhere - hit, 0), row
        assert row.seen_anywhere_tokens >= row.recoverable_anywhere_tokens >= row.recoverable_hit_tokens
        regretted += row.routing_regret_tokens > 0
    # The next turns found their first turn's prefix on the other manager.
    assert regretted == len(first)  # every next turn, on every layout
