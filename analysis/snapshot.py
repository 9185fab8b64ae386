"""The streaming reconstructor's state as a stored row, and back.

A snapshot is what an analysis of a time range needs from before it: live objects with their
last facts, the scopes of bulk invalidations, the lookups still waiting for their adopt, and
the recipes engines published. Its size follows the live cache, not the history. It is plain
typed data (msgpack through msgspec, decoded into the same types), never pickled: a stored row
must not be able to run code in the reader.

A snapshot holds for the given recipes and policy it was built with (pending lookups were
judged by them), so each carries a fingerprint of both and a run uses only its own.
"""

from __future__ import annotations

import base64
import hashlib
import time
import zlib
from typing import NamedTuple

import msgspec

from kvtrace.analysis.evaluate import Policy
from kvtrace.analysis.native_state import NativeState
from kvtrace.analysis.packed import PackedObjects, pack, unpack_into
from kvtrace.analysis.reconstruct import Reconstructor, ReconstructorState
from kvtrace.schema.events import Event
from kvtrace.schema.recipes import Recipe, RecipeBook
from kvtrace.schema.records import StateSnapshot


class _Packed(msgspec.Struct, array_like=True, gc=False):
    """The stored form: the reconstructor's state without its objects, and the objects packed."""

    rest: ReconstructorState
    objects: PackedObjects


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(_Packed)
_DECODER_V2 = msgspec.msgpack.Decoder(ReconstructorState)  # snapshots before the objects were packed
# Leads the payload: a later layout changes it, and a reader refuses one it does not know. kvts3
# packs the objects (analysis.packed); kvts2, every object a msgpack array, is still read.
FORMAT = b"kvts3"
_V2 = b"kvts2"


class SnapshotError(ValueError):
    """A stored snapshot this kvtrace cannot read; the message says which and why."""


def fingerprint(recipes: RecipeBook | Recipe | None, policy: Policy) -> str:
    """Names the given recipes and policy a snapshot holds for (not the engines' own recipes:
    those are in the snapshot itself)."""
    book = RecipeBook.of(recipes)
    given = sorted((name, _ENCODER.encode(r)) for name, r in book.scoped.items())
    default = _ENCODER.encode(book.default) if book.default is not None else b""
    rules: tuple[object, ...] = (sorted(policy.shared_tenants), policy.keep_one_token, sorted(policy.stores))
    if policy.fleet:  # named only when on, so the snapshots of runs without it keep their fingerprint
        rules = (*rules, "fleet")
    return hashlib.sha256(_ENCODER.encode([given, default, rules])).hexdigest()[:16]


class Position(NamedTuple):
    """An event's place in the stream (what a snapshot is keyed by)."""

    ts_ns: int
    source_id: int
    seq: int


def take(rec: Reconstructor, last: Event | Position, print_: str) -> StateSnapshot:
    """The reconstructor's state after `last`, the last event it was fed, as a row."""
    state = rec.state
    objects = state.pack() if isinstance(state, NativeState) else pack(state)
    captured = rec.capture(objects=False)
    payload = FORMAT + zlib.compress(_ENCODER.encode(_Packed(captured, objects)), 1)
    return StateSnapshot(
        ts_ns=last.ts_ns, source_id=last.source_id, seq=last.seq, events=rec.events_seen, fingerprint=print_,
        created_ns=time.time_ns(), objects=state.object_count(), pending=len(captured.pending),
        state=base64.b64encode(payload).decode("ascii"),
    )


def resume(row: StateSnapshot, recipes: RecipeBook | Recipe | None, policy: Policy) -> Reconstructor:
    """A reconstructor that goes on after the snapshot's position."""
    if row.fingerprint != fingerprint(recipes, policy):
        raise SnapshotError(f"snapshot at {row.ts_ns} was built with other recipes or policy ({row.fingerprint})")
    try:
        payload = base64.b64decode(row.state, validate=True)
        if payload.startswith(_V2):
            return Reconstructor.resume(_DECODER_V2.decode(zlib.decompress(payload[len(_V2):])), recipes, policy)
        if not payload.startswith(FORMAT):
            raise SnapshotError(f"snapshot at {row.ts_ns}: unknown format {payload[:5]!r} (this kvtrace reads "
                                f"{FORMAT!r} and {_V2!r}); it is ignored and the history read instead")
        stored = _DECODER.decode(zlib.decompress(payload[len(FORMAT):]))
        rec = Reconstructor.resume(stored.rest, recipes, policy)
        if isinstance(rec.state, NativeState):
            rec.state.unpack(stored.objects)
        else:
            unpack_into(rec.state, stored.objects)
        return rec
    except (ValueError, zlib.error, msgspec.DecodeError) as exc:
        if isinstance(exc, SnapshotError):
            raise
        raise SnapshotError(f"snapshot at {row.ts_ns} does not decode: {exc}") from None
