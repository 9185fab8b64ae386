"""`kvtrace replay --engine sglang` then `kvtrace analyze`: the CLI path users take."""

from __future__ import annotations

import gzip
import itertools
import re
from importlib import resources
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kvtrace.cli.main import main


@pytest.mark.parametrize("mix", ["full+swa", "full+mamba"])
def test_replay_through_sglang_then_analyze(capsys, store, tmp_path: Path, mix: str) -> None:
    src = resources.files("kvtrace.cli") / "data" / "mooncake_conversation_head.jsonl.gz"
    with gzip.open(str(src), "rt") as f:
        (tmp_path / "trace.jsonl").write_text("".join(itertools.islice(f, 30)))
    recipe = tmp_path / "hybrid.recipe.json"
    code = main(["--dsn", str(store.dsn), "replay", str(tmp_path / "trace.jsonl"), "--engine", "sglang",
                 "--sglang-mix", mix, "--sglang-tokens", "100000", "--model", "hybrid", "--recipe-out", str(recipe)])
    out = capsys.readouterr().out
    assert code == 0, out
    reused, prompt = map(int, re.search(r"SGLang reused (\d+) of (\d+) prompt tokens", out).groups())
    assert reused > 0 and recipe.exists()

    results = tmp_path / "results.parquet"
    assert main(["--dsn", str(store.dsn), "analyze", "--recipe", f"hybrid={recipe}", "-o", str(results)]) == 0
    rows = pq.read_table(results).to_pylist()
    assert len(rows) == 30
    assert sum(r["prompt_tokens"] for r in rows) == prompt
    assert sum(r["adopted_tokens"] for r in rows) == sum(r["recoverable_hit_tokens"] for r in rows) == reused
