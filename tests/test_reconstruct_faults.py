"""Each fault class, injected alone into a warmed cache, gives its reason at the right boundary.

Scenarios are written as event streams by hand so each expectation can be read off the test:
a first request commits state for a shared prefix, a fault is injected, a second request looks
the prefix up and adopts what the engine chose.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvtrace.analysis.evaluate import Policy
from kvtrace.analysis.reconstruct import Reconstructor, reconstruct
from kvtrace.schema import ComponentKind, Event, EventKind, Reason, Tier
from kvtrace.schema.recipes import BUILTIN, Recipe, RecipeError, load_recipe
from kvtrace.schema.verdicts import GapReason, LookupResult, Verdict, classify

PROMPT = 1024 + 7  # 1031 tokens: the engine must compute at least the last one


@dataclass
class Scenario:
    recipe: Recipe
    tenant: str = "t1"
    revision: str = "r1"
    events: list[Event] = field(default_factory=list)
    clock: int = 1_000

    def ev(self, **kw: object) -> Event:
        self.clock += 1
        base = dict(ts_ns=self.clock, source_id=7, seq=self.clock, instance="i0", model="m",
                    model_revision=self.revision, tenant=self.tenant)
        base.update(kw)
        e = Event(**base)  # type: ignore[arg-type]
        self.events.append(e)
        return e

    def keys(self, group_id: int, tokens: int = PROMPT) -> list[int]:
        g = self.recipe.groups[group_id]
        return [(group_id + 1) * 10_000 + i + 1 for i in range(tokens // g.block_size)]

    def chains(self) -> list[list[int]]:
        return [self.keys(g.group_id) for g in self.recipe.groups]

    def commit_all(self, upto: int = 1024, tier: Tier = Tier.DEVICE, skip: set[tuple[int, int]] = frozenset(),
                   **identity: object) -> None:
        """Commit every block each group would keep for a prompt prefix of `upto` tokens."""
        for g in self.recipe.groups:
            b = g.block_size
            for i, key in enumerate(self.keys(g.group_id, upto)):
                if (g.group_id, i) in skip:
                    continue
                common = dict(component=g.component, group_id=g.group_id, block_key=key,
                              parent_key=key - 1 if i else 0, token_start=i * b, token_end=(i + 1) * b,
                              tier=tier, nbytes=1000 * b)
                common.update(identity)
                self.ev(kind=EventKind.CREATE, **common)
                self.ev(kind=EventKind.COMMIT, **common)

    def lookup_adopt(self, adopt: int | None = None, **kw: object) -> LookupResult:
        self.ev(kind=EventKind.LOOKUP, request_id="b", prompt_tokens=PROMPT, group_block_keys=self.chains(), **kw)
        if adopt is not None:
            self.ev(kind=EventKind.ADOPT, request_id="b", reused_tiers=[Tier.DEVICE], reused_tokens=[adopt],
                    recomputed_tokens=PROMPT - adopt, **kw)
        return max(reconstruct(self.events, self.recipe), key=lambda r: r.seq)  # this lookup's


def block_of(recipe: Recipe, group_id: int, token: int) -> int:
    return token // recipe.groups[group_id].block_size


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_clean_cache_is_a_full_hit(name: str) -> None:
    s = Scenario(BUILTIN[name])
    s.commit_all()
    r = s.lookup_adopt(adopt=1024)
    assert (r.logical_hit_tokens, r.recoverable_hit_tokens, r.resident_hit_tokens) == (1024, 1024, 1024)
    assert r.verdict is Verdict.HIT and r.reason is GapReason.NONE
    assert not r.unsafe_reuse and not r.missed_reuse and r.adopt_seen


def test_missing_block_stops_full_attention_at_the_gap() -> None:
    s = Scenario(BUILTIN["dense"])
    s.commit_all(skip={(0, 20)})  # tokens [320, 336) missing
    r = s.lookup_adopt(adopt=320)
    assert r.logical_hit_tokens == 320  # a hash lookup stops at the first missing key too
    assert r.recoverable_hit_tokens == 320 and r.reason is GapReason.NONE


def test_window_out_of_range() -> None:
    s = Scenario(BUILTIN["sliding-window-hybrid"])  # W = 512, blocks of 16
    s.commit_all(skip={(1, block_of(s.recipe, 1, 800))})  # a window block inside [512, 1024)
    r = s.lookup_adopt(adopt=1024)
    assert r.logical_hit_tokens == 1024
    # every boundary whose window [p-512, p) contains token 800 fails: the best is 800
    assert r.recoverable_hit_tokens == 800
    assert r.reason is GapReason.WINDOW_OUT_OF_RANGE and r.reason_group == 1
    assert r.unsafe_reuse and r.verdict is Verdict.PARTIAL  # the hash hit needs a recompute from 800


def test_old_window_blocks_may_be_gone() -> None:
    s = Scenario(BUILTIN["sliding-window-hybrid"])
    s.commit_all(skip={(1, i) for i in range(0, 20)})  # tokens [0, 320) outside the last window
    r = s.lookup_adopt(adopt=1024)
    assert r.recoverable_hit_tokens == 1024 and r.reason is GapReason.NONE


def test_no_checkpoint_at_boundary() -> None:
    s = Scenario(BUILTIN["mamba-hybrid"])  # checkpoints every 64 tokens
    s.commit_all(skip={(1, 15)})  # no checkpoint at 1024
    r = s.lookup_adopt(adopt=1024)
    assert r.recoverable_hit_tokens == 960
    assert r.reason is GapReason.NO_CHECKPOINT and r.reason_group == 1
    assert r.unsafe_reuse


def test_missing_tail() -> None:
    s = Scenario(BUILTIN["compressed-hybrid"])  # compressed 64, tail 16 (ratio 64), window 128, indexer 64
    # Prefix of 1008 tokens: compressed covers [0, 960), the tail must cover [960, 1008).
    s.commit_all(upto=1008, skip={(1, block_of(s.recipe, 1, 992))})
    r = s.lookup_adopt(adopt=1008)
    assert r.logical_hit_tokens == 1008
    assert r.recoverable_hit_tokens == 992
    assert r.reason is GapReason.MISSING_TAIL and r.reason_group == 1


def test_indexer_out_of_sync_by_missing_block_and_by_generation() -> None:
    s = Scenario(BUILTIN["sparse-indexer"])  # blocks of 64
    s.commit_all(skip={(1, 10)})
    r = s.lookup_adopt(adopt=1024)
    assert r.recoverable_hit_tokens == 640 and r.reason is GapReason.INDEXER_OUT_OF_SYNC

    s = Scenario(BUILTIN["sparse-indexer"])
    s.commit_all()
    s.ev(kind=EventKind.COMMIT, component=ComponentKind.INDEXER, group_id=1, block_key=s.keys(1)[12],
         token_start=768, token_end=832, tier=Tier.DEVICE, nbytes=1, epoch=2)  # rebuilt for another epoch
    r = s.lookup_adopt(adopt=1024, epoch=1)
    assert r.recoverable_hit_tokens == 768 and r.reason is GapReason.INDEXER_OUT_OF_SYNC


def test_prefix_only_on_disk_is_partial_with_restore_bytes() -> None:
    s = Scenario(BUILTIN["dense"])
    s.commit_all()
    for i, key in enumerate(s.keys(0, 1024)):
        if i >= 32:  # tokens [512, 1024) moved to disk and evicted from the device
            s.ev(kind=EventKind.OFFLOAD, component=ComponentKind.FULL_ATTENTION, block_key=key,
                 src_tier=Tier.DEVICE, dst_tier=Tier.DISK, nbytes=16000)
            s.ev(kind=EventKind.EVICT, component=ComponentKind.FULL_ATTENTION, block_key=key,
                 tier=Tier.DEVICE, reason=Reason.CAPACITY)
    r = s.lookup_adopt(adopt=1024)
    assert r.recoverable_hit_tokens == 1024 and r.resident_hit_tokens == 512
    assert r.verdict is Verdict.PARTIAL
    assert r.restore_disk_bytes == 32 * 16000 and r.restore_host_bytes == 0


def test_lease_expired() -> None:
    s = Scenario(BUILTIN["dense"])
    s.commit_all(upto=512)
    s.commit_all(upto=1024, skip={(0, i) for i in range(32)}, lease_expiry_ns=s.clock + 10)
    s.clock += 1_000
    r = s.lookup_adopt(adopt=512)
    assert r.logical_hit_tokens == 1024 and r.recoverable_hit_tokens == 512
    assert r.reason is GapReason.LEASE_EXPIRED and not r.unsafe_reuse


@pytest.mark.parametrize(
    ("field_name", "committed", "requested"),
    [("model_revision", "r1", "r2"), ("adapter", "lora-a", "lora-b"), ("kv_dtype", "bf16", "fp8")],
)
def test_identity_mismatch_names_the_field(field_name: str, committed: str, requested: str) -> None:
    s = Scenario(BUILTIN["dense"])
    s.commit_all(**{field_name: committed})
    r = s.lookup_adopt(adopt=1024, **{field_name: requested})
    assert r.logical_hit_tokens == 1024 and r.recoverable_hit_tokens == 0
    assert r.reason is GapReason.IDENTITY_MISMATCH and field_name in r.reason_detail
    assert r.verdict is Verdict.PARTIAL and r.unsafe_reuse  # a hash hit, none of it usable: not a MISS


def test_tenant_mismatch_and_cross_tenant_reuse() -> None:
    s = Scenario(BUILTIN["dense"], tenant="alice")
    s.commit_all()
    s.tenant = "bob"
    r = s.lookup_adopt(adopt=1024)
    assert r.recoverable_hit_tokens == 0 and r.reason is GapReason.TENANT_MISMATCH
    assert r.cross_tenant and r.unsafe_reuse

    shared = Scenario(BUILTIN["dense"], tenant="public")
    shared.commit_all()
    shared.tenant = "bob"
    shared.ev(kind=EventKind.LOOKUP, request_id="b", prompt_tokens=PROMPT, group_block_keys=shared.chains())
    shared.ev(kind=EventKind.ADOPT, request_id="b", reused_tiers=[Tier.DEVICE], reused_tokens=[1024])
    (r,) = reconstruct(shared.events, shared.recipe, Policy(shared_tenants=frozenset({"public"})))
    assert r.recoverable_hit_tokens == 1024 and not r.unsafe_reuse
    assert r.cross_tenant  # allowed by policy, still made visible


def test_misaligned_boundary() -> None:
    s = Scenario(BUILTIN["mamba-hybrid"])  # alignment 64
    s.commit_all(upto=1024, skip={(0, i) for i in range(63, 64)} | {(1, 15)})
    # full attention reaches 1008 (block 63 = [1008, 1024) is missing), checkpoints up to 960
    r = s.lookup_adopt(adopt=960)
    assert r.logical_hit_tokens == 1008 and r.recoverable_hit_tokens == 960
    assert r.reason is GapReason.MISALIGNED


def test_uncommitted_block() -> None:
    s = Scenario(BUILTIN["dense"])
    s.commit_all(skip={(0, 40)})
    s.ev(kind=EventKind.CREATE, component=ComponentKind.FULL_ATTENTION, block_key=s.keys(0)[40],
         token_start=640, token_end=656, tier=Tier.DEVICE, nbytes=1)
    r = s.lookup_adopt(adopt=640)
    assert r.logical_hit_tokens == 1024 and r.recoverable_hit_tokens == 640
    assert r.reason is GapReason.UNCOMMITTED


@pytest.mark.parametrize(("reason", "gap"), [(Reason.WEIGHT_UPDATE, GapReason.INVALIDATED),
                                             (Reason.ROLLBACK, GapReason.SPECULATIVE_ROLLBACK)])
def test_invalidated_block(reason: Reason, gap: GapReason) -> None:
    s = Scenario(BUILTIN["dense"])
    s.commit_all()
    s.ev(kind=EventKind.INVALIDATE, component=ComponentKind.FULL_ATTENTION, block_key=s.keys(0)[50], reason=reason)
    r = s.lookup_adopt(adopt=800)
    assert r.recoverable_hit_tokens == 800 and r.reason is gap


def test_bulk_invalidation_makes_everything_unrecoverable_until_recommitted() -> None:
    s = Scenario(BUILTIN["dense"])
    s.commit_all()
    s.ev(kind=EventKind.INVALIDATE, reason=Reason.RESET)
    r = s.lookup_adopt(adopt=1024)
    assert r.logical_hit_tokens == 1024 and r.recoverable_hit_tokens == 0
    assert r.reason is GapReason.INVALIDATED and r.unsafe_reuse


def test_checksum_mismatch_on_load() -> None:
    s = Scenario(BUILTIN["dense"])
    s.commit_all(checksum=42)
    key = s.keys(0)[30]
    s.ev(kind=EventKind.OFFLOAD, component=ComponentKind.FULL_ATTENTION, block_key=key, src_tier=Tier.DEVICE,
         dst_tier=Tier.HOST, checksum=42)
    s.ev(kind=EventKind.EVICT, component=ComponentKind.FULL_ATTENTION, block_key=key, tier=Tier.DEVICE,
         reason=Reason.CAPACITY)
    s.ev(kind=EventKind.LOAD, component=ComponentKind.FULL_ATTENTION, block_key=key, src_tier=Tier.HOST,
         dst_tier=Tier.DEVICE, checksum=43)
    # The host copy still matches the commit: the block is recoverable, by reloading it.
    before = s.lookup_adopt(adopt=480)
    assert before.recoverable_hit_tokens == 1024 and before.resident_hit_tokens == 480
    assert before.verdict is Verdict.PARTIAL and before.restore_host_bytes == 16_000
    s.ev(kind=EventKind.EVICT, component=ComponentKind.FULL_ATTENTION, block_key=key, tier=Tier.HOST,
         reason=Reason.CAPACITY)
    r = s.lookup_adopt(adopt=480)
    assert r.recoverable_hit_tokens == 480 and r.reason is GapReason.CHECKSUM_MISMATCH


def test_changed_between_lookup_and_use() -> None:
    s = Scenario(BUILTIN["dense"])
    s.commit_all()
    s.ev(kind=EventKind.LOOKUP, request_id="b", prompt_tokens=PROMPT, group_block_keys=s.chains())
    s.ev(kind=EventKind.EVICT, component=ComponentKind.FULL_ATTENTION, block_key=s.keys(0)[10],
         tier=Tier.DEVICE, reason=Reason.CAPACITY)
    s.ev(kind=EventKind.ADOPT, request_id="b", reused_tiers=[Tier.DEVICE], reused_tokens=[1024])
    (r,) = reconstruct(s.events, s.recipe)
    assert r.recoverable_hit_tokens == 160
    assert r.reason is GapReason.CHANGED_BEFORE_USE and r.reason_detail == GapReason.MISSING_BLOCK.value
    assert r.unsafe_reuse


def test_missed_reuse_when_engine_adopts_less() -> None:
    s = Scenario(BUILTIN["dense"])
    s.commit_all()
    r = s.lookup_adopt(adopt=256)
    assert r.missed_reuse and not r.unsafe_reuse


def test_lookup_without_adopt_and_bounded_pending() -> None:
    s = Scenario(BUILTIN["dense"])
    s.commit_all(upto=64)
    for i in range(5):
        s.ev(kind=EventKind.LOOKUP, request_id=f"q{i}", prompt_tokens=PROMPT, group_block_keys=s.chains())
    rec = Reconstructor(s.recipe, max_pending=2)
    results = list(rec.run(s.events))
    assert len(results) == 5 and rec.pending_overflow == 3
    assert all(not r.adopt_seen and r.recoverable_hit_tokens == 64 for r in results)


def test_state_memory_is_bounded_by_live_objects() -> None:
    s = Scenario(BUILTIN["dense"])
    for _ in range(50):
        s.commit_all(upto=256)
        for key in s.keys(0, 256):
            s.ev(kind=EventKind.EVICT, component=ComponentKind.FULL_ATTENTION, block_key=key,
                 tier=Tier.DEVICE, reason=Reason.CAPACITY)
    rec = Reconstructor(s.recipe)
    list(rec.run(s.events))
    assert rec.state.object_count() == 0


def test_recipes_validate_and_load(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert BUILTIN["compressed-hybrid"].alignment == 16
    path = tmp_path / "r.json"
    path.write_text('{"name": "x", "groups": [{"group_id": 0, "component": "sliding_window", "block_size": 16}]}')
    with pytest.raises(RecipeError, match="window"):
        load_recipe(str(path))
    with pytest.raises(RecipeError, match="no built-in recipe"):
        load_recipe("nope")
    toml = tmp_path / "r.toml"
    toml.write_text('name = "y"\n[[groups]]\ngroup_id = 0\ncomponent = "full_attention"\nblock_size = 32\n')
    assert load_recipe(str(toml)).alignment == 32


def test_funnel_and_reasons_frames() -> None:
    from kvtrace.analysis.funnel import funnel, reasons, restore_bytes, results_frame

    s = Scenario(BUILTIN["mamba-hybrid"])
    s.commit_all(skip={(1, 15)})
    s.ev(kind=EventKind.LOOKUP, request_id="b", prompt_tokens=PROMPT, group_block_keys=s.chains())
    s.ev(kind=EventKind.ADOPT, request_id="b", reused_tiers=[Tier.DEVICE], reused_tokens=[1024])
    s.ev(kind=EventKind.LOOKUP, request_id="c", prompt_tokens=PROMPT, group_block_keys=[[1], [2]])
    s.ev(kind=EventKind.ADOPT, request_id="c", recomputed_tokens=PROMPT)
    frame = results_frame(reconstruct(s.events, s.recipe))
    f = funnel(frame).row(0, named=True)
    assert f["lookups"] == 2 and f["prompt_tokens"] == 2 * PROMPT
    assert f["logical_token_rate"] == pytest.approx(1024 / (2 * PROMPT))
    assert f["recoverable_token_rate"] == pytest.approx(960 / (2 * PROMPT))
    assert f["recoverable_request_rate"] == 0.5 and f["unsafe_reuse"] == 1
    by_model = funnel(frame, by=["model"], bucket_ns=10**9)
    assert by_model.height == 1
    r = reasons(frame).row(0, named=True)
    assert r["reason"] == GapReason.NO_CHECKPOINT.value and r["tokens_lost"] == 64
    assert restore_bytes(frame).row(0) == (0, 0, 0)


@pytest.mark.parametrize(
    ("logical", "aligned", "recoverable", "resident", "verdict"),
    [
        (0, 0, 0, 0, Verdict.MISS),  # no hash hit
        (512, 512, 512, 512, Verdict.HIT),  # the whole hit, on the device
        (520, 512, 512, 512, Verdict.HIT),  # short only by the tail no group can resume at
        (512, 512, 288, 288, Verdict.PARTIAL),  # 224 tokens to recompute
        (512, 512, 0, 0, Verdict.PARTIAL),  # a hash hit, entirely unusable
        (512, 512, 512, 256, Verdict.PARTIAL),  # all there, half of it on a lower tier
    ],
)
def test_verdict_words_answer_was_the_hash_hit_usable_as_is(
    logical: int, aligned: int, recoverable: int, resident: int, verdict: Verdict
) -> None:
    assert classify(logical, aligned, recoverable, resident) is verdict
