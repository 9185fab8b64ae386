"""`kvtrace replay --engine vllm` then `kvtrace analyze`: the CLI path users take."""

from __future__ import annotations

import gzip
import itertools
import re
from importlib import resources
from pathlib import Path

import pyarrow.parquet as pq

from kvtrace.cli.main import main


def test_replay_through_vllm_then_analyze(capsys, store, tmp_path: Path) -> None:
    src = resources.files("kvtrace.cli") / "data" / "mooncake_conversation_head.jsonl.gz"
    with gzip.open(str(src), "rt") as f:
        (tmp_path / "trace.jsonl").write_text("".join(itertools.islice(f, 40)))
    recipe = tmp_path / "gemma.recipe.json"
    code = main(["--dsn", str(store.dsn), "replay", str(tmp_path / "trace.jsonl"), "--engine", "vllm",
                 "--vllm-layout", "full+sliding", "--model", "gemma", "--recipe-out", str(recipe)])
    out = capsys.readouterr().out
    assert code == 0, out
    queried, hit = map(int, re.search(r"vLLM counted (\d+) queried and (\d+) hit tokens", out).groups())
    assert hit > 0 and recipe.exists()

    results = tmp_path / "results.parquet"
    assert main(["--dsn", str(store.dsn), "analyze", "--recipe", f"gemma={recipe}", "-o", str(results)]) == 0
    rows = pq.read_table(results).to_pylist()
    assert len(rows) == 40
    assert sum(r["prompt_tokens"] for r in rows) == queried
    assert sum(r["adopted_tokens"] for r in rows) == sum(r["recoverable_hit_tokens"] for r in rows) == hit
