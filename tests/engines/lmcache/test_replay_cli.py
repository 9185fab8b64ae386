"""`kvtrace replay --engine lmcache` then `kvtrace analyze`: the CLI path users take, through the
store and its ClickHouse SQL path."""

from __future__ import annotations

import gzip
import itertools
import re
from importlib import resources
from pathlib import Path

import pyarrow.parquet as pq

from kvtrace.cli.main import main


def test_replay_through_lmcache_then_analyze(capsys, store, tmp_path: Path) -> None:  # noqa: ANN001
    src = resources.files("kvtrace.cli") / "data" / "mooncake_conversation_head.jsonl.gz"
    with gzip.open(str(src), "rt") as f:
        (tmp_path / "trace.jsonl").write_text("".join(itertools.islice(f, 30)))
    recipe = tmp_path / "m.recipe.json"
    code = main(["--dsn", str(store.dsn), "replay", str(tmp_path / "trace.jsonl"), "--engine", "lmcache",
                 "--model", "m", "--lmcache-cpu-gb", "0.01", "--lmcache-disk-gb", "1",
                 "--lmcache-disk-dir", str(tmp_path / "disk"), "--recipe-out", str(recipe)])
    out = capsys.readouterr().out
    assert code == 0, out
    found, delivered, prompt = map(int, re.search(r"LMCache found (\d+) and delivered (\d+) of (\d+)", out).groups())
    assert found == delivered > 0 and "DIFFERED" not in out

    results = tmp_path / "results.parquet"
    assert main(["--dsn", str(store.dsn), "analyze", "--recipe", f"m={recipe}", "-o", str(results)]) == 0
    rows = pq.read_table(results).to_pylist()
    assert len(rows) == 30 and sum(r["prompt_tokens"] for r in rows) == prompt
    assert sum(r["logical_hit_tokens"] for r in rows) == sum(r["reported_hit_tokens"] for r in rows) == found
    assert sum(r["adopted_tokens"] for r in rows) == sum(r["recoverable_hit_tokens"] for r in rows) == delivered
    assert not any(r["unsafe_reuse"] for r in rows)
