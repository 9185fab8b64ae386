"""A trace replayed on the simulator and recorded into the store, as `kvtrace replay` and the demo do."""

from __future__ import annotations

import gzip
import itertools
from importlib import resources

import pytest

from kvtrace.instrumentation.recording import record_replay
from kvtrace.instrumentation.replay import ReplayOptions
from kvtrace.instrumentation.simulator import CheckpointPolicy, PolicySpec, SimConfig
from kvtrace.instrumentation.traces import read_trace
from kvtrace.schema.recipes import BUILTIN
from kvtrace.store.client import Store


def trace(tmp_path, rows: int):  # noqa: ANN001, ANN201
    src = resources.files("kvtrace.cli") / "data" / "mooncake_conversation_head.jsonl.gz"
    with gzip.open(str(src), "rt") as f:
        (tmp_path / "trace.jsonl").write_text("".join(itertools.islice(f, rows)))
    return read_trace(tmp_path / "trace.jsonl")


def test_every_event_of_the_replay_is_in_the_store(store: Store, tmp_path) -> None:  # noqa: ANN001
    config = PolicySpec.parse("interval:512").apply(
        SimConfig(recipe=BUILTIN["mamba-hybrid"], model="jamba", instance="sim-7", bytes_per_token=4096,
                  capacity_bytes=(1 << 28, 1 << 29, 0)))
    seen = []
    recorded = record_replay(store, trace(tmp_path, 15), config, ReplayOptions(tenant="t"), progress=seen.append)
    assert recorded.report.requests == 15 and seen == list(range(1, 16))
    assert recorded.stats.dropped == 0 and recorded.stats.instance == "sim-7" and recorded.stats.engine == "sim"
    assert recorded.stats.exported == recorded.stats.emitted == store.count_events() > 0
    kinds = dict(store.client.query(f"SELECT kind, count() FROM {store.db}.events FINAL GROUP BY kind").result_rows)
    assert kinds["lookup"] == kinds["adopt"] == 15
    assert store.scalar(f"SELECT uniqExact(tenant) FROM {store.db}.events WHERE kind = 'lookup'") == 1
    adopted = store.scalar(f"SELECT sum(arraySum(reused_tokens)) FROM {store.db}.events FINAL WHERE kind = 'adopt'")
    assert adopted == recorded.report.adopted_tokens > 0


def test_policy_names_parse_into_the_simulators_checkpoints() -> None:
    base = SimConfig(recipe=BUILTIN["mamba-hybrid"])
    assert PolicySpec.parse("lru").apply(base).checkpoints is CheckpointPolicy.EVERY_BLOCK
    assert PolicySpec.parse("branch").apply(base).checkpoints is CheckpointPolicy.BRANCH_POINTS
    interval = PolicySpec.parse("interval:256").apply(base)
    assert (interval.checkpoints, interval.checkpoint_every) == (CheckpointPolicy.INTERVAL, 256)
    assert interval.recipe is base.recipe
    for bad in ("fifo", "interval:0", "interval:x", "lru:3"):
        with pytest.raises(ValueError, match="unknown policy"):
            PolicySpec.parse(bad)
