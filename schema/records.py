"""Stored records other than events: emitter health and quarantined input.

Both are derived into tables and wire formats by the same machinery as the event, so a counter
added here appears in the DDL, Arrow and JSON Schema without further edits.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvtrace.schema.columns import F64, U64, Hash64, Label, Text, TimeNs
from kvtrace.schema.kinds import Ending


class EmitterStats(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Cumulative counters of one emitter, sent with its batches so loss is never silent.

    Counters are totals since the emitter started (like Prometheus counters): a reader takes the
    latest row per source, and a restart shows up as a new source_id. The last row of an emitter
    says how it ended; an emitter whose process died has that row sent by whoever shipped its
    journal, with the counters it had persisted there.
    """

    ts_ns: TimeNs
    source_id: Hash64
    instance: Label = ""
    engine: Label = ""
    emitted: Annotated[U64, msgspec.Meta(description="Events handed to emit().")] = 0
    exported: Annotated[U64, msgspec.Meta(description="Events the sink accepted.")] = 0
    dropped_queue_full: Annotated[U64, msgspec.Meta(description="Dropped: buffer was full.")] = 0
    dropped_export_failed: Annotated[U64, msgspec.Meta(description="Dropped: sink kept failing.")] = 0
    dropped_invalid: Annotated[U64, msgspec.Meta(description="Dropped: not a valid event.")] = 0
    dropped_shutdown: Annotated[U64, msgspec.Meta(description="Dropped: still queued at shutdown.")] = 0
    dropped_sampled_out: Annotated[U64, msgspec.Meta(description="Not kept by the sample rate.")] = 0
    queue_depth: Annotated[U64, msgspec.Meta(description="Events waiting when this was taken.")] = 0
    batches: Annotated[U64, msgspec.Meta(description="Batches exported.")] = 0
    export_errors: Annotated[U64, msgspec.Meta(description="Failed export attempts.")] = 0
    recovered: Annotated[U64, msgspec.Meta(
        description="Events shipped from the journal after the emitter's process ended.")] = 0
    ended: Annotated[Ending, msgspec.Meta(
        description="'' while running; 'clean' after its shutdown; 'unclean' when its process died first.")] = (
        Ending.RUNNING)
    ended_ns: Annotated[TimeNs, msgspec.Meta(
        description="When it ended: its shutdown, or the last sign of life of a process that died.")] = 0
    writer: Annotated[Label, msgspec.Meta(
        description="Set by the collector: the tenants of the token that sent these counters "
                    "('' for an operator's token or an open collector); emitters leave it empty.")] = ""

    @property
    def dropped(self) -> int:
        """Events lost for any reason (sampling is a choice, not a loss, and is not counted)."""
        return (
            self.dropped_queue_full
            + self.dropped_export_failed
            + self.dropped_invalid
            + self.dropped_shutdown
        )


class Rejection(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One input row that failed validation, kept with the reason instead of being lost."""

    received_ns: TimeNs
    origin: Annotated[Text, msgspec.Meta(description="File, endpoint or sink the row came from.")]
    row: Annotated[U64, msgspec.Meta(description="1-based row (line, record) within the origin.")]
    field: Annotated[Label, msgspec.Meta(description="Field at fault, '' when the row itself is.")]
    reason: Annotated[Text, msgspec.Meta(description="What is wrong, in words.")]
    raw: Annotated[Text, msgspec.Meta(description="The row as received (JSON text).")] = ""

    def message(self) -> str:
        where = f"{self.origin} row {self.row}"
        return f"{where}: {self.field}: {self.reason}" if self.field else f"{where}: {self.reason}"


class CalibrationSample(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One timing measured by `kvtrace calibrate` on a real device, for a deployment that has no
    timings in its events yet: a prefill of `tokens` tokens after `start` cached ones for a
    model shape, or a copy of `nbytes` along a tier path. Cost models fit them like event
    timings."""

    ts_ns: TimeNs
    run_id: Annotated[Label, msgspec.Meta(description="One calibrate run: its samples share it.")]
    device: Annotated[Label, msgspec.Meta(description="Where it ran, e.g. 'cpu: AMD EPYC x2' or 'cuda: H200'.")]
    model: Annotated[Label, msgspec.Meta(description="Model the shape stands for (what analysis joins on).")]
    shape: Annotated[Text, msgspec.Meta(description="Layers, heads, sizes and dtype, as JSON.")] = ""
    kind: Annotated[Label, msgspec.Meta(description="'prefill' or 'transfer'.")]
    src_tier: Annotated[Label, msgspec.Meta(description="Transfer: from this tier.")] = ""
    dst_tier: Annotated[Label, msgspec.Meta(description="Transfer: to this tier.")] = ""
    start: Annotated[U64, msgspec.Meta(description="Prefill: tokens already cached before the chunk.")] = 0
    tokens: Annotated[U64, msgspec.Meta(description="Prefill: tokens computed.")] = 0
    nbytes: Annotated[U64, msgspec.Meta(description="Transfer: bytes moved.")] = 0
    seconds: Annotated[F64, msgspec.Meta(description="Median of the repeats.")]


class StateSnapshot(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The streaming reconstructor's state after one stream position: what an incremental
    analysis (`kvtrace analyze --since`) starts from instead of re-reading the history before
    it. Written by the analysis itself at the end of each range it reads; taken only of
    settled time, so no event can still arrive before its position."""

    ts_ns: Annotated[TimeNs, msgspec.Meta(description="Position: the last event folded in (time).")]
    source_id: Annotated[Hash64, msgspec.Meta(description="Position: that event's emitter.")]
    seq: Annotated[U64, msgspec.Meta(description="Position: that event's sequence number.")]
    events: Annotated[U64, msgspec.Meta(description="Events folded in from the start of the store.")]
    fingerprint: Annotated[Label, msgspec.Meta(
        description="The given recipes and policy it was built with: only a run with the same uses it.")]
    created_ns: Annotated[TimeNs, msgspec.Meta(description="When it was taken.")]
    objects: Annotated[U64, msgspec.Meta(description="Live objects it holds.")] = 0
    pending: Annotated[U64, msgspec.Meta(description="Lookups still waiting for their adopt.")] = 0
    state: Annotated[Text, msgspec.Meta(
        description="The state: msgpack, zlib-compressed, base64 (see kvtrace.analysis.snapshot).")] = ""
