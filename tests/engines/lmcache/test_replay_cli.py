"""`kvtrace replay --engine lmcache` then `kvtrace analyze`: the CLI path users take, through the
store and its ClickHouse SQL path."""

from __future__ import annotations

import gzip
import itertools
import re
from importlib import resources
from pathlib import Path

import pyarrow.parquet as pq
from refused_replay import replayed_events, trace_line

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


def test_lmcache_refuses_nothing_and_stores_what_fits(capsys, store, tmp_path: Path) -> None:
    """A prompt whose KV is larger than LMCache's CPU and disk tiers together, among normal
    requests: LMCache refuses no request for its length (it stores the leading chunks that fit),
    so the replay serves all of them and reports no refusal."""
    normal = [trace_line(f"ok-{i}", 600 + 100 * i, shared=16, unique_from=1000 * (i + 1)) for i in range(6)]
    huge = trace_line("huge", 20_000, shared=16, unique_from=90_000)  # 78 chunks; the tiers hold about 48
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(normal[:3] + [huge] + normal[3:]))
    code = main(["--dsn", str(store.dsn), "replay", str(trace), "--engine", "lmcache", "--model", "m",
                 "--lmcache-cpu-gb", "0.002", "--lmcache-disk-gb", "0.004", "--lmcache-disk-dir", str(tmp_path / "d"),
                 "--recipe-out", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "replayed 7 requests" in out and "refused" not in out and "DIFFERED" not in out
    events = replayed_events(str(store.dsn))
    lookups = {e["request_id"]: e["prompt_tokens"] for e in events if e["kind"] == "lookup"}
    assert lookups["huge"] == 20_000 and len(lookups) == 7
    # the shared 256-token prefix chunk is found again after the huge request went through
    assert sum(sum(e["reused_tokens"]) for e in events if e["kind"] == "adopt" and e["request_id"] == "ok-5") >= 256
