"""Request traces: readers for public formats, and tokens synthesized from their hash ids.

Public traces carry no text, only prefix-block hash ids: equal ids mean the same reusable
block. To replay one through an engine, `synthesize_tokens` turns ids into token ids such that
the engine's own block hashing, at any block size, sees exactly the sharing the trace describes.

Formats (one JSON object per line):

- `mooncake`: `timestamp` (ms), `input_length`, `output_length`, `hash_ids` of 512-token blocks.
- `qwen` (Alibaba "KVCache in the wild"): `chat_id`, `parent_chat_id`, `timestamp` (s),
  `input_length`, `output_length`, `type`, `turn`, `hash_ids` of 16-token blocks.
- `kvtrace`, our own: `arrival_ms`, `input_length`, `output_length`, `hash_ids`,
  `block_tokens`, and optionally `request_id`, `tenant`, `session`.

A bad line raises `TraceError` naming the file, line and field; with `skip_bad=True` the reader
counts and keeps the first errors instead, and goes on.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import msgspec

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
_MASK = (1 << 64) - 1


class TraceFormat(StrEnum):
    MOONCAKE = "mooncake"
    QWEN = "qwen"
    KVTRACE = "kvtrace"


class TraceError(ValueError):
    """A line that is not a valid request of its format."""


class TraceRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One request of a trace, whatever the format it came from."""

    line: int  # 1-based line in the file
    request_id: str
    arrival_ns: int  # since the start of the trace
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    block_tokens: int  # tokens per hash id
    tenant: str = ""
    session: str = ""
    parent_session: str = ""


class _Mooncake(msgspec.Struct, forbid_unknown_fields=False):
    timestamp: Annotated[float, msgspec.Meta(ge=0)]
    input_length: NonNeg
    output_length: NonNeg
    hash_ids: list[NonNeg]


class _Qwen(msgspec.Struct, forbid_unknown_fields=False):
    chat_id: int | str
    timestamp: Annotated[float, msgspec.Meta(ge=0)]
    input_length: NonNeg
    output_length: NonNeg
    hash_ids: list[NonNeg]
    parent_chat_id: int | str = -1
    type: str = ""
    turn: int = 0


class _Own(msgspec.Struct, forbid_unknown_fields=False):
    arrival_ms: Annotated[float, msgspec.Meta(ge=0)]
    input_length: NonNeg
    output_length: NonNeg
    hash_ids: list[NonNeg]
    block_tokens: Annotated[int, msgspec.Meta(gt=0)]
    request_id: str = ""
    tenant: str = ""
    session: str = ""


_DECODERS = {
    TraceFormat.MOONCAKE: msgspec.json.Decoder(_Mooncake),
    TraceFormat.QWEN: msgspec.json.Decoder(_Qwen),
    TraceFormat.KVTRACE: msgspec.json.Decoder(_Own),
}


def _convert(fmt: TraceFormat, row: Any, line: int) -> TraceRequest:
    if fmt is TraceFormat.MOONCAKE:
        return TraceRequest(line=line, request_id=f"req-{line}", arrival_ns=round(row.timestamp * 1e6),
                            input_length=row.input_length, output_length=row.output_length,
                            hash_ids=tuple(row.hash_ids), block_tokens=512)
    if fmt is TraceFormat.QWEN:
        parent = "" if row.parent_chat_id in (-1, "-1", "") else str(row.parent_chat_id)
        return TraceRequest(line=line, request_id=f"chat-{row.chat_id}", arrival_ns=round(row.timestamp * 1e9),
                            input_length=row.input_length, output_length=row.output_length,
                            hash_ids=tuple(row.hash_ids), block_tokens=16, session=str(row.chat_id),
                            parent_session=parent)
    return TraceRequest(line=line, request_id=row.request_id or f"req-{line}", arrival_ns=round(row.arrival_ms * 1e6),
                        input_length=row.input_length, output_length=row.output_length,
                        hash_ids=tuple(row.hash_ids), block_tokens=row.block_tokens, tenant=row.tenant,
                        session=row.session)


def _check(req: TraceRequest) -> str:
    """The semantic problem of a well-typed request, or ''."""
    need = -(-req.input_length // req.block_tokens)
    if len(req.hash_ids) != need:
        return (f"hash_ids: {len(req.hash_ids)} ids do not cover input_length {req.input_length} "
                f"in blocks of {req.block_tokens} (expected {need})")
    return ""


def detect_format(first_line: str) -> TraceFormat:
    try:
        keys = set(json.loads(first_line))
    except (ValueError, TypeError):
        raise TraceError("line 1: not a JSON object, cannot tell the trace format") from None
    if "arrival_ms" in keys:
        return TraceFormat.KVTRACE
    if "chat_id" in keys:
        return TraceFormat.QWEN
    if "timestamp" in keys and "hash_ids" in keys:
        return TraceFormat.MOONCAKE
    raise TraceError(f"line 1: keys {sorted(keys)} match no known trace format (mooncake, qwen, kvtrace)")


def _open(path: Path) -> Any:
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8")


@dataclass
class TraceReader:
    """Iterates a trace file's requests; counts what it skipped when told to skip."""

    path: Path
    fmt: TraceFormat | None = None
    skip_bad: bool = False
    limit: int = 0  # stop after this many requests; 0 = all
    skipped: int = 0
    errors: list[str] = field(default_factory=list)  # the first few, when skipping

    def __iter__(self) -> Iterator[TraceRequest]:
        path = Path(self.path)
        if not path.is_file():
            raise TraceError(f"{path}: no such trace file")
        yielded = 0
        with _open(path) as f:
            for number, text in enumerate(f, start=1):
                if not text.strip():
                    continue
                if self.fmt is None:
                    self.fmt = detect_format(text)
                try:
                    row = _DECODERS[self.fmt].decode(text)
                    req = _convert(self.fmt, row, number)
                    problem = _check(req)
                except msgspec.ValidationError as exc:
                    problem = str(exc).replace("`$.", "`").replace("$.", "")
                except msgspec.DecodeError as exc:
                    problem = f"not valid JSON ({exc})"
                if problem:
                    message = f"{path}:{number}: {problem}"
                    if not self.skip_bad:
                        raise TraceError(message)
                    self.skipped += 1
                    if len(self.errors) < 10:
                        self.errors.append(message)
                    continue
                yield req
                yielded += 1
                if self.limit and yielded >= self.limit:
                    return


def read_trace(path: str | Path, fmt: TraceFormat | str | None = None, *, skip_bad: bool = False,
               limit: int = 0) -> TraceReader:
    return TraceReader(Path(path), TraceFormat(fmt) if fmt else None, skip_bad, limit)


def _mix(x: int) -> int:
    """splitmix64: a fixed, well-spread 64-bit permutation (stable across runs and machines)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def synthesize_tokens(hash_ids: Sequence[int], block_tokens: int, input_length: int,
                      vocab_size: int = 32_000, salt: int = 0) -> list[int]:
    """Token ids for a request: block i's tokens depend only on (hash_ids[i], position in block).

    Equal ids give equal tokens, so requests share exactly the prefixes the trace says they
    share; a partial last block is the start of its id's tokens, so it stays partial. Token 0 and
    the top of the vocabulary are avoided (special tokens in most tokenizers).
    """
    span = max(vocab_size - 200, 1)
    out: list[int] = []
    for h in hash_ids:
        base = _mix((h ^ (salt << 40)) & _MASK)
        take = min(block_tokens, input_length - len(out))
        out.extend(100 + _mix(base + j) % span for j in range(take))
        if len(out) >= input_length:
            break
    return out
