"""The KV-event bridge: kvtrace events from the ZMQ KV-event stream vLLM (and SGLang) publish.

For engines users cannot modify. The publisher sends multipart frames `[topic, seq (8 bytes,
big-endian), msgpack payload]`; the payload is `[ts, events, data_parallel_rank]`, each event a
map tagged by `type`: `BlockStored`, `BlockRemoved`, `AllBlocksCleared`. The bridge decodes them
with its own typed structs (vLLM need not be installed), detects sequence gaps and asks the
publisher's replay socket (ROUTER) for the missing batches, and counts what it could not get.

What the stream cannot say: lookups and adopts (use the in-process shim for those), and which
physical copy a removal refers to. vLLM does not de-duplicate blocks, so the same key can be
stored twice and removed twice; the bridge counts references per key and reports an eviction
when the last one goes, as the shim does.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvtrace.instrumentation.api import Emitter
from kvtrace.instrumentation.identity import Identity
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import ComponentKind, EventKind, Reason, Tier

log = logging.getLogger("kvtrace.kv_events")
_MASK = (1 << 64) - 1
END_SEQ = (-1).to_bytes(8, "big", signed=True)

Hash = int | bytes


class _Stored(msgspec.Struct, tag="BlockStored", omit_defaults=True):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None = None
    token_ids: list[Any] = []  # ints; SGLang's EAGLE pages publish [token, next token] pairs
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    cache_salt: str | None = None  # SGLang: the request's namespace (kvtrace's tenant)


class _Removed(msgspec.Struct, tag="BlockRemoved", omit_defaults=True):
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    data_parallel_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(_Batch)

TIER_OF_MEDIUM = {None: Tier.DEVICE, "GPU": Tier.DEVICE, "CPU": Tier.HOST, "CPU_PINNED": Tier.HOST,
                  "STORAGE": Tier.DISK, "DISK": Tier.DISK, "EXTERNAL": Tier.REMOTE}
"""Publishers' storage media (vLLM's and SGLang's names) as kvtrace tiers."""
COMPONENT_OF_KIND = {"full_attention": ComponentKind.FULL_ATTENTION, "sliding_window": ComponentKind.SLIDING_WINDOW,
                     "mamba": ComponentKind.MAMBA, "mla_attention": ComponentKind.FULL_ATTENTION,
                     "cross_attention": ComponentKind.CROSS_ATTENTION}


def key_of(h: Hash) -> int:
    """kvtrace key of a published hash: ints (possibly signed) and bytes alike, low 64 bits."""
    if isinstance(h, bytes):
        return (int.from_bytes(h[-8:], "big") & _MASK) or 1
    return (h & _MASK) or 1


@dataclass
class KvEventTranslator:
    """Pure translation of decoded batches into kvtrace events, with per-key reference counts."""

    identity: Identity = Identity()
    engine: str = ""  # what published the stream (vllm, sglang); the wire format does not say
    refs: dict[tuple[Tier, int, int], int] = field(default_factory=dict)
    components: dict[int, ComponentKind] = field(default_factory=dict)  # learned from store events
    unknown_media: int = 0  # events skipped because their medium names no known tier

    def translate(self, payload: bytes) -> list[Event]:
        batch = _DECODER.decode(payload)
        ident = self.identity
        base = Event(kind=EventKind.COMMIT, engine=self.engine, instance=ident.instance, model=ident.model,
                     model_revision=ident.model_revision, kv_dtype=ident.kv_dtype, tenant=ident.default_tenant)
        ts = int(batch.ts * 1e9)
        out: list[Event] = []
        for ev in batch.events:
            if isinstance(ev, _Cleared):
                self.refs.clear()
                out.append(msgspec.structs.replace(base, kind=EventKind.INVALIDATE, reason=Reason.RESET, ts_ns=ts))
                continue
            tier = TIER_OF_MEDIUM.get(ev.medium)
            if tier is None:  # guessing a tier would put the block where it is not
                self.unknown_media += 1
                if self.unknown_media == 1:
                    log.warning("kvtrace bridge: medium %r names no known tier; such events are skipped and counted",
                                ev.medium)
                continue
            group = ev.group_idx or 0
            keys = [key_of(h) for h in ev.block_hashes]
            if isinstance(ev, _Stored):
                component = COMPONENT_OF_KIND.get(ev.kv_cache_spec_kind or "", ComponentKind.FULL_ATTENTION)
                self.components[group] = component
                for k in keys:
                    self.refs[(tier, group, k)] = self.refs.get((tier, group, k), 0) + 1
                if keys:
                    out.append(msgspec.structs.replace(
                        base, kind=EventKind.COMMIT, ts_ns=ts, component=component, group_id=group,
                        block_size=ev.block_size, block_key=keys[0], more_keys=keys[1:], tier=tier,
                        adapter=ev.lora_name or "", tenant=ev.cache_salt or base.tenant))
            else:
                gone = []
                for k in keys:
                    n = self.refs.get((tier, group, k), 0) - 1
                    if n > 0:
                        self.refs[(tier, group, k)] = n
                    else:
                        self.refs.pop((tier, group, k), None)
                        gone.append(k)
                if gone:
                    out.append(msgspec.structs.replace(
                        base, kind=EventKind.EVICT, ts_ns=ts, group_id=group, tier=tier, reason=Reason.CAPACITY,
                        component=self.components.get(group, ComponentKind.FULL_ATTENTION),
                        block_key=gone[0], more_keys=gone[1:]))
        return out


@dataclass
class BridgeStats:
    batches: int = 0
    events: int = 0
    gaps: int = 0  # times a sequence number was skipped
    recovered: int = 0  # batches fetched back from the replay socket
    lost: int = 0  # batches neither received nor recovered


class KvEventBridge:
    """Subscribes to one publisher and emits what it publishes; `poll()` handles what arrived."""

    def __init__(self, endpoint: str, emitter: Emitter, identity: Identity = Identity(), topic: str = "",
                 replay_endpoint: str | None = None, bind: bool = False, expect_seq: int | None = None,
                 engine: str = "") -> None:
        import zmq

        self._zmq = zmq
        self.emitter = emitter
        self.translator = KvEventTranslator(identity, engine)
        self.stats = BridgeStats()
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        (self._sub.bind if bind else self._sub.connect)(endpoint)
        self._replay_endpoint = replay_endpoint
        self._next_seq = expect_seq  # None: accept whatever comes first

    def poll(self, timeout_ms: int = 100, max_batches: int = 10_000) -> int:
        """Process batches that arrive within the timeout; returns how many were handled."""
        handled = 0
        while handled < max_batches and self._sub.poll(timeout_ms if handled == 0 else 0):
            _, seq_bytes, payload = self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if self._next_seq is not None and seq > self._next_seq:
                self.stats.gaps += 1
                self._recover(self._next_seq, seq)
            if self._next_seq is None or seq >= self._next_seq:
                self._handle(payload)
                self._next_seq = seq + 1
            handled += 1
        return handled

    def _handle(self, payload: bytes) -> None:
        try:
            events = self.translator.translate(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("kvtrace bridge: undecodable KV-event batch skipped: %s", exc)
            return
        self.stats.batches += 1
        self.stats.events += len(events)
        for event in events:
            self.emitter.emit(event)

    def _recover(self, start: int, stop: int) -> None:
        """Ask the replay socket for batches [start, stop); count what does not come back."""
        got = set()
        if self._replay_endpoint is not None:
            sock = self._ctx.socket(self._zmq.DEALER)
            try:
                sock.connect(self._replay_endpoint)
                sock.send_multipart((b"", start.to_bytes(8, "big")))
                while sock.poll(2000):
                    frames = sock.recv_multipart()
                    _, _topic, seq_bytes, payload = frames[-4:] if len(frames) >= 4 else (b"", b"", END_SEQ, b"")
                    if seq_bytes == END_SEQ:
                        break
                    seq = int.from_bytes(seq_bytes, "big")
                    if start <= seq < stop and seq not in got:
                        self._handle(payload)
                        got.add(seq)
            finally:
                sock.close(linger=0)
        self.stats.recovered += len(got)
        self.stats.lost += (stop - start) - len(got)

    def close(self) -> None:
        self._sub.close(linger=0)


def translate_all(payloads: Iterable[bytes], identity: Identity = Identity(), engine: str = "vllm") -> list[Event]:
    """Translate a sequence of payloads in order (for tests and offline captures)."""
    translator = KvEventTranslator(identity, engine)
    return [e for p in payloads for e in translator.translate(p)]
