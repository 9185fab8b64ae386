"""A reference engine: a hybrid, multi-tier prefix cache that emits kvtrace events.

It serves requests like a real engine does (hash lookup, load from lower tiers, adopt, compute
and commit the rest, evict and write back under capacity pressure) through the real emitter,
so everything downstream sees exactly what an instrumented engine would send.

It also keeps its own ground truth: for every block it knows whether the state really is valid
for a given request (identity, tenant, lease, checksum, invalidation, commit), independently of
the events. Faults are injected one at a time (`inject`, or the engine-behaviour knobs of
`SimConfig`), and `truth_recoverable` says what a correct engine could have reused, which is
what the analysis must reconstruct from the events alone.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from kvtrace.instrumentation.api import Emitter
from kvtrace.instrumentation.attach import attach_events, distribution_version
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import ComponentKind, EventKind, Reason, Tier
from kvtrace.schema.recipes import GroupSpec, Recipe

_MASK = (1 << 64) - 1
STORE_TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)


class Fault(StrEnum):
    """One fault class each; `inject` applies the state faults at a token boundary."""

    DROP_TAIL = "drop_tail"  # the uncompressed tail after the last compressed block is gone
    WINDOW_OUT_OF_RANGE = "window_out_of_range"  # the sliding window's blocks were freed
    SKIP_CHECKPOINT = "skip_checkpoint"  # no recurrent-state checkpoint at the boundary
    DESYNC_INDEXER = "desync_indexer"  # indexer rewritten for another KV generation
    UNFETCHED_DISK = "unfetched_disk"  # the prefix now lives on disk only
    EXPIRE_LEASE = "expire_lease"  # the state's lease ran out
    CHANGE_ADAPTER = "change_adapter"  # rewritten under the same hashes by another adapter
    CHANGE_REVISION = "change_revision"  # rewritten by other weights
    SWITCH_TENANT = "switch_tenant"  # rewritten by another tenant (no cache salt)
    MISALIGN = "misalign"  # only the first group reaches past the boundary, by one block
    UNCOMMITTED = "uncommitted"  # a block is being rewritten: tentative
    INVALIDATE = "invalidate"  # explicitly invalidated
    ROLLBACK = "rollback"  # speculative tokens rejected
    CORRUPT_CHECKSUM = "corrupt_checksum"  # the only copy left has other bytes than committed


class CheckpointPolicy(StrEnum):
    """Which recurrent-state (Mamba) checkpoints the simulated engine writes and keeps."""

    EVERY_BLOCK = "every_block"  # one per checkpoint block, evicted like any block (LRU)
    INTERVAL = "interval"  # one every `checkpoint_every` tokens, plus the prompt's end
    BRANCH_POINTS = "branch_points"  # the prompt's end and shared branch points, kept first


class AdoptPolicy(StrEnum):
    """What the simulated engine reuses after its lookup."""

    COMPLETE = "complete"  # the longest aligned boundary where every group is present
    LOGICAL = "logical"  # whatever the hash lookup matched (a buggy engine)


@dataclass(frozen=True, slots=True)
class SimConfig:
    recipe: Recipe
    instance: str = "sim-0"
    model: str = "sim-model"
    model_revision: str = "rev-1"
    kv_dtype: str = "bfloat16"
    layout: str = "NHD"
    epoch: int = 1
    bytes_per_token: int = 2048  # per group, per cached token
    capacity_bytes: tuple[int, int, int] = (1 << 30, 4 << 30, 16 << 30)  # device, host, disk; 0 = no tier
    fetch_tiers: tuple[Tier, ...] = (Tier.HOST, Tier.DISK)  # tiers the engine loads back from
    load_bytes_per_s: tuple[float, float] = (20e9, 2e9)  # host, disk
    load_latency_ns: tuple[int, int] = (0, 0)  # host, disk: fixed cost of each transfer
    # Prefill of tokens [s, s + n): per_token * n + per_pair * n * (s + n / 2) (attention reads
    # every earlier token), reported as the adopt's duration_ns; 0 and 0 report no timing.
    prefill_ns_per_token: float = 0.0
    prefill_ns_per_token_pair: float = 0.0
    timing_noise: float = 0.0  # relative spread of reported timings (seeded: runs are repeatable)
    lease_ns: int = 0  # 0 = committed state never expires
    free_outside_window: bool = True  # free sliding-window blocks once the window has passed
    checkpoints: CheckpointPolicy = CheckpointPolicy.EVERY_BLOCK
    checkpoint_every: int = 0  # INTERVAL: tokens between Mamba checkpoints (a multiple of its block)
    adopt: AdoptPolicy = AdoptPolicy.COMPLETE
    evict_before_adopt: bool = False  # another request evicts a needed block between lookup and adopt
    start_ns: int = 1_750_000_000 * 10**9
    step_ns: int = 1_000  # virtual time per event


def gpu_timed(config: SimConfig) -> SimConfig:
    """`config` with loads and prefills timed like a mid-size model on one GPU (host 20 GB/s +
    50 us a transfer, disk 2 GB/s + 2 ms; prefill 40 us a token plus attention over the
    context), with 2 % noise, so the load-vs-recompute fits (`kvtrace costs`) have something
    to fit."""
    return replace(config, load_bytes_per_s=(20e9, 2e9), load_latency_ns=(50_000, 2_000_000),
                   prefill_ns_per_token=40_000.0, prefill_ns_per_token_pair=2.0, timing_noise=0.02)


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """A retention policy by name: `lru`, `interval:N` (tokens) or `branch`."""

    name: str
    checkpoints: CheckpointPolicy
    checkpoint_every: int = 0

    @classmethod
    def parse(cls, text: str) -> PolicySpec:
        kind, _, arg = text.partition(":")
        if kind == "lru" and not arg:
            return cls("lru", CheckpointPolicy.EVERY_BLOCK)
        if kind == "branch" and not arg:
            return cls("branch", CheckpointPolicy.BRANCH_POINTS)
        if kind == "interval" and arg.isdigit() and int(arg) > 0:
            return cls(f"interval:{arg}", CheckpointPolicy.INTERVAL, int(arg))
        raise ValueError(f"unknown policy {text!r}: use lru, interval:N (tokens) or branch")

    def apply(self, config: SimConfig) -> SimConfig:
        """The configuration with this policy's checkpoints."""
        return replace(config, checkpoints=self.checkpoints, checkpoint_every=self.checkpoint_every)


@dataclass(frozen=True, slots=True)
class SimRequest:
    request_id: str
    tokens: Sequence[int]
    tenant: str = ""
    adapter: str = ""
    arrival_ns: int = 0  # trace time; 0 = as soon as the previous request is done
    preemptions: int = 0  # > 0: a re-admission of a request preempted that many times
    computed_before_preemption: int = 0  # what it had computed when last preempted


@dataclass(frozen=True, slots=True)
class SimOutcome:
    request_id: str
    prompt_tokens: int
    lookup_hit_tokens: int  # what the engine's lookup reported
    adopted_tokens: int
    recomputed_tokens: int
    loaded_bytes: dict[Tier, int]


@dataclass(slots=True)
class _Block:
    group: GroupSpec
    key: int
    index: int
    nbytes: int
    checksum: int
    tiers: dict[Tier, int] = field(default_factory=dict)  # tier -> checksum of that copy
    committed: bool = False
    tenant: str = ""
    adapter: str = ""
    revision: str = ""
    epoch: int = 0
    lease_expiry_ns: int = 0
    invalidated: bool = False
    branch: bool = False  # a checkpoint at a shared branch point (BRANCH_POINTS keeps these first)


def block_keys(recipe: Recipe, tokens: Sequence[int]) -> list[list[int]]:
    """Prefix-chained keys of every full block, per group: equal prefixes give equal keys."""
    out = []
    for g in recipe.groups:
        b, parent, keys = g.block_size, g.group_id, []
        for start in range(0, len(tokens) - b + 1, b):
            parent = (hash((parent, tuple(tokens[start : start + b]))) & _MASK) or 1
            keys.append(parent)
        out.append(keys)
    return out


class CacheSimulator:
    """Serves requests one at a time against a simulated multi-tier cache."""

    def __init__(self, config: SimConfig, emitter: Emitter) -> None:
        self.config = config
        self.recipe = config.recipe
        self._emitter = emitter
        self.now_ns = config.start_ns
        self.blocks: dict[tuple[int, int], _Block] = {}
        self._lru: dict[Tier, OrderedDict[tuple[int, int], None]] = {t: OrderedDict() for t in STORE_TIERS}
        self._used: dict[Tier, int] = dict.fromkeys(STORE_TIERS, 0)
        self._capacity = dict(zip(STORE_TIERS, config.capacity_bytes, strict=True))
        self.bytes_written: dict[Tier, int] = dict.fromkeys(STORE_TIERS, 0)
        self.events = 0
        self._rng = random.Random(config.start_ns)
        self._attached()

    @property
    def used_bytes(self) -> dict[Tier, int]:
        """Bytes held per tier now."""
        return dict(self._used)

    # -- emitting ------------------------------------------------------------------------------
    def _attached(self) -> None:
        """What an engine's shim says when it attaches (see `kvtrace.instrumentation.attach`),
        stamped at the start time, before the first event of the run."""
        if not self._emitter.enabled:
            return
        c = self.config
        base = Event(kind=EventKind.ATTACH, ts_ns=c.start_ns, engine="sim", instance=c.instance, model=c.model,
                     model_revision=c.model_revision, kv_dtype=c.kv_dtype, layout=c.layout, epoch=c.epoch)
        for event in attach_events(base, self.recipe, engine_version=distribution_version("kvtrace")):
            self.events += 1
            self._emitter.emit(event)

    def _emit(self, kind: EventKind, block: _Block | None = None, **fields: object) -> None:
        self.now_ns += self.config.step_ns
        c = self.config
        event = Event(
            kind=kind,
            ts_ns=self.now_ns,
            engine="sim",
            instance=c.instance,
            model=c.model,
            model_revision=c.model_revision,
            kv_dtype=c.kv_dtype,
            layout=c.layout,
            epoch=c.epoch,
        )
        if block is not None:
            g = block.group
            event.component = g.component
            event.group_id = g.group_id
            event.block_size = g.block_size
            event.block_key = block.key
            event.token_start = block.index * g.block_size
            event.token_end = event.token_start + g.block_size
            event.nbytes = block.nbytes
        for name, value in fields.items():
            setattr(event, name, value)
        self.events += 1
        self._emitter.emit(event)

    # -- tiers ---------------------------------------------------------------------------------
    def _place(self, block: _Block, tier: Tier, checksum: int) -> None:
        if tier not in block.tiers:
            self._used[tier] += block.nbytes
            self.bytes_written[tier] += block.nbytes
        block.tiers[tier] = checksum
        self._lru[tier][(block.group.group_id, block.key)] = None
        self._lru[tier].move_to_end((block.group.group_id, block.key))

    def _remove(self, block: _Block, tier: Tier, reason: Reason) -> None:
        if tier not in block.tiers:
            return
        del block.tiers[tier]
        self._used[tier] -= block.nbytes
        self._lru[tier].pop((block.group.group_id, block.key), None)
        self._emit(EventKind.EVICT, block, tier=tier, reason=reason)
        if not block.tiers:
            del self.blocks[(block.group.group_id, block.key)]

    def _move(self, block: _Block, src: Tier, dst: Tier, checksum: int | None = None) -> None:
        kind = EventKind.OFFLOAD if STORE_TIERS.index(dst) > STORE_TIERS.index(src) else EventKind.LOAD
        value = block.tiers[src] if checksum is None else checksum
        self._place(block, dst, value)
        self._emit(kind, block, src_tier=src, dst_tier=dst, checksum=value,
                   duration_ns=self._transfer_ns(block, src, dst))

    def _transfer_ns(self, block: _Block, src: Tier, dst: Tier) -> int:
        slow = max(STORE_TIERS.index(src), STORE_TIERS.index(dst))
        if not slow:
            return int(block.nbytes / 1e12 * 1e9)
        return self._noisy(self._copy_ns(STORE_TIERS[slow], block.nbytes))

    def _copy_ns(self, slower: Tier, nbytes: float) -> float:
        """One transfer of `nbytes` to or from the slower of its two tiers (host, or disk and
        beyond), without noise: its latency plus the bytes at its bandwidth."""
        level = min(STORE_TIERS.index(slower), 2) - 1
        return self.config.load_latency_ns[level] + nbytes / self.config.load_bytes_per_s[level] * 1e9

    def prefill_ns(self, start: int, tokens: int) -> float:
        """The simulated cost of computing tokens [start, start + tokens), without noise."""
        c = self.config
        return c.prefill_ns_per_token * tokens + c.prefill_ns_per_token_pair * tokens * (start + tokens / 2)

    def _noisy(self, ns: float) -> int:
        if self.config.timing_noise:
            ns *= 1 + self._rng.uniform(-self.config.timing_noise, self.config.timing_noise)
        return max(int(ns), 0)

    def _enforce_capacity(self) -> None:
        """Evict least-recently used blocks, writing them back one tier down while there is one."""
        for level, tier in enumerate(STORE_TIERS):
            while self._used[tier] > self._capacity[tier] and self._lru[tier]:
                block = self._victim(tier)
                lower = next((t for t in STORE_TIERS[level + 1 :] if self._capacity[t] > 0), None)
                if lower is not None and lower not in block.tiers and block.committed:
                    self._move(block, tier, lower)
                self._remove(block, tier, Reason.CAPACITY)

    def _usage(self) -> None:
        """What each tier holds now (one request at a time: nothing stays locked between them)."""
        for tier in STORE_TIERS:
            capacity = self._capacity[tier]
            if capacity:
                used = self._used[tier]
                self._emit(EventKind.USAGE, tier=tier, evictable_bytes=used, free_bytes=max(capacity - used, 0))

    def _victim(self, tier: Tier) -> _Block:
        """The least recently used block, sparing branch-point checkpoints while others remain."""
        lru = self._lru[tier]
        for n, key in enumerate(lru):
            block = self.blocks[key]
            if not block.branch or n > 4096:  # bounded scan: a tier of branch points goes in LRU order
                return block
        return self.blocks[next(iter(lru))]

    # -- the engine's own view -------------------------------------------------------------------
    def _present(self, group: GroupSpec, key: int) -> _Block | None:
        return self.blocks.get((group.group_id, key))

    def _complete_at(self, chains: list[list[int]], p: int, fetchable: bool = False) -> bool:
        """Does every group hold the blocks boundary p needs (on a tier it reads, if `fetchable`)?"""
        for g in self.recipe.groups:
            chain = chains[g.group_id]
            for i in g.needed(p):
                block = self._present(g, chain[i]) if i < len(chain) else None
                if block is None or (fetchable and not self._fetchable(block)):
                    return False
        return True

    def _engine_hit(self, chains: list[list[int]], prompt: int) -> tuple[int, list[int]]:
        """What the engine's lookup finds: per-group hash runs, and the hit it will act on."""
        cap = max(prompt - 1, 0)
        runs = []
        for g in self.recipe.groups:
            n = 0
            for key in chains[g.group_id]:
                if self._present(g, key) is None:
                    break
                n += 1
            runs.append(min(n * g.block_size, cap))
        logical = max(runs, default=0)
        if self.config.adopt is AdoptPolicy.LOGICAL:
            return logical, runs
        step = self.recipe.alignment
        p = logical // step * step
        while p > 0 and not self._complete_at(chains, p):
            p -= step
        return p, runs

    # -- serving -------------------------------------------------------------------------------
    def serve(self, request: SimRequest) -> SimOutcome:
        c = self.config
        self.now_ns = max(self.now_ns, request.arrival_ns)
        tokens = request.tokens
        chains = block_keys(self.recipe, tokens)
        ident = dict(tenant=request.tenant, adapter=request.adapter, request_id=request.request_id)
        hit, runs = self._engine_hit(chains, len(tokens))
        self._emit(EventKind.LOOKUP, prompt_tokens=len(tokens), group_block_keys=chains, group_hit_tokens=runs,
                   reported_hit_tokens=hit, preemptions=request.preemptions,
                   computed_before_preemption=request.computed_before_preemption, **ident)
        if c.evict_before_adopt and hit:
            g = self.recipe.groups[0]
            victim = self._present(g, chains[0][(hit - 1) // g.block_size])
            if victim is not None:
                for tier in list(victim.tiers):
                    self._remove(victim, tier, Reason.CAPACITY)
        adopted, loaded = self._fetch(chains, hit)
        reused_tiers = [Tier.DEVICE, *(t for t in loaded if loaded[t])]
        by_tier = self._tokens_by_tier(adopted, loaded)
        self._emit(EventKind.ADOPT, reused_tiers=reused_tiers if adopted else [],
                   reused_tokens=[by_tier.get(t, 0) for t in reused_tiers] if adopted else [],
                   recomputed_tokens=len(tokens) - adopted,
                   duration_ns=self._noisy(self.prefill_ns(adopted, len(tokens) - adopted)), **ident)
        self._compute(chains, adopted, len(tokens), request, branch=runs[0] if runs else 0)
        self._enforce_capacity()
        self._usage()
        return SimOutcome(request.request_id, len(tokens), hit, adopted, len(tokens) - adopted, loaded)

    def _fetch(self, chains: list[list[int]], hit: int) -> tuple[int, dict[Tier, int]]:
        """Load what the hit needs onto the device; stop at the first block it cannot get."""
        loaded: dict[Tier, int] = {Tier.HOST: 0, Tier.DISK: 0}
        p = hit
        if self.config.adopt is AdoptPolicy.COMPLETE:
            step = self.recipe.alignment
            while p > 0 and not self._complete_at(chains, p, fetchable=True):
                p -= step
        for g in self.recipe.groups:
            run: list[_Block] = []  # consecutive blocks from one tier go back as one transfer
            run_src: Tier | None = None
            for i in g.needed(p):
                chain = chains[g.group_id]
                block = self._present(g, chain[i]) if i < len(chain) else None
                if block is None:
                    continue
                src = None
                if Tier.DEVICE not in block.tiers:
                    src = next((t for t in self.config.fetch_tiers if t in block.tiers), None)
                    if src is None:
                        continue
                if run and (src is not run_src or block.index != run[-1].index + 1):
                    self._load_run(run, run_src)
                    run = []
                if src is not None:
                    self._place(block, Tier.DEVICE, block.tiers[src])
                    run.append(block)
                    run_src = src
                    loaded[src] += block.nbytes
                self._lru[Tier.DEVICE].move_to_end((g.group_id, block.key), last=True)
            if run:
                self._load_run(run, run_src)
        return p, loaded

    def _load_run(self, run: list[_Block], src: Tier | None) -> None:
        """Report blocks of one group, consecutive in the prompt and already placed on the
        device, as loaded from one tier in one transfer (one event naming them all, as
        engines' connectors report runs). The event's checksum is every block's: one that
        names several blocks of different bytes carries none (0, not computed)."""
        assert src is not None
        ns = self._copy_ns(src, sum(b.nbytes for b in run))
        first = run[0]
        checksum = first.tiers[src]
        if any(b.tiers[src] != checksum for b in run[1:]):
            checksum = 0
        self._emit(EventKind.LOAD, first, src_tier=src, dst_tier=Tier.DEVICE, checksum=checksum,
                   more_keys=[b.key for b in run[1:]], token_end=(run[-1].index + 1) * first.group.block_size,
                   duration_ns=self._noisy(ns))

    def _fetchable(self, block: _Block) -> bool:
        return Tier.DEVICE in block.tiers or any(t in block.tiers for t in self.config.fetch_tiers)

    def _tokens_by_tier(self, adopted: int, loaded: dict[Tier, int]) -> dict[Tier, int]:
        total = sum(loaded.values())
        if not total:
            return {Tier.DEVICE: adopted}
        out = {t: adopted * n // total for t, n in loaded.items() if n}
        out[Tier.DEVICE] = adopted - sum(out.values())
        return out

    def _compute(self, chains: list[list[int]], adopted: int, prompt: int, request: SimRequest,
                 branch: int = 0) -> None:
        """Prefill [adopted, prompt): write and commit each group's blocks by its kind's rule.

        `branch` is where this prompt leaves the prefixes already cached (the first group's hash
        run): under BRANCH_POINTS the Mamba checkpoint there is written and kept first, because
        at least two requests share the prefix up to it.
        """
        policy = self.config.checkpoints
        for g in self.recipe.groups:
            chain = chains[g.group_id]
            b = g.block_size
            first = adopted // b
            branch_index = branch // b - 1
            for i in range(first, len(chain)):
                end = (i + 1) * b
                if g.component is ComponentKind.MAMBA and i != len(chain) - 1:
                    if policy is CheckpointPolicy.INTERVAL and end % max(self.config.checkpoint_every, b):
                        continue
                    if policy is CheckpointPolicy.BRANCH_POINTS and i != branch_index:
                        continue
                if g.component is ComponentKind.UNCOMPRESSED_TAIL and end <= prompt // g.ratio * g.ratio:
                    continue  # covered by a compressed block
                block = self._write(g, chain[i], i, request)
                if (policy is CheckpointPolicy.BRANCH_POINTS and i == branch_index
                        and g.component is ComponentKind.MAMBA):
                    block.branch = True
            if g.component is ComponentKind.SLIDING_WINDOW and self.config.free_outside_window:
                keep = set(g.needed(len(chain) * b))
                for i in range(0, len(chain)):
                    block = self._present(g, chain[i])
                    if i not in keep and block is not None and Tier.DEVICE in block.tiers:
                        self._remove(block, Tier.DEVICE, Reason.POLICY)

    def _write(self, g: GroupSpec, key: int, index: int, request: SimRequest, commit: bool = True) -> _Block:
        c = self.config
        block = self.blocks.get((g.group_id, key))
        if block is None:
            nbytes = c.bytes_per_token * g.block_size
            block = self.blocks[(g.group_id, key)] = _Block(g, key, index, nbytes,
                                                            checksum=(key * 0x9E3779B1) & _MASK or 1)
        elif Tier.DEVICE in block.tiers and block.committed and not block.invalidated:
            self._lru[Tier.DEVICE].move_to_end((g.group_id, key))
            return block  # already cached: the engine reuses it
        block.invalidated = False
        block.committed = False
        self._place(block, Tier.DEVICE, block.checksum)
        common = dict(tier=Tier.DEVICE, checksum=block.checksum, tenant=request.tenant, adapter=request.adapter)
        self._emit(EventKind.CREATE, block, **common)
        if commit:
            self._commit(block, request.tenant, request.adapter)
        return block

    def _commit(self, block: _Block, tenant: str, adapter: str, **overrides: object) -> None:
        c = self.config
        block.committed = True
        block.invalidated = False
        block.tenant, block.adapter = tenant, adapter
        block.revision = str(overrides.get("model_revision", c.model_revision))
        block.epoch = int(overrides.get("epoch", c.epoch))  # type: ignore[call-overload]
        block.lease_expiry_ns = int(overrides.get("lease_expiry_ns", self.now_ns + c.lease_ns if c.lease_ns else 0))  # type: ignore[call-overload]
        fields = dict(tier=Tier.DEVICE, checksum=block.checksum, tenant=tenant, adapter=adapter,
                      lease_expiry_ns=block.lease_expiry_ns)
        fields.update(overrides)
        self._emit(EventKind.COMMIT, block, **fields)

    # -- ground truth ---------------------------------------------------------------------------
    def _valid_for(self, block: _Block | None, request: SimRequest, at_ns: int) -> bool:
        c = self.config
        if block is None or not block.tiers or not block.committed or block.invalidated:
            return False
        if not any(ck == block.checksum for ck in block.tiers.values()):
            return False
        if block.tenant != request.tenant or block.adapter != request.adapter:
            return False
        if block.revision != c.model_revision or block.epoch != c.epoch:
            return False
        return not (block.lease_expiry_ns and block.lease_expiry_ns <= at_ns)

    def truth_logical(self, request: SimRequest) -> int:
        """What a hash lookup of this request finds here now, by each group's own rule: the
        longest boundary (a multiple of the group's block size, short of the whole prompt) whose
        needed blocks are all held, in whatever state; the best group's. The analysis's logical
        hit, from the simulator's own blocks."""
        chains = block_keys(self.recipe, request.tokens)
        cap = max(len(request.tokens) - 1, 0)
        best = 0
        for g in self.recipe.groups:
            chain, b = chains[g.group_id], g.block_size
            for p in range(cap // b * b, best, -b):
                blocks = g.needed(p)
                if blocks and blocks.stop <= len(chain) and all(self._present(g, chain[i]) for i in blocks):
                    best = p
                    break
        return best

    def truth_recoverable(self, request: SimRequest) -> int:
        """The longest aligned boundary a correct engine could resume this request at, now."""
        chains = block_keys(self.recipe, request.tokens)
        cap = max(len(request.tokens) - 1, 0)
        runs = [
            next((i for i, k in enumerate(chains[g.group_id]) if self._present(g, k) is None), len(chains[g.group_id]))
            * g.block_size
            for g in self.recipe.groups
        ]
        step = self.recipe.alignment
        p = min(max(runs, default=0), cap) // step * step
        at = self.now_ns + self.config.step_ns
        while p > 0:
            if all(
                i < len(chains[g.group_id]) and self._valid_for(self._present(g, chains[g.group_id][i]), request, at)
                for g in self.recipe.groups
                for i in g.needed(p)
            ):
                break
            p -= step
        return p

    def truth_serve_ns(self, request: SimRequest, recoverable: int | None = None) -> float:
        """What serving this request here would cost now, by the simulator's own cost
        parameters: loading the off-device blocks its recoverable prefix needs, one transfer per
        run of consecutive blocks from one tier as `serve` makes them, then prefilling the rest.
        The ground truth for routing regret in seconds."""
        p = self.truth_recoverable(request) if recoverable is None else recoverable
        chains = block_keys(self.recipe, request.tokens)
        ns = 0.0
        for g in self.recipe.groups:
            chain = chains[g.group_id]
            run: tuple[Tier, int] | None = None  # the open transfer's tier and last block index
            nbytes = 0
            for i in g.needed(p) if p else ():
                block = self._present(g, chain[i])
                if block is None or Tier.DEVICE in block.tiers:
                    continue
                src = next(t for t in self.config.fetch_tiers if t in block.tiers)
                if run is not None and run != (src, i - 1):
                    ns += self._copy_ns(run[0], nbytes)
                    nbytes = 0
                run, nbytes = (src, i), nbytes + block.nbytes
            if run is not None:
                ns += self._copy_ns(run[0], nbytes)
        return ns + self.prefill_ns(p, len(request.tokens) - p)

    # -- faults -----------------------------------------------------------------------------------
    def inject(self, fault: Fault, request: SimRequest, boundary: int) -> None:
        """Damage the cached state of `request`'s prompt at token `boundary`, emitting what an
        engine would emit when that happens."""
        chains = block_keys(self.recipe, request.tokens)

        def blocks(groups: Sequence[GroupSpec], from_token: int) -> list[_Block]:
            out = []
            for g in groups:
                for i, key in enumerate(chains[g.group_id]):
                    block = self._present(g, key)
                    if block is not None and (i + 1) * g.block_size > from_token:
                        out.append(block)
            return out

        def needed(kind: ComponentKind) -> list[_Block]:
            out = []
            for g in self.recipe.groups:
                if g.component is kind:
                    out += [b for i in g.needed(boundary) if (b := self._present(g, chains[g.group_id][i])) is not None]
            return out

        groups = self.recipe.groups
        later = blocks(groups, boundary)
        if fault is Fault.DROP_TAIL:
            for block in needed(ComponentKind.UNCOMPRESSED_TAIL):
                self._drop(block, Reason.POLICY)
        elif fault is Fault.WINDOW_OUT_OF_RANGE:
            for block in needed(ComponentKind.SLIDING_WINDOW):
                self._drop(block, Reason.POLICY)
        elif fault is Fault.SKIP_CHECKPOINT:
            for block in needed(ComponentKind.MAMBA):
                self._drop(block, Reason.POLICY)
        elif fault is Fault.DESYNC_INDEXER:
            for block in later:
                if block.group.component is ComponentKind.INDEXER:
                    self._commit(block, request.tenant, request.adapter, epoch=self.config.epoch + 1)
        elif fault is Fault.UNFETCHED_DISK:
            for block in later:
                if Tier.DISK not in block.tiers:
                    self._move(block, next(iter(block.tiers)), Tier.DISK)
                for tier in [t for t in block.tiers if t is not Tier.DISK]:
                    self._remove(block, tier, Reason.CAPACITY)
        elif fault is Fault.EXPIRE_LEASE:
            for block in later:
                self._commit(block, request.tenant, request.adapter, lease_expiry_ns=self.now_ns + 1)
        elif fault is Fault.CHANGE_ADAPTER:
            for block in later:
                self._commit(block, request.tenant, request.adapter + "-other")
        elif fault is Fault.CHANGE_REVISION:
            for block in later:
                self._commit(block, request.tenant, request.adapter,
                             model_revision=self.config.model_revision + "-next")
        elif fault is Fault.SWITCH_TENANT:
            for block in later:
                self._commit(block, request.tenant + "-other", request.adapter)
        elif fault is Fault.MISALIGN:
            first = groups[0]
            for block in blocks(groups[1:], boundary) + blocks([first], boundary + first.block_size):
                self._drop(block, Reason.CAPACITY)
        elif fault is Fault.UNCOMMITTED:
            for block in later:
                if block.index == boundary // block.group.block_size:
                    block.committed = False
                    self._emit(EventKind.CREATE, block, tier=Tier.DEVICE, checksum=block.checksum,
                               tenant=request.tenant, adapter=request.adapter)
        elif fault in (Fault.INVALIDATE, Fault.ROLLBACK):
            reason = Reason.ROLLBACK if fault is Fault.ROLLBACK else Reason.EXPLICIT
            for block in later:
                block.invalidated = True
                self._emit(EventKind.INVALIDATE, block, reason=reason)
        elif fault is Fault.CORRUPT_CHECKSUM:
            for block in later[:1]:  # the first group's block at the boundary
                bad = (block.checksum + 1) & _MASK
                if Tier.HOST not in block.tiers:
                    self._move(block, Tier.DEVICE, Tier.HOST)
                self._remove(block, Tier.DEVICE, Reason.CAPACITY)
                self._move(block, Tier.HOST, Tier.DEVICE, checksum=bad)
                for tier in [t for t in block.tiers if t is not Tier.DEVICE]:
                    self._remove(block, tier, Reason.CAPACITY)
        self.now_ns += self.config.step_ns

    def _drop(self, block: _Block, reason: Reason) -> None:
        for tier in list(block.tiers):
            self._remove(block, tier, reason)
