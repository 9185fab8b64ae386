"""One recipe book decides which recipe judges each lookup, in every path that asks."""

from __future__ import annotations

import polars as pl
import pytest

from kvtrace.analysis.planning import capacity_report
from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.simulator import CacheSimulator, SimConfig, SimRequest
from kvtrace.instrumentation.sinks.memory import MemorySink
from kvtrace.schema.arrow import to_arrow
from kvtrace.schema.recipes import BUILTIN, RecipeBook, RecipeError, UnknownModel, dense

HYBRID = BUILTIN["mamba-hybrid"]
CHUNKS = dense(256)


def test_engine_model_then_model_then_the_default() -> None:
    book = RecipeBook({"llama": HYBRID, "lmcache:llama": CHUNKS}, default=BUILTIN["dense"])
    assert book.resolve("llama", "lmcache") is CHUNKS and book.key("llama", "lmcache") == "lmcache:llama"
    assert book.resolve("llama", "vllm") is HYBRID and book.key("llama", "vllm") == "llama"
    assert book.resolve("llama") is HYBRID
    assert book.resolve("other", "vllm") is BUILTIN["dense"] and book.key("other", "vllm") == "other"
    assert book.keyed([("vllm", "llama"), ("lmcache", "llama")]) == {
        ("vllm", "llama"): ("llama", HYBRID), ("lmcache", "llama"): ("lmcache:llama", CHUNKS)}


def test_a_model_without_a_recipe_is_named() -> None:
    book = RecipeBook({"vllm:llama": HYBRID})
    assert book.get("llama", "sglang") is None
    with pytest.raises(UnknownModel, match="'llama'.*vllm:llama"):
        book.resolve("llama", "sglang")
    with pytest.raises(UnknownModel, match="mystery"):
        book.keyed([("vllm", "llama"), ("vllm", "mystery")])


def test_command_line_values() -> None:
    book = RecipeBook.parse(["dense", "llama=mamba-hybrid", "lmcache:llama=sparse-indexer"])
    assert book.default is BUILTIN["dense"]
    assert dict(book.scoped) == {"llama": HYBRID, "lmcache:llama": BUILTIN["sparse-indexer"]}
    assert RecipeBook.of(HYBRID).resolve("anything", "any") is HYBRID
    assert RecipeBook.of(book) is book
    for specs, message in ((["dense", "mamba-hybrid"], "second unscoped"), (["=dense"], "ENGINE:"),
                           (["llama="], "ENGINE:"), (["m=dense", "m=dense"], "given twice"),
                           (["m=no-such"], "no-such"), ([], "needs a default")):
        with pytest.raises(RecipeError, match=message):
            RecipeBook.parse(specs)


def test_capacity_takes_a_recipe_given_for_the_engine_and_model() -> None:
    """`kvtrace capacity --recipe ENGINE:M=...` once skipped model M without a word: the capacity
    path looked recipes up by model alone. It asks the book now, like every other path."""
    config = SimConfig(recipe=HYBRID, model="m", bytes_per_token=2048, capacity_bytes=(1 << 40, 0, 0))
    sink = MemorySink()
    emitter = BatchEmitter(sink, BatchConfig(max_queue_size=1 << 16), register_atexit=False)
    sim = CacheSimulator(config, emitter)
    doc = list(range(512))
    for i in range(40):
        sim.serve(SimRequest(f"r{i}", doc[: 256 + 6 * i] + [10_000 + i] * 30))
    assert emitter.shutdown()
    events = pl.from_arrow(to_arrow(sorted(sink.events, key=lambda e: (e.ts_ns, e.source_id, e.seq))))
    assert set(events["engine"].unique()) == {"sim"}  # the simulator names itself
    by_model = capacity_report(events, HYBRID, [64, 1024])
    (scoped,) = capacity_report(events, RecipeBook({"sim:m": HYBRID}), [64, 1024])
    assert scoped.model == "sim:m" and by_model[0].model == "m"
    assert scoped.curve.equals(by_model[0].curve) and scoped.needs == by_model[0].needs
    assert scoped.curve["hit_tokens"].max() > 0
    assert capacity_report(events, RecipeBook({"vllm:m": HYBRID}), [64]) == []
