"""The contract between the emitter's worker thread and wherever batches go."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol, runtime_checkable

from kvtrace.schema.wire import Batch, RawBatch


class ExportStatus(Enum):
    SUCCESS = "success"
    RETRY = "retry"  # transient: the same batch may succeed later
    FAILURE = "failure"  # permanent: retrying the same batch cannot help


@dataclass(frozen=True, slots=True)
class ExportResult:
    status: ExportStatus
    retry_after_s: float = 0.0  # a server's Retry-After, honoured before the next attempt
    detail: str = ""
    rejected: int = 0  # rows the sink quarantined as invalid (stored elsewhere, not lost)


OK = ExportResult(ExportStatus.SUCCESS)


@runtime_checkable
class Sink(Protocol):
    """Receives whole batches on the emitter's worker thread, never on an engine thread.

    `export` may block up to its own timeout and should not raise; the worker treats an
    exception as a RETRY. `shutdown` releases resources and is safe to call twice.

    A sink whose `takes_encoded` attribute is true also takes a `RawBatch`, whose events are
    their msgpack bytes as a batch carries them (read back from an emitter's journal): it sends
    or writes them as they are. Any other sink gets a `Batch` of decoded events.
    """

    def export(self, batch: Batch) -> ExportResult: ...

    def shutdown(self) -> None: ...


def takes_encoded(sink: object) -> bool:
    """Whether `sink` takes a RawBatch (see `Sink`)."""
    return getattr(sink, "takes_encoded", False) is True


AnyBatch = Batch | RawBatch
