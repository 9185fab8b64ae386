"""A correctness canary inside a serving vLLM engine: live traffic's cache reuse, re-executed.

`kvtrace verify` drives an engine of its own. A fleet needs the same check on the engines that
serve users, at a small, bounded cost: that is this module. In the scheduler's process (where
the cache-manager shim lives) it draws a small share of user requests as they arrive, and for
those that turn out to have reused cached KV it later sends, when the engine has no waiting
work, the same prompt twice straight into the engine core:
- a *re-run* that reads the cache as the user's request did (same adapter, same `cache_salt`;
  its id starts with `PROBE_PREFIX`, so the shim always traces it and it gets a verdict);
- a *fresh* run with the cache bypassed, under kvtrace's own salt so its blocks never mix
  with users'.
Both decode greedily and return log-probabilities; now and then the fresh run goes twice, and
the difference between the two is the noise floor. The canary measures how far the re-run is
from the fresh run (`kvtrace.schema.divergence.divergence`) and emits a `probe` event with the
numbers. Judging them against the re-run's verdict is the analysis's work (the collector's
live path and `kvtrace analyze`), which is why the probe names the re-run.

Canary requests never reach the front end: their outputs are taken out of the scheduler's
results before the engine core returns them. After a weight update (the shim's revision moves)
the next few requests that reuse cache are probed whatever the rate, since stale reuse is most
likely then.

Costs are bounded: one probe in flight at a time, a per-minute budget, a prompt-length cap, a
bounded queue of samples (overflow counted), and nothing is sent while users' requests wait.
Every hook is fenced: a failure is counted and logged once, and the engine goes on.

Uses vLLM's engine-core internals (`preprocess_add_request`, `add_request`,
`Scheduler.update_from_output`), checked against vLLM 0.32.
"""

from __future__ import annotations

import logging
import os
import random
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from msgspec.structs import replace

from kvtrace.instrumentation.config import ConfigError
from kvtrace.instrumentation.hooks import HookSet
from kvtrace.instrumentation.vllm.verify import VERIFY_SALT, scores_from
from kvtrace.instrumentation.vllm.weights import adapter_label
from kvtrace.schema.divergence import Scores, divergence
from kvtrace.schema.events import PROBE_PREFIX
from kvtrace.schema.kinds import EventKind

log = logging.getLogger("kvtrace.vllm.canary")

_LAST = 1 << 30
"""Scheduling priority of re-runs: under vLLM's priority policy lower values go first, so every
user request goes ahead of them."""


@dataclass(frozen=True, slots=True)
class CanarySettings:
    """KVTRACE_VERIFY_* variables; the canary is off unless the rate is above 0."""

    rate: float = 0.0  # KVTRACE_VERIFY_RATE: share of requests drawn (probed if they reuse cache)
    max_per_minute: float = 6.0  # KVTRACE_VERIFY_MAX_PER_MIN: probes started per minute, at most
    max_prompt_tokens: int = 8192  # KVTRACE_VERIFY_MAX_TOKENS: longer prompts are never drawn
    n_gen: int = 4  # KVTRACE_VERIFY_N_GEN: generated tokens compared
    top_k: int = 5  # KVTRACE_VERIFY_TOP_K: log-probabilities kept per position (<= vLLM's max_logprobs)
    after_update: int = 4  # KVTRACE_VERIFY_AFTER_UPDATE: reusing requests probed after each weight update
    noise_every: int = 16  # KVTRACE_VERIFY_NOISE_EVERY: probes between noise-floor measurements
    queue: int = 8  # samples waiting for an idle engine; more are dropped and counted
    timeout_s: float = 120.0  # a probe not done by then is abandoned (its runs aborted) and counted

    @property
    def enabled(self) -> bool:
        return self.rate > 0.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> CanarySettings:
        env = os.environ if env is None else env

        def number(name: str, default: float, low: float, high: float, integer: bool = False) -> Any:
            raw = env.get(name, "").strip()
            if not raw:
                return default
            try:
                value = int(raw) if integer else float(raw)
            except ValueError:
                raise ConfigError(f"{name}={raw!r}: expected {'an integer' if integer else 'a number'}") from None
            if not (low <= value <= high):
                raise ConfigError(f"{name}={raw!r}: expected a value in [{low:g}, {high:g}]")
            return value

        return cls(rate=number("KVTRACE_VERIFY_RATE", 0.0, 0.0, 1.0),
                   max_per_minute=number("KVTRACE_VERIFY_MAX_PER_MIN", 6.0, 0.0, 1e6),
                   max_prompt_tokens=number("KVTRACE_VERIFY_MAX_TOKENS", 8192, 2, 1 << 30, True),
                   n_gen=number("KVTRACE_VERIFY_N_GEN", 4, 1, 1024, True),
                   top_k=number("KVTRACE_VERIFY_TOP_K", 5, 1, 1024, True),
                   after_update=number("KVTRACE_VERIFY_AFTER_UPDATE", 4, 0, 1 << 20, True),
                   noise_every=number("KVTRACE_VERIFY_NOISE_EVERY", 16, 1, 1 << 20, True),
                   timeout_s=number("KVTRACE_VERIFY_TIMEOUT_S", 120.0, 1.0, 86400.0))


@dataclass(slots=True)
class _Sample:
    """A user request drawn for probing: what it takes to send its prompt again."""

    request_id: str
    prompt: list[int]
    lora: Any
    salt: str | None


@dataclass(slots=True)
class _Run:
    """One canary request's outputs as they arrive."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    generated: list[dict[int, float]] = field(default_factory=list)  # top-k per generated token
    prompt_rows: list[dict[int, float]] = field(default_factory=list)  # row j scores prompt token j + 1
    cached_tokens: int = 0
    done: bool = False

    def take(self, out: Any) -> None:
        self.tokens.extend(out.new_token_ids)
        lists = out.new_logprobs
        if lists is not None:
            ids, lps = lists.logprob_token_ids, lists.logprobs
            self.generated.extend(dict(zip(ids[i].tolist(), lps[i].tolist(), strict=False)) for i in range(len(ids)))
        tensors = out.new_prompt_logprobs_tensors
        if tensors is not None:
            ids, lps = tensors.logprob_token_ids.tolist(), tensors.logprobs.tolist()
            self.prompt_rows.extend(dict(zip(i, v, strict=False)) for i, v in zip(ids, lps, strict=False))
        stats = out.prefill_stats
        if stats is not None:
            self.cached_tokens = int(stats.num_cached_tokens)
        if out.finish_reason is not None:
            self.done = True

    def scores(self, start: int) -> Scores:
        """Log-probabilities of prompt positions [start, len) and of the generated tokens.

        Rows are aligned from the end: whatever vLLM sends for the positions it served from
        cache (values it never computed), position j's row is the (len - 1 - j)-th from last."""
        rows, offset = self.prompt_rows, len(self.prompt) - 1 - len(self.prompt_rows)

        def row(j: int) -> dict[int, float]:
            at = j - 1 - offset
            return rows[at] if 0 <= at < len(rows) else {}

        return scores_from(self.prompt, row, self.tokens, self.generated, start)


@dataclass(slots=True)
class _Probe:
    sample: _Sample
    runs: dict[str, _Run]  # by request id: the roles' runs submitted so far
    ids: dict[str, str]  # role ("cached", "fresh", "noise") -> request id
    started_ns: int
    deadline: float  # time.monotonic() past which the probe is abandoned

    def done(self) -> bool:
        return all(r.done for r in self.runs.values())


@dataclass(slots=True)
class CanaryStats:
    drawn: int = 0  # user requests drawn at arrival
    sampled: int = 0  # drawn requests that reused cache: queued for a probe
    probes: int = 0  # probes finished and emitted
    dropped: int = 0  # samples dropped: the queue was full, the prompt too long, or not plain token ids
    over_budget: int = 0  # samples dropped by the per-minute budget
    abandoned: int = 0  # probes given up: timed out, aborted by the engine, or failed to submit
    errors: int = 0  # hook failures (the engine went on)


class Canary:
    """Probes a vLLM engine core's cache reuse on live traffic; `install()` once."""

    def __init__(self, core: Any, shim: Any, settings: CanarySettings, seed: int | None = None) -> None:
        self.core = core
        self.scheduler = core.scheduler
        self.shim = shim
        self.settings = settings
        self.stats = CanaryStats()
        self.floor: float | None = None  # the last measured noise floor (None: measure with the next probe)
        self._rng = random.Random(seed)
        self._watch: OrderedDict[str, _Sample] = OrderedDict()  # drawn, waiting for their prefill's hit count
        self._queue: deque[_Sample] = deque()
        self._probe: _Probe | None = None
        self._boost = 0
        self._revision = shim.identity.model_revision
        self._since_floor = 0
        self._tokens = settings.max_per_minute  # per-minute budget (a token bucket)
        self._refilled = time.monotonic()
        self.hooks = HookSet("vLLM", log, self._failed)  # what `install` wraps

    # -- install -------------------------------------------------------------------------------
    def install(self) -> Canary:
        """Follow the core's requests as they arrive and the scheduler's outputs (each hook
        fenced: a failure never fails a request). Both methods must be there."""
        core, sched = self.core, self.scheduler
        for obj, name in ((core, "add_request"), (sched, "update_from_output")):
            if getattr(obj, name, None) is None:
                raise AttributeError(f"vLLM's {type(obj).__name__} has no {name}: no canary on this engine")
        self.hooks.wrap_after(core, "add_request", self._arrived)
        self.hooks.wrap_after(sched, "update_from_output", self._outputs)
        return self

    def uninstall(self) -> None:
        self.hooks.restore()

    def busy(self) -> bool:
        """Probes running or waiting to run (tests pump the engine until this is false)."""
        return self._probe is not None or bool(self._queue)

    def _failed(self, hook: str) -> None:
        self.stats.errors += 1
        if self.stats.errors == 1:
            log.exception("kvtrace: the canary's %s hook failed; counting further failures silently", hook)

    # -- user traffic ---------------------------------------------------------------------------
    def _arrived(self, _result: Any, request: Any, *args: Any, **kwargs: Any) -> None:
        rid = str(request.request_id)
        if rid.startswith(PROBE_PREFIX) or request.sampling_params is None:
            return
        revision = self.shim.identity.model_revision
        if revision != self._revision:  # weights changed: probe the next reuses, and measure noise anew
            self._revision, self._boost, self.floor = revision, self.settings.after_update, None
        if not (self._boost > 0 or self._rng.random() < self.settings.rate):
            return
        prompt = request.prompt_token_ids
        plain = not getattr(request, "mm_features", None) and getattr(request, "prompt_embeds", None) is None
        if not plain or prompt is None or len(prompt) + self.settings.n_gen > self.settings.max_prompt_tokens:
            self.stats.dropped += 1
            return
        self.stats.drawn += 1
        self._watch[rid] = _Sample(rid, list(prompt), request.lora_request, request.cache_salt)
        while len(self._watch) > 4 * self.settings.queue:  # requests that never report (aborted) age out
            self._watch.popitem(last=False)

    def _outputs(self, outputs: Mapping[int, Any], *args: Any, **kwargs: Any) -> None:
        probe = self._probe
        for eco in outputs.values():
            keep = []
            for out in eco.outputs:
                rid = out.request_id
                if rid.startswith(PROBE_PREFIX):
                    run = probe.runs.get(rid) if probe is not None else None
                    if run is not None:
                        run.take(out)
                    continue  # never the front end's
                keep.append(out)
                if rid in self._watch and (out.prefill_stats is not None or out.finish_reason is not None):
                    self._reported(self._watch.pop(rid), out)
            if len(keep) != len(eco.outputs):
                eco.outputs = keep
        if probe is not None:
            self._advance(probe)
        if self._probe is None and self._queue and self._idle():
            self._start(self._queue.popleft())

    def _idle(self) -> bool:
        """No user request waits to be scheduled (re-runs never go ahead of users)."""
        sched = self.scheduler
        return not len(sched.waiting) and not len(getattr(sched, "kv_holding_waiting", ()) or ())

    def _reported(self, sample: _Sample, out: Any) -> None:
        stats = out.prefill_stats
        if stats is None or stats.num_cached_tokens <= 0:
            return  # nothing reused: nothing to check
        if self._boost > 0:
            self._boost -= 1
        elif not self._budget():
            self.stats.over_budget += 1
            return
        if len(self._queue) >= self.settings.queue:
            self.stats.dropped += 1
            return
        self.stats.sampled += 1
        self._queue.append(sample)

    def _budget(self) -> bool:
        now = time.monotonic()
        per_s = self.settings.max_per_minute / 60.0
        self._tokens = min(self.settings.max_per_minute, self._tokens + (now - self._refilled) * per_s)
        self._refilled = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    # -- probes ---------------------------------------------------------------------------------
    def _start(self, sample: _Sample) -> None:
        tag = uuid.uuid4().hex[:16]
        ids = {"cached": f"{PROBE_PREFIX}{tag}", "fresh": f"{PROBE_PREFIX}{tag}-fresh"}
        if self.floor is None or self._since_floor >= self.settings.noise_every:
            ids["noise"] = f"{PROBE_PREFIX}{tag}-noise"  # submitted once the fresh run is done: another batch
        probe = _Probe(sample, {}, ids, time.time_ns(), time.monotonic() + self.settings.timeout_s)
        self._probe = probe
        for role in ("cached", "fresh"):
            if not self._submit(probe, role):
                return

    def _submit(self, probe: _Probe, role: str) -> bool:
        """Send one of the probe's runs; on failure the probe is abandoned (its runs aborted)."""
        rid = probe.ids[role]
        probe.runs[rid] = _Run(probe.sample.prompt)
        try:
            self._send(rid, probe.sample, fresh=role != "cached")
        except Exception:  # noqa: BLE001 - e.g. an engine whose request API changed
            self._failed("submit")
            self._abandon(probe)
            return False
        return True

    def _send(self, rid: str, sample: _Sample, fresh: bool) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.engine import EngineCoreRequest

        k = self.settings.top_k
        limit = getattr(getattr(getattr(self.core, "vllm_config", None), "model_config", None), "max_logprobs", -1)
        if isinstance(limit, int) and limit >= 0:
            k = min(k, limit)  # the front end's check, which requests sent here skip
        # Explicit: vLLM skips the cache for any request asking prompt log-probabilities unless told not to.
        params = SamplingParams(max_tokens=self.settings.n_gen, temperature=0.0, ignore_eos=True, logprobs=k,
                                prompt_logprobs=k, skip_reading_prefix_cache=fresh)
        request = EngineCoreRequest(request_id=rid, prompt_token_ids=list(sample.prompt), mm_features=None,
                                    sampling_params=params, pooling_params=None, arrival_time=time.time(),
                                    lora_request=sample.lora, cache_salt=VERIFY_SALT if fresh else sample.salt,
                                    data_parallel_rank=None, priority=_LAST,
                                    current_wave=int(getattr(self.core, "current_wave", 0) or 0))
        req, wave = self.core.preprocess_add_request(request)
        self.core.add_request(req, wave)

    def _advance(self, probe: _Probe) -> None:
        """Finish, extend (the noise run) or give up on the probe in flight."""
        known = self.scheduler.requests
        lost = any(not run.done and rid not in known for rid, run in probe.runs.items())
        if lost or time.monotonic() > probe.deadline:  # aborted by the engine (a pause, a sleep) or stuck
            self._abandon(probe)
            return
        if not probe.done():
            return
        noise = probe.ids.get("noise")
        if noise is not None and noise not in probe.runs:
            self._submit(probe, "noise")
            return
        self._probe = None
        self._finish(probe)

    def _abandon(self, probe: _Probe) -> None:
        self._probe = None
        self.stats.abandoned += 1
        pending = [rid for rid, run in probe.runs.items() if not run.done and rid in self.scheduler.requests]
        if pending:
            try:
                self.core.abort_requests(pending)
            except Exception:  # noqa: BLE001
                self._failed("abort_requests")

    def _finish(self, probe: _Probe) -> None:
        cached = probe.runs[probe.ids["cached"]]
        fresh = probe.runs[probe.ids["fresh"]]
        start = cached.cached_tokens + 1  # vLLM computes no prompt log-probabilities for reused positions
        div = divergence(cached.scores(start), fresh.scores(start))
        if "noise" in probe.ids:
            self.floor = divergence(fresh.scores(1), probe.runs[probe.ids["noise"]].scores(1)).max_abs_diff
            self._since_floor = 0
        self._since_floor += 1
        sample = probe.sample
        event = replace(
            self.shim._event(EventKind.PROBE), request_id=probe.ids["cached"], probe_of=sample.request_id,
            tenant=sample.salt or self.shim.identity.default_tenant,
            adapter="" if sample.lora is None else adapter_label(sample.lora), prompt_tokens=len(sample.prompt),
            reported_hit_tokens=min(cached.cached_tokens, len(sample.prompt)), probe_positions=div.positions,
            probe_max_abs_diff=div.max_abs_diff, probe_mean_kl=div.mean_kl, probe_max_kl=div.max_kl,
            probe_first_token_differs=not div.first_token_match, noise_floor=self.floor or 0.0,
            duration_ns=max(time.time_ns() - probe.started_ns, 0))
        self.shim.emitter.emit(event)
        self.stats.probes += 1


def attach(core: Any, settings: CanarySettings | None = None) -> Canary | None:
    """Put a canary on one engine core whose scheduler the plugin instrumented."""
    settings = settings or CanarySettings.from_env()
    shim = getattr(core.scheduler, "_kvtrace_shim", None)
    if not settings.enabled or shim is None:
        return None
    canary = Canary(core, shim, settings).install()
    core._kvtrace_canary = canary
    log.info("kvtrace: correctness canary on (rate %g, at most %g probes a minute)", settings.rate,
             settings.max_per_minute)
    return canary
