"""The KV-event bridge's translation, on hand-built payloads in the wire format vLLM and SGLang
share (the real publisher is tested in tests/engines/vllm)."""

from __future__ import annotations

import msgspec
import pytest

from kvtrace.instrumentation.kv_events import KvEventTranslator, key_of, translate_all
from kvtrace.instrumentation.vllm.shim import Identity
from kvtrace.schema import ComponentKind, EventKind, Reason, Tier


def payload(*events: dict, ts: float = 1.5) -> bytes:
    return msgspec.msgpack.encode([ts, list(events), 0])


def stored(hashes: list, **kw: object) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": [],
            "block_size": 16, "lora_id": None, "medium": None, "lora_name": None, **kw}


def removed(hashes: list, **kw: object) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": None, **kw}


def test_runs_tiers_groups_and_components() -> None:
    (commit,) = translate_all([payload(stored([11, 12, 13], group_idx=1, kv_cache_spec_kind="sliding_window",
                                              medium="CPU_PINNED", lora_name="a"))], Identity(instance="i", model="m"))
    assert commit.kind is EventKind.COMMIT and (commit.block_key, commit.more_keys) == (11, [12, 13])
    assert (commit.tier, commit.group_id, commit.component) == (Tier.HOST, 1, ComponentKind.SLIDING_WINDOW)
    assert (commit.adapter, commit.instance, commit.model, commit.ts_ns) == ("a", "i", "m", 1_500_000_000)


def test_signed_and_bytes_hashes_map_to_the_same_keys_as_the_shim() -> None:
    assert key_of(-1) == 2**64 - 1  # SGLang publishes signed 64-bit hashes
    assert key_of(b"\x00" * 24 + (5).to_bytes(8, "big")) == 5  # raw digests: the low 64 bits
    assert key_of(0) == 1  # 0 means "every block" on invalidate: never a block key


def test_a_key_stored_twice_is_evicted_when_its_last_copy_goes() -> None:
    t = KvEventTranslator()
    assert [e.kind for e in t.translate(payload(stored([7]), stored([7])))] == [EventKind.COMMIT] * 2
    assert t.translate(payload(removed([7]))) == []  # one copy left
    (evict,) = t.translate(payload(removed([7])))
    assert (evict.kind, evict.block_key, evict.reason) == (EventKind.EVICT, 7, Reason.CAPACITY)
    (evict,) = t.translate(payload(removed([99])))  # never seen stored: reported, not ignored
    assert evict.block_key == 99


def test_clear_resets_counts_and_invalidates() -> None:
    t = KvEventTranslator()
    t.translate(payload(stored([1, 2])))
    (cleared,) = t.translate(payload({"type": "AllBlocksCleared"}))
    assert (cleared.kind, cleared.reason, cleared.block_key) == (EventKind.INVALIDATE, Reason.RESET, 0)
    assert t.refs == {}


@pytest.mark.parametrize("bad", [b"\xc1", msgspec.msgpack.encode([1.0, [{"type": "BlockMoved"}], 0])])
def test_undecodable_payloads_are_refused_with_the_reason(bad: bytes) -> None:
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError), match=r".+"):
        KvEventTranslator().translate(bad)


def test_sglang_shaped_batches_keep_namespace_tiers_and_engine() -> None:
    """What SGLang publishes that vLLM does not: a cache salt (kvtrace's tenant), EAGLE pages whose
    token ids are [token, next token] pairs, and its storage media DISK and EXTERNAL."""
    translator = KvEventTranslator(Identity(instance="sg", model="m"), engine="sglang")
    events = translator.translate(payload(
        stored([1, 2], cache_salt="acme"),
        stored([3], token_ids=[[5, 6], [6, 7]]),  # one EAGLE page: the whole batch must still decode
        stored([4], medium="DISK"),
        stored([5], medium="EXTERNAL"),
        stored([6], medium="NVME_OF_THE_FUTURE"),  # no such tier: skipped and counted, never guessed
    ))
    assert [(e.block_key, e.tier, e.tenant) for e in events] == [
        (1, Tier.DEVICE, "acme"), (3, Tier.DEVICE, ""), (4, Tier.DISK, ""), (5, Tier.REMOTE, "")]
    assert {e.engine for e in events} == {"sglang"} and translator.unknown_media == 1
