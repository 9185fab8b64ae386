"""Helpers for the replay tests of requests an engine refuses: kvtrace-format trace lines, and
stored events comparable across two replays.

Importable from any test module (`from refused_replay import trace_line`): pytest puts this
directory on sys.path because tests/ is not a package.
"""

from __future__ import annotations

import json
from typing import Any

from kvtrace.analysis.planning import read_events
from kvtrace.store.client import Store


def trace_line(request_id: str, input_length: int, shared: int, unique_from: int, block_tokens: int = 16) -> str:
    """A kvtrace-format request: `shared` blocks of a prefix common to every such line (ids 1, 2,
    ...), then blocks of its own (ids from `unique_from`)."""
    blocks = -(-input_length // block_tokens)
    common = min(shared, blocks)
    ids = list(range(1, common + 1)) + list(range(unique_from, unique_from + blocks - common))
    return json.dumps({"arrival_ms": 0, "input_length": input_length, "output_length": 4, "hash_ids": ids,
                       "block_tokens": block_tokens, "request_id": request_id}) + "\n"


def replayed_events(dsn: str) -> list[dict[str, Any]]:
    """A store's events in stream order, without what differs between two runs (time, source)."""
    with Store(dsn) as store:
        frame = read_events(store).sort("seq").drop("ts_ns", "source_id", "seq", "duration_ns")
    return frame.to_dicts()


def drop_database(dsn: str) -> None:
    with Store(dsn) as store:
        store.client.command(f"DROP DATABASE IF EXISTS {store.db}")
