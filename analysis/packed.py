"""Live objects in a snapshot as fixed binary records, not a Python object per object.

Why: a snapshot of 300k live objects cost ~1 s to decode into `ObjectState`s and load into the
compiled state, and ~2 s to build and encode the other way, most of an incremental run over
the last 10 % of a store. The compiled state writes and reads these records itself
(`_native.c`'s `pack` / `unpack`), a copy; the Python state (where nothing is compiled) reads
and writes the same records here through NumPy, so a snapshot either state took resumes in
either.

A record names its table (instance, group), tenant and commit identity by their index in the
lists stored beside the records; the reader interns those and renumbers. Tiers and
invalidation reasons are the compiled state's codes (`native_state._TIERS`, `_REASONS`), tier
t's copy present when bit t of `mask` is set.
"""

from __future__ import annotations

import msgspec
import numpy as np

from kvtrace.analysis.state import CacheState, Commit, Copy, ObjectState
from kvtrace.schema.kinds import Reason, Tier

TIERS = (Tier.NONE, Tier.DEVICE, Tier.HOST, Tier.DISK, Tier.REMOTE)  # the compiled state's tier codes
REASONS = tuple(Reason)  # its reason codes: NONE first
_TIER_BY_VALUE = {t.value: i for i, t in enumerate(TIERS)}
_REASON_CODE = {r: i for i, r in enumerate(REASONS)}
_N = len(TIERS)
RECORD = np.dtype([
    ("key", "<u8"), ("table", "<u4"), ("identity", "<u4"), ("tenant", "<u4"),
    ("mask", "u1"), ("has_commit", "u1"), ("reason", "u1"), ("pad", "u1"),
    ("commit_checksum", "<u8"), ("commit_nbytes", "<u8"), ("lease", "<i8"), ("inv_ord", "<i8"),
    ("nbytes", "<u8", (_N,)), ("checksum", "<u8", (_N,)), ("ord", "<i8", (_N,)), ("committed", "u1", (_N,)),
])
assert RECORD.itemsize == 56 + 25 * _N  # _native.c's REC_SIZE

Identity = tuple[str, str, str, str, str, str, int]


class PackedObjects(msgspec.Struct, array_like=True, gc=False):
    """Every live object: `records` (RECORD, one per object) and the lists their ids index."""

    tables: list[tuple[str, int]]  # (instance, group_id)
    strings: list[str]  # tenants
    identities: list[Identity]
    records: bytes


def pack(state: CacheState) -> PackedObjects:
    """The Python state's objects as records (what the compiled state's `pack` gives)."""
    tables: list[tuple[str, int]] = []
    strings: dict[str, int] = {"": 0}
    identities: dict[Identity, int] = {}
    count = sum(len(objects) for objects in state.tables.values())
    out = np.zeros(count, dtype=RECORD)
    i = 0
    for scope, objects in state.tables.items():
        if not objects:
            continue
        t = len(tables)
        tables.append(scope)
        for key, obj in objects.items():
            row = out[i]
            row["key"], row["table"] = key, t
            row["reason"] = _REASON_CODE[obj.invalidated_reason]
            row["lease"], row["inv_ord"] = obj.lease_expiry_ns, obj.invalidated_ord
            if obj.commit is not None:
                c = obj.commit
                row["has_commit"] = 1
                row["identity"] = identities.setdefault(c.identity, len(identities))
                row["tenant"] = strings.setdefault(c.tenant, len(strings))
                row["commit_checksum"], row["commit_nbytes"] = c.checksum, c.nbytes
            mask = 0
            for tier, copy in obj.copies.items():
                code = _TIER_BY_VALUE[tier]
                mask |= 1 << code
                row["nbytes"][code], row["checksum"][code] = copy.nbytes, copy.checksum
                row["ord"][code], row["committed"][code] = copy.ord, copy.committed
            row["mask"] = mask
            i += 1
    return PackedObjects(tables, list(strings), list(identities), out[:i].tobytes())


def records(packed: PackedObjects) -> np.ndarray:
    """The records, checked: whole, and every id within its list (ValueError names what is not)."""
    if len(packed.records) % RECORD.itemsize:
        raise ValueError(f"packed objects: {len(packed.records)} bytes is not a whole number of records")
    rows = np.frombuffer(packed.records, dtype=RECORD)
    committed = rows["has_commit"] == 1
    if len(rows) and (rows["table"].max() >= len(packed.tables) or rows["tenant"].max() >= len(packed.strings)
                      or (committed.any() and rows["identity"][committed].max() >= len(packed.identities))
                      or rows["has_commit"].max() > 1 or rows["mask"].max() >= 1 << _N
                      or rows["reason"].max() >= len(REASONS)):
        raise ValueError("packed objects: a record names an id or code out of range")
    return rows


def unpack_into(state: CacheState, packed: PackedObjects) -> None:
    """Add the objects to the Python state (slow: a Struct per object; the compiled state's
    `unpack` is what runs where it is built)."""
    rows = records(packed)
    tiers = [t.value for t in TIERS]
    for row in rows.tolist():
        key, table, identity, tenant, mask, has_commit, reason, _, ck, nb, lease, inv, nbytes, sums, ords, done = row
        commit = Commit(tuple(packed.identities[identity]), packed.strings[tenant], ck, nb) if has_commit else None
        copies = {tiers[t]: Copy(bool(done[t]), nbytes[t], sums[t], ords[t]) for t in range(_N) if mask >> t & 1}
        objects = state.tables.setdefault(packed.tables[table], {})
        if key in objects:
            raise ValueError("packed objects: an object loaded twice")
        objects[key] = ObjectState(copies, commit, lease, inv, REASONS[reason])
