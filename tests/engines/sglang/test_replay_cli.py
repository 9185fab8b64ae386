"""`kvtrace replay --engine sglang` then `kvtrace analyze`: the CLI path users take."""

from __future__ import annotations

import gzip
import itertools
import re
import uuid
from importlib import resources
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from refused_replay import drop_database, replayed_events, trace_line

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


def test_replay_refuses_what_sglang_refuses_and_goes_on(capsys, store, chdb_path: Path, tmp_path: Path) -> None:
    """A 3,200-slot pool under a 4,096-token context: prompts at or over the context length are
    refused by SGLang's tokenizer manager (no event), prompts from the scheduler's input limit
    (3,194) up are aborted by its scheduler, which runs a one-token stub in their place (one
    lookup each); the replay completes, the counts are exact, and every other event is that of a
    replay of the trace without the refused lines."""
    normal = [trace_line(f"ok-{i}", 200 + 30 * i, shared=10, unique_from=1000 * (i + 1)) for i in range(10)]
    aborted = [trace_line("abort-at-limit", 3194, shared=10, unique_from=90_000),
               trace_line("abort-over-pool", 3500, shared=10, unique_from=91_000)]
    front = [trace_line("front-at-context", 4096, shared=10, unique_from=92_000),
             trace_line("front-over", 9000, shared=10, unique_from=93_000)]
    full, kept = tmp_path / "full.jsonl", tmp_path / "kept.jsonl"
    full.write_text("".join(normal[:2] + aborted[:1] + front[:1] + normal[2:6] + aborted[1:] + front[1:]
                            + normal[6:]))
    kept.write_text("".join(normal))
    flags = ["--engine", "sglang", "--sglang-mix", "full", "--sglang-tokens", "3200", "--sglang-context-len", "4096",
             "--model", "m", "--recipe-out", str(tmp_path / "r.json")]

    assert main(["--dsn", str(store.dsn), "replay", str(full), *flags]) == 0
    captured = capsys.readouterr()
    assert ("refused 4 requests: 2 longer than the context length 4096, 2 over the scheduler's input limit 3194; "
            "the scheduler's 2 aborted ran as SGLang runs them") in captured.out, captured.out
    assert "KV pool holds 3200 tokens, fewer than the context length 4096" in captured.err  # SGLang warns too
    assert "replayed 10 requests" in captured.out and "0 hook errors" in captured.out

    other = f"chdb://{chdb_path}?database=t_{uuid.uuid4().hex[:12]}"
    assert main(["--dsn", other, "replay", str(kept), *flags]) == 0
    kept_out = capsys.readouterr().out
    assert "refused" not in kept_out
    reused = re.compile(r"SGLang reused (\d+) of (\d+) prompt tokens")
    assert reused.search(captured.out).groups() == reused.search(kept_out).groups()
    events = replayed_events(str(store.dsn))
    stubs = [e for e in events if e["request_id"] in ("abort-at-limit", "abort-over-pool")]
    assert sorted((e["request_id"], e["prompt_tokens"]) for e in stubs if e["kind"] == "lookup") == [
        ("abort-at-limit", 1), ("abort-over-pool", 1)]
    assert [e for e in events if e not in stubs] == replayed_events(other)
    assert {e["request_id"] for e in events} - {""} == {f"ok-{i}" for i in range(10)} | {"abort-at-limit",
                                                                                           "abort-over-pool"}
    drop_database(other)
