"""One recipe book decides which recipe judges each lookup, in every path that asks."""

from __future__ import annotations

import polars as pl
import pytest

from kvtrace.analysis.planning import capacity_report
from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.simulator import CacheSimulator, SimConfig, SimRequest
from kvtrace.instrumentation.sinks.memory import MemorySink
from kvtrace.schema.arrow import to_arrow
from kvtrace.schema.recipes import BUILTIN, RecipeBook, RecipeError, RecipeMismatch, UnknownModel, dense

HYBRID = BUILTIN["mamba-hybrid"]
CHUNKS = dense(256)


def test_engine_model_then_model_then_the_default() -> None:
    book = RecipeBook({"llama": HYBRID, "lmcache:llama": CHUNKS}, default=BUILTIN["dense"])
    assert book.resolve("llama", "lmcache") is CHUNKS and book.key("llama", "lmcache") == "lmcache:llama"
    assert book.resolve("llama", "vllm") is HYBRID and book.key("llama", "vllm") == "llama"
    assert book.resolve("llama") is HYBRID
    assert book.resolve("other", "vllm") is BUILTIN["dense"] and book.key("other", "vllm") == "other"
    assert book.keyed([(1, "vllm", "llama"), (2, "lmcache", "llama")]) == {
        (1, "vllm", "llama"): ("llama", HYBRID), (2, "lmcache", "llama"): ("lmcache:llama", CHUNKS)}


def test_a_model_without_a_recipe_is_named() -> None:
    book = RecipeBook({"vllm:llama": HYBRID})
    assert book.get("llama", "sglang") is None
    with pytest.raises(UnknownModel, match="'llama'.*vllm:llama"):
        book.resolve("llama", "sglang")
    with pytest.raises(UnknownModel, match="mystery"):
        book.keyed([(1, "vllm", "llama"), (1, "vllm", "mystery")])


def test_command_line_values() -> None:
    book = RecipeBook.parse(["dense", "llama=mamba-hybrid", "lmcache:llama=sparse-indexer"])
    assert book.default is BUILTIN["dense"]
    assert dict(book.scoped) == {"llama": HYBRID, "lmcache:llama": BUILTIN["sparse-indexer"]}
    assert RecipeBook.of(HYBRID).resolve("anything", "any") is HYBRID
    assert RecipeBook.of(book) is book
    for specs, message in ((["dense", "mamba-hybrid"], "second unscoped"), (["=dense"], "ENGINE:"),
                           (["llama="], "ENGINE:"), (["m=dense", "m=dense"], "given twice"),
                           (["m=no-such"], "no-such")):
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
    # No recipe given for the simulator's model: the one it published when it attached serves.
    (own,) = capacity_report(events, RecipeBook({"vllm:m": BUILTIN["dense"]}), [64, 1024])
    assert own.model == "sim:m" and own.curve.equals(by_model[0].curve)
    (unnamed,) = capacity_report(events, None, [64, 1024])
    assert unnamed.model == "sim:m" and unnamed.needs == by_model[0].needs


def test_with_none_given_each_engine_is_judged_by_the_recipe_it_published() -> None:
    empty = RecipeBook.parse([])
    with pytest.raises(UnknownModel, match="none given, none published"):
        empty.resolve("llama", "vllm", 7)
    book = empty.publish(7, "vllm", "llama", HYBRID, "i0").publish(8, "lmcache", "llama", CHUNKS, "i0")
    assert empty.published == {}  # a book is a value: publishing makes a new one
    assert book.resolve("llama", "vllm", 7) is HYBRID and book.key("llama", "vllm", 7) == f"vllm:llama@{7:016x}"
    assert book.resolve("llama", "lmcache", 8) is CHUNKS
    with pytest.raises(UnknownModel, match="vllm:llama"):
        book.resolve("llama", "vllm", 9)  # another process of the engine, which published nothing
    overridden = RecipeBook({"llama": HYBRID}).publish(7, "vllm", "llama", HYBRID)
    assert overridden.key("llama", "vllm", 7) == "llama"  # a given recipe the engine agrees with serves


def test_a_given_recipe_the_engine_contradicts_is_refused() -> None:
    """The user's case: dense (16-token blocks) given for an engine running 32-token blocks."""
    with pytest.raises(RecipeMismatch, match=r"'dense' given for model 'llama'.*vllm instance i0.*group 0: "
                                             r"the recipe's block_size is 16, the engine's 32"):
        RecipeBook.parse(["llama=dense"]).publish(7, "vllm", "llama", dense(32), "i0")
    with pytest.raises(RecipeMismatch, match="the recipe has 1 cache group"):
        RecipeBook.parse(["dense"]).publish(7, "vllm", "llama", HYBRID, "i0")
    with pytest.raises(RecipeMismatch, match="group 1: the recipe's component is mamba, the engine's sliding_window"):
        RecipeBook(default=HYBRID).publish(7, "vllm", "m", BUILTIN["sliding-window-hybrid"])
    # Only the given recipe's model is checked; an engine of another model publishes freely.
    RecipeBook.parse(["llama=dense"]).publish(7, "vllm", "other", dense(32))


def test_commits_longer_than_the_given_blocks_or_in_a_group_it_lacks_are_refused() -> None:
    book = RecipeBook.parse(["llama=dense"])
    book.check_commits("vllm", "llama", 0, 16)
    book.check_commits("lmcache", "llama", 0, 9)  # a partial last chunk fits
    book.check_commits("vllm", "other", 3, 512)  # no recipe given for it: nothing to contradict
    with pytest.raises(RecipeMismatch, match=r"engine vllm: group 0 \(full_attention\): the recipe's block_size is "
                                             r"16, the engine's commits span 32 tokens a block \(12 commits\)"):
        book.check_commits("vllm", "llama", 0, 32, 12)
    with pytest.raises(RecipeMismatch, match="commits name cache group 1"):
        book.check_commits("vllm", "llama", 1, 16)
