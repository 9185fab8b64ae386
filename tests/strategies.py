"""Hypothesis strategies and seeded generators for valid kvtrace events.

Importable from any test module (`from strategies import events`): pytest puts this directory
on sys.path because tests/ is not a package.

Validity follows `kvtrace.schema.validation.problems`: the fields `REQUIRED_BY_KIND` names are
non-empty, evict / invalidate reasons come from their sets, token_end >= token_start,
reused_tiers and reused_tokens have equal length, a lookup's reported hit fits its prompt, and
every integer is inside its column's range.
"""

from __future__ import annotations

import random
import string
from typing import Any

from hypothesis import strategies as st

from kvtrace.schema.events import REQUIRED_BY_KIND, SCHEMA_VERSION, Event
from kvtrace.schema.kinds import (
    EVICT_REASONS,
    INVALIDATE_REASONS,
    ComponentKind,
    EventKind,
    Reason,
    Tier,
    Transform,
)
from kvtrace.schema.recipes import BUILTIN, recipe_json

U16 = st.integers(0, 2**16 - 1)
U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
NONZERO_U64 = st.integers(1, 2**64 - 1)
NONNEG_I64 = st.integers(0, 2**63 - 1)
TS_NS = st.integers(1, 2**63 - 1)
# Measurements: finite and not negative (validation refuses the rest).
FLOAT = st.floats(0.0, 1e300, allow_nan=False, allow_infinity=False)

# ClickHouse partitions events by day and refuses an insert that touches more than 100
# partitions, so tests that store events keep their timestamps inside a few days.
DAY_NS = 86_400 * 10**9
STORE_TS_BASE = 1_750_000_000 * 10**9  # 2025-06-15
STORE_TS_NS = st.integers(STORE_TS_BASE, STORE_TS_BASE + 3 * DAY_NS)

# Any Unicode text (hypothesis leaves out lone surrogates, which no UTF-8 format can carry).
TEXT = st.text(max_size=12)
LABEL = st.one_of(st.sampled_from(["", "vllm", "sglang", "demo-0", "llama-3-8b"]), TEXT)

COMPONENTS = [c for c in ComponentKind if c is not ComponentKind.NONE]
TIERS = [t for t in Tier if t is not Tier.NONE]
KINDS = st.sampled_from(list(EventKind))
_EVICT = sorted(EVICT_REASONS)
_INVALIDATE = sorted(INVALIDATE_REASONS)


# Fields any kind may carry; each is left at its default or drawn from its full range.
_OPTIONAL: dict[str, st.SearchStrategy[Any]] = {
    "engine": LABEL,
    "engine_version": LABEL,
    "instance": LABEL,
    "dp_rank": U16,
    "tp_rank": U16,
    "pp_rank": U16,
    "model": LABEL,
    "model_revision": LABEL,
    "adapter": LABEL,
    "tenant": LABEL,
    "transform": st.sampled_from(list(Transform)),
    "kv_dtype": LABEL,
    "layout": LABEL,
    "block_size": U32,
    "epoch": U64,
    "component": st.sampled_from(list(ComponentKind)),
    "group_id": U16,
    "block_key": U64,
    "parent_key": U64,
    "tier": st.sampled_from(list(Tier)),
    "nbytes": U64,
    "lease_expiry_ns": NONNEG_I64,
    "checksum": U64,
    "src_tier": st.sampled_from(list(Tier)),
    "dst_tier": st.sampled_from(list(Tier)),
    "duration_ns": NONNEG_I64,
    "in_flight": st.booleans(),
    "reason": st.sampled_from(list(Reason)),
    "request_id": TEXT,
    "prompt_tokens": U32,
    "group_block_keys": st.lists(st.lists(U64, max_size=4), max_size=3),
    "group_hit_tokens": st.lists(U32, max_size=3),
    "reported_hit_tokens": U32,
    "preemptions": U32,
    "computed_before_preemption": U32,
    "recomputed_tokens": U32,
    "probe_of": TEXT,
    "probe_positions": U32,
    "probe_max_abs_diff": FLOAT,
    "probe_mean_kl": FLOAT,
    "probe_max_kl": FLOAT,
    "probe_first_token_differs": st.booleans(),
    "noise_floor": FLOAT,
}

# Strategies for the fields a kind requires: never their empty default.
_REQUIRED: dict[str, st.SearchStrategy[Any]] = {
    "component": st.sampled_from(COMPONENTS),
    "block_key": NONZERO_U64,
    "tier": st.sampled_from(TIERS),
    "src_tier": st.sampled_from(TIERS),
    "dst_tier": st.sampled_from(TIERS),
    "request_id": st.text(min_size=1, max_size=16),
    "prompt_tokens": st.integers(1, 2**32 - 1),
    "probe_of": st.text(min_size=1, max_size=16),
    "engine": st.sampled_from(["vllm", "sglang", "lmcache", "sim"]),
    "model": st.text(min_size=1, max_size=16),
    "recipe": st.sampled_from([recipe_json(r) for r in BUILTIN.values()]),
}


@st.composite
def events(
    draw: st.DrawFn,
    kinds: st.SearchStrategy[EventKind] = KINDS,
    ts_ns: st.SearchStrategy[int] = TS_NS,
    source_id: st.SearchStrategy[int] = NONZERO_U64,
    seq: st.SearchStrategy[int] = U64,
) -> Event:
    """One valid event of any kind (or of the kinds `kinds` draws)."""
    kind = draw(kinds)
    fields: dict[str, Any] = draw(st.fixed_dictionaries({}, optional=_OPTIONAL))
    for name in REQUIRED_BY_KIND[kind]:
        if name == "reason":
            continue
        fields[name] = draw(_REQUIRED[name])
    if kind is EventKind.EVICT:
        fields["reason"] = draw(st.sampled_from(_EVICT))
    elif kind is EventKind.INVALIDATE:
        fields["reason"] = draw(st.sampled_from(_INVALIDATE))
    start, end = sorted((draw(U32), draw(U32)))
    if draw(st.booleans()):
        fields["token_start"], fields["token_end"] = start, end
    reused = draw(st.lists(st.tuples(st.sampled_from(TIERS), U32), max_size=4))
    fields["reused_tiers"] = [t for t, _ in reused]
    fields["reused_tokens"] = [n for _, n in reused]
    if kind is EventKind.LOOKUP:
        fields["reported_hit_tokens"] = draw(st.integers(0, fields["prompt_tokens"]))
    return Event(
        kind=kind,
        ts_ns=draw(ts_ns),
        source_id=draw(source_id),
        seq=draw(seq),
        **fields,
    )


def stored_events(max_size: int = 200) -> st.SearchStrategy[list[Event]]:
    """Lists of valid events fit for one ClickHouse insert: distinct ids, a few days of time."""
    return st.lists(
        events(ts_ns=STORE_TS_NS),
        min_size=1,
        max_size=max_size,
        unique_by=lambda e: (e.source_id, e.seq),
    )


def event_key(event: Event) -> tuple[int, int, int]:
    """Stream order, as the store returns events."""
    return (event.ts_ns, event.source_id, event.seq)


# -- seeded generation (no hypothesis): many varied events fast --------------------------------

_ALPHABET = string.ascii_letters + string.digits + "-_./:é漢字 \"'\\\n\t\x00"


def _text(rng: random.Random, lo: int = 0, hi: int = 10) -> str:
    return "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(lo, hi)))


def seeded_events(n: int, seed: int = 0, sources: int = 4, ts_base: int = STORE_TS_BASE) -> list[Event]:
    """`n` valid events of every kind with distinct (source_id, seq), stream-ordered per source.

    Values cover each field's extremes (0 and the uint64 maximum), non-ASCII text, NUL bytes,
    nested lists and every enum member.
    """
    rng = random.Random(seed)
    # The extremes of the id range, then random ids (distinct with overwhelming odds).
    source_ids = [1, 2**64 - 1, *(rng.getrandbits(63) + 2 for _ in range(max(0, sources - 2)))][:sources]
    next_seq = dict.fromkeys(source_ids, 0)
    instances = [_text(rng, 1, 8) for _ in range(3)] + [""]
    kinds = list(EventKind)
    out = []
    for i in range(n):
        src = source_ids[i % len(source_ids)]
        seq = next_seq[src]
        next_seq[src] += 1
        kind = kinds[i % len(kinds)] if i < 2 * len(kinds) else rng.choice(kinds)

        def u(bits: int) -> int:
            return rng.choice([0, 1, 2**bits - 1, rng.getrandbits(bits)])

        start = rng.randint(0, 10_000)
        f: dict[str, Any] = dict(
            instance=rng.choice(instances),
            engine=rng.choice(["vllm", "sglang", "", _text(rng)]),
            model=_text(rng),
            tenant=rng.choice(["", "t1", _text(rng)]),
            transform=rng.choice(list(Transform)),
            dp_rank=u(16),
            tp_rank=u(16),
            block_size=u(32),
            epoch=u(64),
            group_id=u(16),
            component=rng.choice(COMPONENTS),
            block_key=u(64) or 1,
            parent_key=u(64),
            token_start=start,
            token_end=start + rng.randint(0, 512),
            tier=rng.choice(TIERS),
            nbytes=u(64),
            lease_expiry_ns=rng.choice([0, 2**63 - 1, ts_base + rng.getrandbits(40)]),
            checksum=u(64),
            duration_ns=rng.choice([0, 2**63 - 1, rng.getrandbits(40)]),
            in_flight=rng.random() < 0.3,
        )
        if kind in (EventKind.OFFLOAD, EventKind.LOAD):
            f["src_tier"], f["dst_tier"] = rng.sample(TIERS, 2)
        if kind is EventKind.EVICT:
            f["reason"] = rng.choice(_EVICT)
        elif kind is EventKind.INVALIDATE:
            f["reason"] = rng.choice(_INVALIDATE)
        if kind in (EventKind.LOOKUP, EventKind.ADOPT):
            f["request_id"] = f"req-{i}-{_text(rng, 0, 6)}"
            prompt = rng.randint(1, 2**32 - 1) if rng.random() < 0.1 else rng.randint(1, 8192)
            f["prompt_tokens"] = prompt
            groups = rng.randint(0, 3)
            f["group_block_keys"] = [[u(64) for _ in range(rng.randint(0, 5))] for _ in range(groups)]
            f["group_hit_tokens"] = [rng.randint(0, prompt) for _ in range(groups)]
            f["reported_hit_tokens"] = rng.randint(0, prompt)
            f["preemptions"] = rng.choice([0, 0, 0, 1, u(32)])
            f["computed_before_preemption"] = rng.randint(0, prompt) if f["preemptions"] else 0
        if kind is EventKind.ADOPT:
            tiers = rng.sample(TIERS, rng.randint(0, len(TIERS)))
            f["reused_tiers"] = tiers
            f["reused_tokens"] = [u(32) for _ in tiers]
            f["recomputed_tokens"] = u(32)
        if kind is EventKind.PROBE:
            f["request_id"] = f"kvtrace-verify-{i}"
            f["probe_of"] = f"req-{i}-{_text(rng, 0, 6)}"
            f["prompt_tokens"] = rng.randint(1, 8192)
            f["reported_hit_tokens"] = rng.randint(0, f["prompt_tokens"])
            f["probe_positions"] = u(32)
            f["probe_max_abs_diff"] = rng.choice([0.0, 1e-300, 1e300, rng.random() * 20])
            f["probe_mean_kl"] = rng.random()
            f["probe_max_kl"] = rng.choice([0.0, rng.random() * 5])
            f["probe_first_token_differs"] = rng.random() < 0.5
            f["noise_floor"] = rng.choice([0.0, rng.random() * 1e-3])
        if kind is EventKind.ATTACH:
            f["engine"] = rng.choice(["vllm", "sglang", "lmcache", "sim"])
            f["model"] = f["model"] or "m"
            f["engine_version"] = rng.choice(["", "0.32.0", _text(rng)])
            f["max_model_len"] = u(32)
            f["recipe"] = recipe_json(rng.choice(list(BUILTIN.values())))
        jump = rng.randint(0, 2) * DAY_NS if rng.random() < 0.05 else 0  # a few events days later
        ts = ts_base + seq * 1_000 + rng.randint(0, 999) + jump
        out.append(Event(kind=kind, ts_ns=ts, source_id=src, seq=seq, **f))
    return out


# Values at and past the edges of what `problems` accepts, for the fields its rules read.
EDGES: dict[str, st.SearchStrategy] = {
    "schema_version": st.sampled_from([0, 1, SCHEMA_VERSION, SCHEMA_VERSION + 1]),
    "ts_ns": st.sampled_from([-1, 0, 1, 2**63 - 1, 2**63]),
    "lease_expiry_ns": st.sampled_from([-1, 0, 2**63 - 1, 2**63]),
    "duration_ns": st.sampled_from([-1, 0, 2**63 - 1, 2**63]),
    "source_id": st.sampled_from([0, 1]),
    "token_start": st.integers(0, 64),
    "token_end": st.integers(0, 64),
    "block_key": st.sampled_from([0, 7]),
    "more_keys": st.sampled_from([[], [3], [0, 3]]),
    "reason": st.sampled_from(list(Reason)),
    "reported_hit_tokens": st.integers(0, 128),
    "prompt_tokens": st.integers(0, 128),
    "reused_tokens": st.sampled_from([[], [1], [1, 2]]),
    "request_id": st.sampled_from(["", "r"]),
    "probe_of": st.sampled_from(["", "r"]),
    "component": st.sampled_from([ComponentKind.NONE, ComponentKind.MAMBA]),
    "tier": st.sampled_from([Tier.NONE, Tier.HOST]),
    "probe_max_abs_diff": st.sampled_from([0.0, -0.0, 1.5, -1e-9, float("nan"), float("inf")]),
    "probe_mean_kl": st.sampled_from([0.0, float("-inf"), 2.0]),
    "probe_max_kl": st.sampled_from([0.0, float("nan"), 2.0]),
    "noise_floor": st.sampled_from([0.0, -1.0, 1e300]),
}
