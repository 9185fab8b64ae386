"""Drive SGLang's own `UnifiedRadixCache` with no model, the way its scheduler uses it.

This is how a trace is replayed through the real SGLang cache logic (page hashing, the radix
tree on either core, per-component matching and reconciliation, LRU eviction, sliding-window
tombstones, Mamba checkpoints and copy-on-write, HiCache's host tier) in seconds, on CPU pools,
without weights or a forward pass. One request at a time (`serve`), or on the scheduler route
step by step, several interleaved as in a batch (`admit`, `prefill`, `decode`, `retract`,
`readmit`, `finish`), on one of two paths:

- `Route.CACHE` calls the cache's own methods: `match_prefix` (the prompt less its last
  token, as the scheduler asks) -> lock the match -> make room (`evict`) -> allocate KV slots
  for the rest of the prompt -> `insert` the prompt's pages -> unlock. It covers every tree,
  every component mix and HiCache.
- `Route.SCHEDULER` goes through the request-level steps SGLang's scheduler itself runs (full
  attention on the unified tree; with HiCache's tiers on, whose load-back it does not drive,
  requests take the cache route): `Req.init_next_round_input` matches the request, the tree
  locks its prefix, the request gets a request-pool row with its KV slots written in, and
  `release_kv_cache` checkpoints it into the tree (`checkpoint` -> `insert` of the request's
  own tokens), frees the row and unlocks. This is the path an engine's requests take, with
  SGLang's own bookkeeping around each cache call.

Either way the engine's own split of what a request reused is then reported (`record_admission`).

A request SGLang would refuse raises `RequestRefused` (see `admission`): one its tokenizer
manager refuses (the context length) before it reaches the cache; one its scheduler aborts (its
input limit) after the one-token stub SGLang runs in its place has gone through the cache.

The pools come from SGLang's test kit (`sglang.test.kits.unified_radix_cache`), which builds
the real allocator, KV pool and request pool for a component mix on a device.
"""

from __future__ import annotations

import dataclasses
import os
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from kvtrace.instrumentation.refusals import Refusal, RefusalReason, RequestRefused
from kvtrace.instrumentation.sglang.admission import ABORT_STUB, InputLimits, refusal
from kvtrace.instrumentation.sglang.cpu import install_vision_stand_in

install_vision_stand_in()
os.environ.setdefault("SGLANG_LOGGING_LEVEL", "WARNING")

import sglang.test.kits.unified_radix_cache.fixtures as kit  # noqa: E402
import torch  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import (  # noqa: E402
    EvictParams,
    InitLoadBackParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.test.kits.unified_radix_cache.config import CacheConfig  # noqa: E402

kit.get_device = lambda *args, **kwargs: "cpu"  # the kit asks for an accelerator; the pools run on CPU


class Route(StrEnum):
    """How a request reaches the cache (see the module docstring)."""

    CACHE = "cache"
    SCHEDULER = "scheduler"


class Mix(StrEnum):
    """The component mixes the replay builds (SGLang chooses them from the model)."""

    FULL = "full"
    SWA = "full+swa"
    MAMBA = "full+mamba"
    SWA_MAMBA = "full+swa+mamba"


COMPONENTS = {
    Mix.FULL: (ComponentType.FULL,),
    Mix.SWA: (ComponentType.FULL, ComponentType.SWA),
    Mix.MAMBA: (ComponentType.FULL, ComponentType.MAMBA),
    Mix.SWA_MAMBA: (ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA),
}


@dataclass(frozen=True, slots=True)
class DriverConfig:
    mix: Mix = Mix.FULL
    page_size: int = 16
    window: int = 64  # sliding window, tokens
    kv_tokens: int = 1 << 17  # device KV slots (and, on the scheduler route, the longest request)
    context_len: int = 1 << 17  # the model's context length, which SGLang checks prompts against
    mamba_states: int = 64  # Mamba state slots
    tree_core: str = "rust"  # SGLang's default; "python" is its reference core
    tree: str = "unified"  # or SGLang's older single-component trees: "radix", "pure_swa"
    route: Route = Route.CACHE


@dataclass(slots=True, eq=False)
class Running:
    """A request on the scheduler route between its steps (`Driver.admit`, `prefill`, `decode`, ..., `finish`)."""

    req: Req
    outputs: array  # the tokens it generates after its prompt
    cache_salt: str | None
    device: int = 0  # SGLang's device hit at its (last) admission: what it reuses
    full: int = 0  # the full-attention match at that admission
    borrowed: bool = False  # a streaming session lent it the row holding [0, device)
    filled: int = 0  # tokens whose KV slots are in its row
    made: int = 0  # outputs generated so far (the first by the prefill's forward pass)
    spare: list = dataclasses.field(default_factory=list)  # page padding `_alloc` took, freed at release


@dataclass(frozen=True, slots=True)
class Served:
    request_id: str
    prompt_tokens: int
    device_hit: int  # MatchResult.device_prefix_len: reusable now, every component agreeing
    host_hit: int  # MatchResult.host_hit_length: full-attention KV on host after the device hit
    full_kv_hit: int  # MatchResult.full_kv_hit_length: full-attention KV alone, device or host
    loaded: int  # tokens loaded back from host before the request ran
    reused: int  # what the request really reused: device hit + loaded


def build_cache(config: DriverConfig, enable_kv_cache_events: bool = False) -> tuple[Any, Any, Any]:
    """(cache, KV allocator, request pool) on CPU, with the chosen tree core."""
    comps = COMPONENTS[config.mix]
    has_swa = ComponentType.SWA in comps
    cfg = CacheConfig(page_size=config.page_size, components=comps,
                      sliding_window_size=config.window if has_swa else None, kv_size=config.kv_tokens,
                      num_layers=4, full_attention_layer_ids=(3,), head_num=1, head_dim=8,
                      mamba_cache_size=config.mamba_states, max_num_reqs=config.mamba_states + 8,
                      # the scheduler route writes each request's slots into a request-pool row
                      max_context_len=config.kv_tokens if config.route is Route.SCHEDULER else 64,
                      mamba_intermediate_size=32, mamba_num_heads=1, mamba_head_dim=8,
                      mamba_state_size=8)
    cache, allocator, req_pool = kit.build_fixture(cfg, enable_kv_cache_events=enable_kv_cache_events,
                                                   tree_core_backend="python")
    if config.tree != "unified":
        return _older_tree(config, cache), allocator, req_pool
    if config.tree_core != "python":  # the kit builds its inspector on the Python core only
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        params = dataclasses.replace(cache.cache_init_params, tree_core_backend=config.tree_core)
        cache = UnifiedRadixCache(params)
        cache.cache_init_params = params
    return cache, allocator, req_pool


def _older_tree(config: DriverConfig, built: Any) -> Any:
    """`RadixCache` (full attention) or `PureSWARadixCache` (an all-SWA model) over the pools
    the kit built: the same allocator and request pool, SGLang's older tree in front."""
    from sglang.srt.mem_cache.pure_swa_radix_cache import PureSWARadixCache
    from sglang.srt.mem_cache.radix_cache import RadixCache

    if config.mix is not Mix.FULL:
        raise ValueError(f"tree {config.tree!r} holds one component; build it with mix=full, not {config.mix}")
    if config.tree == "radix":
        return RadixCache(built.cache_init_params)
    if config.tree == "pure_swa":
        return PureSWARadixCache(dataclasses.replace(built.cache_init_params, sliding_window_size=config.window))
    raise ValueError(f"unknown tree {config.tree!r}: expected unified, radix or pure_swa")


class Driver:
    """Serves token-id requests on one cache: whole (`serve`, `serve_turn`) or step by step."""

    def __init__(self, cache: Any, allocator: Any, req_pool: Any, config: DriverConfig, shim: Any = None) -> None:
        self.cache, self.allocator, self.req_pool, self.config = cache, allocator, req_pool, config
        self.shim = shim  # told what each request reused, as the engine's scheduler would
        self.sessions: dict[str, Any] = {}  # streaming sessions by id (`serve_turn`)
        self.page = int(cache.page_size)
        # SGLang sizes its pool in whole pages
        self.limits = InputLimits(context_len=config.context_len, pool_tokens=config.kv_tokens // self.page * self.page)
        comps = COMPONENTS[config.mix]
        self.has_swa = ComponentType.SWA in comps
        self.has_mamba = ComponentType.MAMBA in comps
        if config.route is Route.SCHEDULER and (config.mix is not Mix.FULL or not hasattr(cache, "checkpoint")):
            raise ValueError(f"the scheduler route drives full attention on the unified tree, not mix "
                             f"{config.mix} on {type(cache).__name__}; use Route.CACHE")

    def _req(self, request_id: str, tokens: array) -> Req:
        req = Req(rid=request_id, origin_input_text="", origin_input_ids=tokens,
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=1))
        if self.has_mamba:  # the request's own state slot; the tree gives one back when none is free
            if self.req_pool.mamba_allocator.available_size() < 1:
                self.cache.evict(EvictParams(mamba_num=1))
                if self.req_pool.mamba_allocator.available_size() < 1:
                    raise RuntimeError(f"{request_id}: no Mamba state slot; raise DriverConfig.mamba_states")
            self.req_pool.alloc([req])
        return req

    def _alloc(self, n: int) -> torch.Tensor:
        """n KV slots, page-aligned; evicts what the tree can give back first."""
        aligned = -(-n // self.page) * self.page
        short = aligned - int(self.allocator.available_size())
        if short > 0:
            self.cache.evict(EvictParams(num_tokens=short, swa_num_tokens=short if self.has_swa else 0))
        if self.has_swa and self.page > 1:
            full = self.allocator.full_attn_allocator.alloc(aligned)
            swa = self.allocator.swa_attn_allocator.alloc(aligned)
            if full is None or swa is None:
                raise RuntimeError(f"out of KV slots for {n} tokens; raise DriverConfig.kv_tokens")
            self.allocator.full_to_swa_index_mapping[full] = swa
            return full
        got = self.allocator.alloc(aligned)
        if got is None:
            raise RuntimeError(f"out of KV slots for {n} tokens; raise DriverConfig.kv_tokens")
        return got

    def _checkpoint_at(self, prompt: array, value: torch.Tensor, branch: int, cache_salt: str | None) -> None:
        """The scheduler keeps a Mamba state at the branching point a match reported (the
        longest checkpoint-grid position the full KV already covers), so the next request with
        that prefix can resume there: insert the prefix again with that state."""
        slot = self.req_pool.mamba_allocator.alloc(1)
        if slot is None:
            self.cache.evict(EvictParams(mamba_num=1))
            slot = self.req_pool.mamba_allocator.alloc(1)
            if slot is None:
                return
        result = self.cache.insert(InsertParams(key=RadixKey(prompt[:branch], cache_salt=cache_salt),
                                                value=value[:branch].clone(),
                                                mamba_value=slot, prev_prefix_len=branch))
        if result.mamba_exist:
            self.req_pool.mamba_allocator.free(slot)

    def check(self, prompt_tokens: int, max_new_tokens: int | None = 1) -> Refusal | None:
        """Why SGLang would refuse a prompt this long, or None."""
        return refusal(prompt_tokens, max_new_tokens, self.limits)

    def _refuse(self, request_id: str, tokens: Sequence[int], cache_salt: str | None, max_new_tokens: int) -> None:
        """Raise `RequestRefused` where SGLang would refuse the request; for its scheduler's
        abort, after the one-token stub SGLang runs instead has gone through the cache."""
        refused = self.check(len(tokens), max_new_tokens)
        if refused is None:
            return
        if refused.reason is RefusalReason.OVER_INPUT_LIMIT:
            if self.config.route is Route.SCHEDULER and getattr(self.cache, "cache_controller", None) is None:
                run = self._admit(request_id, ABORT_STUB, cache_salt)
                self.prefill(run)
                self.finish(run, aborted=True)
            else:
                self._serve_cached(request_id, ABORT_STUB, cache_salt)
        raise RequestRefused(request_id, len(tokens), refused)

    def serve(self, request_id: str, tokens: Sequence[int], cache_salt: str | None = None) -> Served:
        """One request; `cache_salt` is its namespace (SGLang's per-request salt). Raises
        `RequestRefused` where SGLang would refuse it (see the module docstring)."""
        if self.config.route is Route.SCHEDULER and getattr(self.cache, "cache_controller", None) is None:
            return self._serve_scheduled(request_id, tokens, cache_salt)
        self._refuse(request_id, tokens, cache_salt, max_new_tokens=1)
        return self._serve_cached(request_id, tokens, cache_salt)

    def _serve_cached(self, request_id: str, tokens: Sequence[int], cache_salt: str | None) -> Served:
        cache, page = self.cache, self.page
        prompt = array("q", tokens)
        req = self._req(request_id, prompt)
        match = cache.match_prefix(MatchPrefixParams(key=RadixKey(prompt[:-1], cache_salt=cache_salt),
                                                     cow_mamba=self.has_mamba, req=req))
        device, host = int(match.device_prefix_len), int(match.host_hit_length)
        node, loaded = match.last_device_node, 0
        if host and getattr(cache, "cache_controller", None) is not None:
            req.prefix_len, req.last_node, req.last_host_node = device, node, match.last_host_node
            req.best_match_node, req.host_hit_length = match.best_match_node, host
            req.swa_host_hit_length = match.swa_host_hit_length
            req.mamba_host_hit_length = match.mamba_host_hit_length
            loaded_tokens, node = cache.init_load_back(InitLoadBackParams(
                best_match_node=match.best_match_node, host_hit_length=host, req=req))
            loaded = int(loaded_tokens)
            cache.ready_to_load_host_cache()
            cache.loading_check()
        reused = device + loaded
        lock = cache.inc_lock_ref(node)
        if self.shim is not None:  # admitted: the scheduler reports its reuse as it prepares the batch
            self.shim.record_admission(request_id, len(prompt), device=device, host=loaded, tenant=cache_salt)
        try:
            prefix = cache.path_device_indices(node)[:reused] if reused else None
            fresh = self._alloc(len(prompt) - reused)
            value = torch.cat([prefix, fresh]) if prefix is not None else fresh
            pages = len(prompt) // page * page
            kept = False
            if pages:
                # [0, reused) is the tree's own KV (prev_prefix_len says so); pages it already
                # holds past that are duplicates the insert frees itself.
                insert = InsertParams(key=RadixKey(prompt[:pages], cache_salt=cache_salt), value=value[:pages].clone(),
                                      prev_prefix_len=reused)
                if self.has_mamba:
                    insert.mamba_value = req.kv.mamba_pool_idx.unsqueeze(0)
                kept = not cache.insert(insert).mamba_exist
                branch = int(match.mamba_branching_seqlen or 0) if self.has_mamba else 0
                if reused < branch <= pages:
                    self._checkpoint_at(prompt, value, branch, cache_salt)
            if len(value) > pages:  # the partial last page is never cached
                self.allocator.free(value[pages:])
            if self.has_mamba:
                if not kept:  # the tree kept its own state: this one is ours to free
                    self.req_pool.free_mamba_cache(req)
                self.req_pool.free(req)
        finally:
            cache.dec_lock_ref(node, lock.to_dec_params())
        return Served(request_id, len(prompt), device, host, int(match.full_kv_hit_length), loaded, reused)

    def serve_turn(self, session_id: str, request_id: str, tokens: Sequence[int], aborted: bool = False) -> Served:
        """One turn of a streaming session (scheduler route, full attention): the session keeps
        the turn's KV row outside the tree, and the next turn, whose tokens extend this one's,
        resumes from it. `close_session` gives the row back. An `aborted` turn hands the row
        back instead, and is released like any request (its prompt checkpointed into the tree)."""
        if self.config.route is not Route.SCHEDULER or self.page != 1:
            # With larger pages SGLang continues a turn in the partial page the session kept;
            # the driver allocates whole fresh pages and would lay the row out as SGLang never does.
            raise ValueError("streaming sessions take the scheduler route, on one-token pages")
        from sglang.srt.session.session_controller import Session

        session = self.sessions.get(session_id)
        if session is None:
            session = self.sessions[session_id] = Session(1 << 30, session_id, streaming=True)
        return self._serve_scheduled(request_id, tokens, None, session, aborted)

    def close_session(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)
        self.cache.release_session(session_id)

    def _serve_scheduled(self, request_id: str, tokens: Sequence[int], cache_salt: str | None,
                         session: Any = None, aborted: bool = False) -> Served:
        """One request through the scheduler's own request-level steps, all at once."""
        run = self.admit(request_id, tokens, cache_salt, session=session)
        self.prefill(run)
        self.decode(run)
        return self.finish(run, aborted)

    # -- the scheduler route, step by step (requests can interleave, as in a batch) ---------------
    def admit(self, request_id: str, tokens: Sequence[int], cache_salt: str | None = None,
              outputs: Sequence[int] = (), session: Any = None) -> Running:
        """Match a request and give it a request-pool row holding its device hit, as the
        scheduler does when it takes a request into a prefill batch, and report what it reuses.
        `outputs` are the tokens it will generate: the prefill makes the first, `decode` the rest.
        Raises `RequestRefused` where SGLang would refuse the request."""
        if self.config.route is not Route.SCHEDULER or getattr(self.cache, "cache_controller", None) is not None:
            raise ValueError("the scheduler route's steps (streaming sessions, step-by-step requests) need "
                             "Route.SCHEDULER and no HiCache, whose load-back the driver drives on the cache "
                             "route only")
        self._refuse(request_id, tokens, cache_salt, max_new_tokens=max(len(outputs), 1))
        return self._admit(request_id, tokens, cache_salt, outputs, session)

    def _admit(self, request_id: str, tokens: Sequence[int], cache_salt: str | None = None,
               outputs: Sequence[int] = (), session: Any = None) -> Running:
        prompt = array("q", tokens)
        req = Req(rid=request_id, origin_input_text="", origin_input_ids=prompt, cache_salt=cache_salt,
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=max(len(outputs), 1)),
                  session=session)
        run = Running(req, array("q", outputs), cache_salt)
        self._match(run)
        return run

    def _match(self, run: Running) -> None:
        """match_kv_cache, adopted as the request's prefix; lock it and write it into the row.
        Then the admission is reported, as SGLang's `prepare_for_extend` hook reports it: what
        the request reuses of its tokens so far (its prompt, and after a retraction its outputs)."""
        req, cache = run.req, self.cache
        req.init_next_round_input(cache)
        run.device, run.full = int(req.prefix_len), int(req.num_matched_prefix_tokens)
        run.borrowed = req.session is not None and cache.session.borrowed_slot(req) is not None
        run.filled = run.device
        if not run.borrowed:  # a session's row holds [0, device) already
            self._row(run)
        if self.shim is not None:
            self.shim.record_admission(req.rid, len(req.origin_input_ids) + len(req.output_ids), device=run.device,
                                       host=0, tenant=run.cache_salt)

    def _row(self, run: Running) -> None:
        """A request-pool row holding the matched prefix, under the tree's lock on it."""
        req, cache = run.req, self.cache
        req.lock = cache.lock(req.last_node)
        try:
            self.req_pool.alloc([req])
            if run.device:
                prefix = cache.path_device_indices(req.last_node)[: run.device]
                self.req_pool.write((req.kv.req_pool_idx, slice(0, run.device)), prefix)
        except BaseException:  # the replay stops; the cache is left as it was
            cache.unlock(req.lock)
            raise
        req.kv.kv_committed_len = req.kv.kv_allocated_len = run.device
        req.kv.cache_protected_len = run.device
        if req.session is not None:
            cache.maybe_hand_to_session(req)  # at its first row, as the scheduler's allocation does

    def _extend(self, run: Running, end: int) -> None:
        """KV slots for the request's tokens [filled, end), written into its row."""
        req, start = run.req, run.filled
        if end > start:
            self._write_fresh(run, start, end)
        req.kv.kv_committed_len = req.kv.kv_allocated_len = max(end, start)

    def _write_fresh(self, run: Running, start: int, end: int) -> None:
        fresh = self._alloc(end - start)
        try:
            self.req_pool.write((run.req.kv.req_pool_idx, slice(start, end)), fresh[: end - start])
        except BaseException:
            self.allocator.free(fresh)
            raise
        if len(fresh) > end - start:
            # `_alloc` takes whole pages. The test kit's allocator frees slot by slot, so the
            # padding past the request's KV is ours to give back once the row is released.
            run.spare.append(fresh[end - start :])
        run.filled = end

    def prefill(self, run: Running, until: int | None = None) -> bool:
        """Compute the KV of what the request has to prefill (its prompt, and after a retraction
        the outputs it had made) up to `until` tokens (a chunk; all of it when None). A chunk
        that stops short is checkpointed into the tree, as SGLang stashes a chunked request. The
        last one ends with the forward pass making the next output token; a request with more to
        decode is then checkpointed too, as SGLang's prefill result does. Returns whether the
        request has more to prefill."""
        req = run.req
        fill = len(req.origin_input_ids) + len(req.output_ids)
        end = fill if until is None else min(int(until), fill)
        if end <= run.filled and end < fill:
            raise ValueError(f"{req.rid}: a chunk must end past the {run.filled} tokens the request holds, "
                             f"not at {end}")
        if end < fill:
            if end % self.page:
                raise ValueError(f"{req.rid}: a chunk must end on a page boundary (page {self.page}), not at {end}")
            self._extend(run, end)
            req.extend_end = end
            checkpoint_kv_cache(req, self.cache)  # insert [protected, end), move the lock, prefix_len = end
            return True
        self._extend(run, fill)
        if run.made < len(run.outputs):
            self._made(run, 1)
            if run.made < len(run.outputs):  # not finished: the prefilled tokens go into the tree now
                req.extend_end = fill
                checkpoint_kv_cache(req, self.cache)
        return False

    def decode(self, run: Running, steps: int | None = None) -> int:
        """Decode up to `steps` more output tokens (all that are left when None): each step
        writes the KV of the last output and makes the next, so the last output has no KV.
        Returns how many outputs are left."""
        left = len(run.outputs) - run.made
        n = left if steps is None else max(min(int(steps), left), 0)
        if n:
            self._extend(run, len(run.req.origin_input_ids) + run.made + n - 1)
            self._made(run, n)
        return left - n

    @staticmethod
    def _made(run: Running, n: int) -> None:
        run.req.output_ids.extend(run.outputs[run.made : run.made + n])
        run.made += n

    def finish(self, run: Running, aborted: bool = False) -> Served:
        """The request finishes (or is `aborted`): the tree checkpoints its prompt and outputs,
        its row is freed and its lock dropped; or a streaming session keeps the row."""
        req = run.req
        req.finished_reason = FINISH_ABORT() if aborted else FINISH_LENGTH(length=run.made)
        release_kv_cache(req, self.cache, checkpoint=True)
        self._give_back(run)
        return Served(req.rid, len(req.origin_input_ids), run.device, 0, run.full, 0, run.device)

    def retract(self, run: Running) -> None:
        """Preempt a request in decode, as the scheduler does when decode runs out of KV: its
        row is freed without a checkpoint (what its prefill put into the tree stays there, its
        decoded tokens' KV goes) and it waits to be admitted again (`readmit`), keeping the
        outputs it has made."""
        if not 0 < run.made < len(run.outputs):
            raise ValueError(f"{run.req.rid}: only a request in decode is retracted ({run.made} of "
                             f"{len(run.outputs)} outputs made)")
        release_kv_cache(run.req, self.cache, checkpoint=False)
        self._give_back(run)
        run.req.reset_for_retract()

    def readmit(self, run: Running) -> None:
        """A retracted request is matched again, on its prompt and the outputs it had made,
        and admitted (its reuse reported again: this admission reuses what is there now)."""
        self._match(run)

    def _give_back(self, run: Running) -> None:
        for spare in run.spare:
            self.allocator.free(spare)
        run.spare.clear()

def enable_hicache(cache: Any, storage_dir: str | None = None, write_policy: str = "write_through",
                   host_ratio: float = 2.0) -> Any:
    """Give the cache HiCache's host tier (and a file storage tier under `storage_dir`), on CPU.

    Every page is backed up to host at its first insert (write-through threshold 1) and any host
    hit is loaded back, so each tier move happens on the first chance; prefetches wait for their
    whole span. Returns the cache's controller.
    """
    import json

    from sglang.srt.environ import envs
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    from kvtrace.instrumentation.sglang.cpu import patch_hicache_for_cpu

    patch_hicache_for_cpu()
    extra = None
    if storage_dir is not None:
        get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
        envs.SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR.override(storage_dir).__enter__()
        extra = json.dumps({"prefetch_threshold": int(cache.page_size)})
    # Mamba's host pool takes only page-first layouts; the others keep SGLang's default
    mamba = ComponentType.MAMBA in (getattr(cache, "tree_components", None) or ())
    args = ServerArgs(model_path="dummy", page_size=int(cache.page_size), hicache_io_backend="direct",
                      hicache_mem_layout="page_first_direct" if mamba else "layer_first",
                      hicache_write_policy=write_policy,
                      hicache_storage_backend="file" if storage_dir is not None else None,
                      hicache_storage_backend_extra_config=extra, hicache_storage_prefetch_policy="wait_complete",
                      hicache_ratio=host_ratio)
    set_global_server_args_for_scheduler(args)
    cache.init_hicache(args, cache.cache_init_params)
    kit.drop_hicache_atexit_pin(cache)
    cache.write_through_threshold = 1
    cache.load_back_threshold = 0
    return cache.cache_controller
