"""Trace readers on real and malformed lines, and tokens that keep the trace's sharing exactly."""

from __future__ import annotations

import itertools
import json
from importlib import resources
from pathlib import Path

import pytest

from kvtrace.instrumentation.replay import tokens_of
from kvtrace.instrumentation.simulator import block_keys
from kvtrace.instrumentation.traces import TraceError, TraceFormat, read_trace, synthesize_tokens
from kvtrace.schema.recipes import dense

# The first 400 requests of the Mooncake conversation trace, as shipped with the demo.
CONVERSATION = Path(str(resources.files("kvtrace.cli") / "data" / "mooncake_conversation_head.jsonl.gz"))


def write(tmp_path: Path, rows: list[object], name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_mooncake_trace_reads_in_order_with_512_token_blocks() -> None:
    reader = read_trace(CONVERSATION)
    reqs = list(reader)
    assert reader.fmt is TraceFormat.MOONCAKE and len(reqs) == 400
    assert all(r.block_tokens == 512 and len(r.hash_ids) == -(-r.input_length // 512) for r in reqs)
    assert [r.arrival_ns for r in reqs] == sorted(r.arrival_ns for r in reqs)
    assert reqs[0].line == 1 and reqs[0].request_id == "req-1" and reqs[0].input_length == 6758


GOOD = {"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ("{not json", "not valid JSON"),
        ({**GOOD, "input_length": -1}, "input_length"),
        ({k: v for k, v in GOOD.items() if k != "hash_ids"}, "hash_ids"),
        ({**GOOD, "hash_ids": [1]}, "1 ids do not cover input_length 600"),
        ({**GOOD, "timestamp": "soon"}, "timestamp"),
    ],
)
def test_bad_line_is_named_with_its_number(tmp_path: Path, bad: object, says: str) -> None:
    path = write(tmp_path, [GOOD, bad, GOOD])
    with pytest.raises(TraceError, match=rf"t\.jsonl:2: .*{says}"):
        list(read_trace(path))
    reader = read_trace(path, skip_bad=True)
    assert len(list(reader)) == 2 and reader.skipped == 1 and ":2:" in reader.errors[0]


def test_qwen_and_own_formats(tmp_path: Path) -> None:
    qwen = write(tmp_path, [
        {"chat_id": 7, "parent_chat_id": -1, "timestamp": 1.5, "input_length": 40, "output_length": 9,
         "type": "text", "turn": 1, "hash_ids": [3, 4, 5]},
        {"chat_id": 8, "parent_chat_id": 7, "timestamp": 2.0, "input_length": 16, "output_length": 9,
         "type": "text", "turn": 2, "hash_ids": [3]},
    ], "q.jsonl")
    a, b = read_trace(qwen)
    assert (a.block_tokens, a.arrival_ns, a.session, a.parent_session) == (16, 1_500_000_000, "7", "")
    assert b.parent_session == "7" and b.request_id == "chat-8"
    own = write(tmp_path, [{"arrival_ms": 2.5, "input_length": 5, "output_length": 1, "hash_ids": [9],
                            "block_tokens": 64, "tenant": "acme", "request_id": "x"}], "o.jsonl")
    (c,) = read_trace(own)
    assert (c.tenant, c.request_id, c.arrival_ns, c.block_tokens) == ("acme", "x", 2_500_000, 64)


def test_unknown_format_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="match no known trace format"):
        list(read_trace(write(tmp_path, [{"what": 1}])))
    with pytest.raises(TraceError, match="no such trace file"):
        list(read_trace(tmp_path / "absent.jsonl"))


def test_synthesis_is_deterministic_and_keeps_partial_blocks_partial() -> None:
    one = synthesize_tokens([1, 2, 3], 512, 1100)
    assert one == synthesize_tokens([1, 2, 3], 512, 1100) and len(one) == 1100
    assert synthesize_tokens([1, 2, 9], 512, 1100)[:1024] == one[:1024]
    assert synthesize_tokens([1, 2, 9], 512, 1100)[1024:] != one[1024:]
    assert all(100 <= t < 32_000 for t in one)


@pytest.mark.parametrize("block_size", [16, 64, 256])
def test_engine_block_hashing_sees_exactly_the_trace_sharing(block_size: int) -> None:
    """For pairs of real requests, shared engine blocks == shared hash ids * 512 / block size."""
    reqs = list(read_trace(CONVERSATION, limit=300))
    recipe = dense(block_size)
    keys = {r.line: block_keys(recipe, tokens_of(r))[0] for r in reqs}
    checked = 0
    for a, b in itertools.combinations(reqs, 2):
        shared_ids = next((i for i, (x, y) in enumerate(zip(a.hash_ids, b.hash_ids, strict=False)) if x != y),
                          min(len(a.hash_ids), len(b.hash_ids)))
        if not shared_ids:
            continue
        ka, kb = keys[a.line], keys[b.line]
        shared_keys = next((i for i, (x, y) in enumerate(zip(ka, kb, strict=False)) if x != y), min(len(ka), len(kb)))
        full = min(shared_ids * 512, a.input_length, b.input_length) // block_size
        assert shared_keys == full, (a.line, b.line, shared_ids)
        checked += 1
    assert checked > 1000
