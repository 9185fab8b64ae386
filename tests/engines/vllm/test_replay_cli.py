"""`kvtrace replay --engine vllm` then `kvtrace analyze`: the CLI path users take."""

from __future__ import annotations

import gzip
import itertools
import re
import uuid
from importlib import resources
from pathlib import Path

import pyarrow.parquet as pq
from refused_replay import drop_database, replayed_events, trace_line

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


def test_replay_refuses_what_vllm_refuses_and_goes_on(capsys, store, chdb_path: Path, tmp_path: Path) -> None:
    """Prompts over max_model_len and one larger than the whole cache, among normal requests
    sharing a prefix with them: the replay completes, counts each refusal, and the normal
    requests' events are exactly those of a replay of the trace without the refused lines."""
    normal = [trace_line(f"ok-{i}", 350 + 70 * i, shared=20, unique_from=1000 * (i + 1)) for i in range(12)]
    refused = [trace_line("long-at-max", 2048, shared=20, unique_from=90_000),  # no room for an output token
               trace_line("long-over", 5000, shared=20, unique_from=91_000),
               trace_line("over-cache", 1800, shared=20, unique_from=92_000)]  # < max_model_len, > 199 blocks
    full, kept = tmp_path / "full.jsonl", tmp_path / "kept.jsonl"
    full.write_text("".join(normal[:3] + refused[:1] + normal[3:7] + refused[1:] + normal[7:]))
    kept.write_text("".join(normal))
    flags = ["--engine", "vllm", "--vllm-layout", "full+sliding", "--vllm-max-model-len", "2048",
             "--vllm-blocks", "200", "--model", "gemma", "--recipe-out", str(tmp_path / "r.json")]

    assert main(["--dsn", str(store.dsn), "replay", str(full), *flags]) == 0
    captured = capsys.readouterr()
    assert "refused 3 requests: 2 longer than max_model_len 2048, 1 larger than the whole cache (199 blocks)" \
        in captured.out
    # vLLM itself would not start with a cache that cannot hold one max_model_len request
    assert "vLLM would not start with this cache" in captured.err, captured.err
    assert "replayed 12 requests" in captured.out and "0 hook errors" in captured.out

    other = f"chdb://{chdb_path}?database=t_{uuid.uuid4().hex[:12]}"
    assert main(["--dsn", other, "replay", str(kept), *flags]) == 0
    kept_out = capsys.readouterr().out
    assert "refused" not in kept_out
    counted = re.compile(r"vLLM counted (\d+) queried and (\d+) hit tokens")
    assert counted.search(captured.out).groups() == counted.search(kept_out).groups()
    events = replayed_events(str(store.dsn))
    assert events == replayed_events(other)
    assert {e["request_id"] for e in events} - {""} == {f"ok-{i}" for i in range(12)}
    drop_database(other)
