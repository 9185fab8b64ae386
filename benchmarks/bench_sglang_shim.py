"""What the SGLang shim costs: a real trace through SGLang's own radix cache, shim off vs on.

Runs in the SGLang venv (`bash scripts/engine-venv.sh sglang` builds it):

    .venvs/sglang/bin/python benchmarks/bench_sglang_shim.py [--requests 1000] [--rounds 4] \
        [--mix full] [--route scheduler|cache] [--core rust] [--kv-tokens 131072] [--sink count|encode] \
        [--hicache [--host-ratio 16]]
    .venvs/sglang/bin/python benchmarks/bench_sglang_shim.py --profile [--requests 500]

Five variants replay the same requests of the Mooncake conversation trace (tokens synthesized
from its hash ids) through `kvtrace.instrumentation.sglang.driver`, each on its own
`UnifiedRadixCache` (own pools, own tree). By default (`--route scheduler`, full attention) each
request takes the steps SGLang's scheduler runs for it (match through the request, lock, a
request-pool row, `release_kv_cache` with its checkpoint); `--route cache` calls the cache's
methods directly, as the other mixes always do:

  off              SGLang's cache alone (its KV events off)
  kvtrace          the same with RadixCacheShim installed (and told each admission, as the
                   scheduler would), emitting through BatchEmitter into a sink that counts and
                   drops (the export path is measured by bench_export.py); with `--sink encode`
                   it first encodes each batch as msgpack rows, as the spool and HTTP sinks do,
                   so the exporter thread's share of the engine process is in the time
  kvtrace-sampled  the shim with sample_rate=0.1 (lookups and adopts of 1 request in 10;
                   commits and evictions are always reported)
  kvtrace-process  the out-of-process mode (`sglang/capture.py`): the scheduler thread copies what
                   the shim reads into a shared-memory ring, and a resolver process runs the
                   same shim there; a round ends when the resolver has handled and exported all
                   of it
  kv-events        SGLang's own KV-event path instead: enable_kv_cache_events=True and the
                   queue drained after every request with take_events(), as the scheduler does
                   when a publisher exists

The requests are split into rounds; in each round every variant replays the round's slice on
its own cache, in a rotating order, so drift on a shared machine lands on all of them. A
kvtrace variant's round ends when its emitter has flushed, so the exporter thread's share
(little, with the counting sink) is inside the time. The
table gives each variant's total time and its ratio to `off`, the events kvtrace emitted per
second of replay, and its drop count.

torch runs on one thread (`--torch-threads 1`): the pools are tiny CPU tensors standing in for
device memory, and with torch's default of one thread per core a `torch.cat` of a few thousand
slots waits for a second thread that a shared machine has often lent elsewhere (milliseconds
per call, in every variant alike), which buries what is being measured.

`--hicache` gives every variant's cache HiCache's host tier (write-through, `--host-ratio` device
pools of host memory, SGLang's own controller with CPU stand-ins for the accelerator copies) and
runs the scheduler's per-step poll (`check_hicache_events`) after every request, inside the
time; requests take the cache route, which loads host hits back.

`--breakdown` replays the requests once without and once with the shim (no profiler) and
times the shim's hooks and their main steps where they run, in microseconds per request. The
profiler slows Python calls more than C ones; these timers do not, and they show what a step
costs with the caches as SGLang's own work leaves them (two to four times its cost in a
tight loop).

`--capture-floor` measures the least the out-of-process mode (`kvtrace-process`) could cost the
request path: the same wrapped methods copying what the capture copies (the request's tokens,
the page starts of each insert and free, and an insert's tokens where it names no request, as on
the cache route) into kvtrace's own ring, one record each, without the capture's other records,
its bookkeeping or a resolver (the read position just follows the write one). It reports that
against `off` with the same alternation of order as the main table. Full attention only.

`--profile` instead replays the requests once through a shim-equipped cache under cProfile and
lists the functions in kvtrace's own code (the SGLang shim, its key chains, the emitter, the
event schema) by their own time and their time with callees, as shares of the whole replay.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from array import array
from pathlib import Path
from typing import Any

import torch
from counting_sink import CountingSink, EncodingSink  # beside this script

from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.replay import tokens_of
from kvtrace.instrumentation.ring import Ring
from kvtrace.instrumentation.sglang.capture import ProcessShim, unsupported
from kvtrace.instrumentation.sglang.driver import Driver, DriverConfig, Mix, Route, build_cache, enable_hicache
from kvtrace.instrumentation.sglang.ledger import page_starts
from kvtrace.instrumentation.sglang.shim import Identity, RadixCacheShim
from kvtrace.instrumentation.traces import read_trace

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
SHIMMED = {"kvtrace": 1.0, "kvtrace-sampled": 0.1}


SINKS = {"count": CountingSink, "encode": EncodingSink}


def _emitter(sink: str = "count") -> BatchEmitter:
    return BatchEmitter(SINKS[sink](), BatchConfig(max_queue_size=1 << 20), register_atexit=False)


def _shimmed(config: DriverConfig, emitter: BatchEmitter,
             sample_rate: float, host_ratio: float | None = None) -> tuple[Driver, RadixCacheShim]:
    cache, allocator, req_pool = build_cache(config)
    identity = Identity(instance="bench", model="m")
    shim = RadixCacheShim(cache, emitter, identity, sample_rate=sample_rate).install()
    if host_ratio is not None:  # added after the shim, as SGLang does: the shim follows `init_hicache`
        enable_hicache(cache, host_ratio=host_ratio)
    return Driver(cache, allocator, req_pool, config, shim=shim), shim


def _built(config: DriverConfig, host_ratio: float | None = None, **kwargs: Any) -> tuple[Any, Any, Any]:
    """A cache (with HiCache's host tier of `host_ratio` device pools, unless None), its
    allocator and request pool."""
    cache, allocator, req_pool = build_cache(config, **kwargs)
    if host_ratio is not None:
        enable_hicache(cache, host_ratio=host_ratio)
    return cache, allocator, req_pool


def _plain(config: DriverConfig, host_ratio: float | None = None, **kwargs: Any) -> Driver:
    return Driver(*_built(config, host_ratio, **kwargs), config)


# Closures the shim puts in place of SGLang's methods: they call the originals, so only their own
# time is kvtrace's.
WRAPPERS = {"wrapper", "_apply_cache_action", "free_host_values"}


def _warm(prompts: list[tuple[str, array]], config: DriverConfig, n: int, host_ratio: float | None = None) -> None:
    """Serve the first requests on throwaway caches of each kind, untimed: one-off costs (SGLang
    loading its native hasher on the first hash, first calls into torch and the tree core) land
    here instead of on whichever variant runs first."""
    emitter = _emitter()
    events_on = _plain(config, host_ratio, enable_kv_cache_events=True)
    for driver in (_shimmed(config, emitter, 1.0, host_ratio)[0], events_on):
        for rid, tokens in prompts[:n]:
            driver.serve(f"warm-{rid}", tokens)
            if host_ratio is not None:
                driver.cache.check_hicache_events()
        driver.cache.take_events()
    emitter.shutdown()


def _where(filename: str) -> str | None:
    """The repo-relative path of a profiled function's file, None outside kvtrace's own code
    (builtins, SGLang, torch, the venvs) and for the driver, which stands in for the engine."""
    if filename.startswith(("~", "<")):
        return None
    try:
        rel = Path(filename).resolve().relative_to(REPO)
    except ValueError:
        return None
    if rel.parts[0].startswith(".") or rel.name == "driver.py":
        return None
    return str(rel)


def profile(prompts: list[tuple[str, array]], config: DriverConfig, top: int) -> None:
    """Replay once under cProfile. kvtrace's cost is every kvtrace function entered from outside
    kvtrace (the driver, SGLang, a wrapper closure), with its callees, plus the wrappers' own
    time. A row's `own` is its self time plus that of the builtins it calls directly (tolist,
    dict.pop, the C hasher), split by caller."""
    emitter = _emitter()
    driver, shim = _shimmed(config, emitter, 1.0)
    profiler = cProfile.Profile()  # after _warm: one-off costs are not the shim's
    started = time.perf_counter()
    profiler.enable()
    for rid, tokens in prompts:
        driver.serve(rid, tokens)
    profiler.disable()
    wall = time.perf_counter() - started
    emitter.force_flush(timeout_millis=120_000)
    emitter.shutdown()
    table = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    total = sum(tt for (_cc, _nc, tt, _ct, _callers) in table.values())
    where = {f: _where(f[0]) for f in table}
    ours = {f for f, w in where.items() if w is not None}
    inner = {f for f in ours if f[2] not in WRAPPERS}
    own = {f: table[f][2] for f in ours}
    entered = 0.0
    for f, (_cc, _nc, _tt, _ct, callers) in table.items():
        for caller, (_cnc, _ccc, ctt, cct) in callers.items():
            if f in inner and caller not in inner:
                entered += cct  # kvtrace entered from outside: all of it, callees included
            if f[0] == "~" and caller in ours:
                own[caller] += ctt
    cost = entered + sum(table[f][2] for f in ours - inner)
    print(f"profile: {len(prompts)} requests, mix {config.mix.value}, {config.route} route, core {config.tree_core}, "
          f"page {config.page_size}; "
          f"{wall:.2f} s under the profiler, {emitter.stats().emitted:,} events, shim errors {shim.errors}")
    print(f"kvtrace (shim hooks with everything they call, the emitter, the wrappers' own time): "
          f"{cost:.2f} s "
          f"= {cost / total:.1%} of the {total:.2f} s profiled replay")
    rows = sorted(((own[f], table[f][3], table[f][1], f"{where[f]}:{f[1]} {f[2]}") for f in ours),
                  reverse=True)
    print(f"\n{'own s':>7} {'own %':>6} {'cum s':>7} {'cum %':>6} {'calls':>8}  "
          "kvtrace function (by own time)")
    for owned, cum, ncalls, name in rows[:top]:
        print(f"{owned:>7.3f} {owned / total:>6.1%} {cum:>7.3f} {cum / total:>6.1%} {ncalls:>8,}  {name}")
    print("\nbuiltins called from kvtrace functions (self time, by caller):")
    calls = []
    for f, (_cc, _nc, _tt, _ct, callers) in table.items():
        if f[0] == "~":
            for caller, (cnc, _ccc, ctt, _cct) in callers.items():
                if caller in ours:
                    calls.append((ctt, cnc, f[2], f"{where[caller]}:{caller[1]} {caller[2]}"))
    for ctt, cnc, name, caller in sorted(calls, reverse=True)[:top]:
        print(f"{ctt:>7.3f} {ctt / total:>6.1%} {cnc:>9,}  {name}  <- {caller}")
    print("\nwhole replay, top functions anywhere by self time:")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


# What --breakdown times: the hooks SGLang's calls enter (top level), then steps inside them.
HOOKS = ("after_lookup", "before_insert", "after_insert", "_flush", "_on_device_free", "record_admission")
STEPS = (("shim", "_emit_run"), ("shim", "_chain_of"), ("shim", "install_slots"), ("shim", "_free"),
         ("keys", "Chain.extend"), ("keys", "Chain.ints"), ("ledger", "SlotBook.take"), ("ledger", "SlotBook.put"))


def breakdown(prompts: list[tuple[str, array]], config: DriverConfig) -> None:
    """Per-request cost of each hook, timed in place; the steps are inside the hooks."""
    from kvtrace.instrumentation.sglang import keys, ledger
    from kvtrace.instrumentation.sglang import shim as shim_module

    spent: dict[str, float] = {}
    modules = {"shim": shim_module, "keys": keys, "ledger": ledger}

    def timed(owner: object, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def run(*args: object, **kwargs: object) -> object:
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - started

        setattr(owner, name, run)

    for name in HOOKS:
        timed(RadixCacheShim, name, name)
    for module, dotted in STEPS:
        owner: object = modules[module]
        *path, name = dotted.split(".")
        for part in path:
            owner = getattr(owner, part)
        if module == "shim":
            owner = RadixCacheShim
        timed(owner, name, dotted)
    # The shim module imported these two by name: its calls go to its own references.
    timed(shim_module, "as_slots", "as_slots")
    timed(shim_module, "unique", "unique")
    off = Driver(*build_cache(config), config)
    started = time.perf_counter()
    for rid, tokens in prompts:
        off.serve(rid, tokens)
    off_s = time.perf_counter() - started
    emitter = _emitter()
    driver, _shim = _shimmed(config, emitter, 1.0)
    started = time.perf_counter()
    for rid, tokens in prompts:
        driver.serve(rid, tokens)
    emitter.force_flush(timeout_millis=120_000)
    on_s = time.perf_counter() - started
    emitter.shutdown()
    n = len(prompts)
    print(f"breakdown: {n} requests, mix {config.mix.value}, {config.route} route, core {config.tree_core}, "
          f"page {config.page_size}: "
          f"off {off_s / n * 1e6:.0f} us a request, with the shim {on_s / n * 1e6:.0f} "
          f"(+{(on_s - off_s) / n * 1e6:.0f}; the timers add ~1 us a call)")
    print(f"{'us/request':>10}  hook (top level)")
    for name in HOOKS:
        print(f"{spent.get(name, 0.0) / n * 1e6:>10.1f}  {name}")
    print(f"{'us/request':>10}  step (inside the hooks above)")
    for label, secs in sorted(((k, v) for k, v in spent.items() if k not in HOOKS), key=lambda kv: -kv[1]):
        print(f"{secs / n * 1e6:>10.1f}  {label}")


def _capture_only(cache: Any, ring: Ring, page: int) -> None:
    """Wrap the methods the capture wraps; copy into `ring` what it copies and nothing more:
    the request's tokens at its lookup, the page starts of each insert and free, and an
    insert's tokens where it names no request (on the cache route). Nothing reads the ring: the
    read position follows the write one, as a consumer that kept up would move it."""
    match, insert, action, checkpoint = cache.match_prefix, cache.insert, cache._apply_cache_action, cache.checkpoint
    inside = [False]  # in a request's checkpoint: its insert's tokens are the request's, sent at its lookup

    def put(kind: int, value: int, blobs: tuple[Any, ...]) -> None:
        ring.offer(kind, value, blobs)
        ring.release(ring.position)

    def match_prefix(params: Any) -> Any:
        result = match(params)
        tokens = params.req.origin_input_ids if params.req is not None else params.key.token_ids
        put(1, int(result.device_prefix_len), (tokens,))
        return result

    def checkpoint_(*args: Any, **kwargs: Any) -> Any:
        inside[0] = True
        try:
            return checkpoint(*args, **kwargs)
        finally:
            inside[0] = False

    def insert_(params: Any) -> Any:
        result = insert(params)
        slots = page_starts(params.value, page)
        put(3, int(result.prefix_len), (slots,) if inside[0] else (params.key.token_ids, slots))
        return result

    def apply(cache_action: Any) -> Any:
        indices = getattr(cache_action, "indices", None)
        if indices is not None:
            put(4, 0, (page_starts(indices, page),))
        return action(cache_action)

    cache.match_prefix, cache.insert, cache._apply_cache_action = match_prefix, insert_, apply
    cache.checkpoint = checkpoint_


def capture_floor(prompts: list[tuple[str, array]], config: DriverConfig, rounds: int) -> None:
    ring = Ring.create(64 << 20)
    drivers = {"off": Driver(*build_cache(config), config)}
    cache, allocator, req_pool = build_cache(config)
    _capture_only(cache, ring, int(cache.page_size))
    drivers["capture"] = Driver(cache, allocator, req_pool, config)
    seconds = dict.fromkeys(drivers, 0.0)
    size = -(-len(prompts) // rounds)
    for r in range(rounds):
        chunk = prompts[r * size : (r + 1) * size]
        for name in (list(drivers) if r % 2 else list(drivers)[::-1]):
            started = time.perf_counter()
            for rid, tokens in chunk:
                drivers[name].serve(rid, tokens)
            seconds[name] += time.perf_counter() - started
    ring.close()
    n = len(prompts)
    print(f"capture floor: {n} requests, mix {config.mix.value}, {config.route} route, {rounds} rounds: "
          f"off {seconds['off'] / n * 1e6:.0f} us "
          f"a request, copying to a ring {seconds['capture'] / n * 1e6:.0f} us = "
          f"{seconds['capture'] / seconds['off']:.3f}x off")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--mix", choices=[x.value for x in Mix], default=Mix.FULL.value)
    ap.add_argument("--core", choices=["rust", "python"], default="rust")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--route", choices=[x.value for x in Route], default=Route.SCHEDULER.value,
                    help="how requests reach the cache (see the driver): through the scheduler's own "
                         "request-level steps (full attention only; other mixes fall back to the cache "
                         "route), or straight into the cache's methods")
    ap.add_argument("--kv-tokens", type=int, default=1 << 17)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--profile", action="store_true", help="profile the kvtrace variant instead of timing")
    ap.add_argument("--breakdown", action="store_true",
                    help="time the shim's hooks in place (us per request) instead of the variants")
    ap.add_argument("--capture-floor", action="store_true",
                    help="measure the copy-only floor of an out-of-process design (see the docstring)")
    ap.add_argument("--sink", choices=list(SINKS), default="count",
                    help="what the emitters export into: count and drop, or also encode each batch as "
                         "msgpack rows, as the spool and HTTP sinks do (the exporter's share of the time)")
    ap.add_argument("--hicache", action="store_true",
                    help="give every variant's cache HiCache's host tier (write-through, CPU stand-ins "
                         "for the accelerator copies), polled after every request as the scheduler does; "
                         "cache route")
    ap.add_argument("--host-ratio", type=float, default=16.0,
                    help="HiCache's host pool in device pools (at 2, SGLang's default, this trace's reuse "
                         "distance is longer than the host tier and nothing comes back from it)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=20,
                    help="requests served untimed on throwaway caches first")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads (default 1; see the module docstring)")
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)
    tiers = args.host_ratio if args.hicache else None  # HiCache's host pool, in device pools

    mix = Mix(args.mix)
    page = 1 if mix in (Mix.MAMBA, Mix.SWA_MAMBA) else args.page_size  # SGLang's Mamba mixes need page 1
    # the driver takes HiCache by the cache route
    route = Route(args.route) if mix is Mix.FULL and not args.hicache else Route.CACHE
    config = DriverConfig(mix=mix, page_size=page, kv_tokens=args.kv_tokens, tree_core=args.core, route=route)
    trace = list(read_trace(args.trace, limit=args.requests))
    # Token ids as SGLang's scheduler receives them (array("q"), built in its tokenizer process):
    # the conversion from a list is not the cache's work, and would be ~1/3 of `off`.
    prompts = [(r.request_id, array("q", tokens_of(r))) for r in trace]
    _warm(prompts, config, args.warmup, tiers)
    if args.profile:
        profile(prompts, config, args.top)
        return
    if args.breakdown:
        breakdown(prompts, config)
        return
    if args.capture_floor:
        if mix is not Mix.FULL:  # it reads every free as a token pool's pages
            raise SystemExit("--capture-floor measures full attention only (--mix full)")
        capture_floor(prompts, config, args.rounds)
        return

    emitters = {name: _emitter(args.sink) for name in SHIMMED}
    shims: dict[str, RadixCacheShim] = {}
    drivers: dict[str, Driver] = {"off": _plain(config, tiers)}
    for name, rate in SHIMMED.items():
        drivers[name], shims[name] = _shimmed(config, emitters[name], rate, tiers)
    drivers["kv-events"] = _plain(config, tiers, enable_kv_cache_events=True)
    process = None
    cache, allocator, req_pool = _built(config, tiers)
    if unsupported(cache) is None:
        process = ProcessShim(cache, Identity(instance="bench", model="m"),
                              sink=f"counting_sink:{SINKS[args.sink].__name__}")
        process.start().flush(120)  # the resolver is up and has imported what it needs
        drivers["kvtrace-process"] = Driver(cache, allocator, req_pool, config, shim=process)
    names = list(drivers)
    seconds = dict.fromkeys(names, 0.0)
    per_round: dict[str, list[float]] = {k: [] for k in names}
    hits = dict.fromkeys(names, 0)
    kv_events = 0
    resolver_wait = 0.0
    size = -(-len(prompts) // args.rounds)
    for r in range(args.rounds):
        chunk = prompts[r * size : (r + 1) * size]
        for name in names[r % len(names) :] + names[: r % len(names)]:
            driver = drivers[name]
            drain = driver.cache.take_events if name == "kv-events" else None
            hit = 0
            started = time.perf_counter()
            poll = driver.cache.check_hicache_events if tiers is not None else None
            for rid, tokens in chunk:
                hit += driver.serve(rid, tokens).reused
                if poll is not None:  # the scheduler's per-step poll: backups acknowledged
                    poll()
                if drain is not None:
                    kv_events += len(drain())
            if name in emitters:  # the exporter thread's share counts too
                emitters[name].force_flush(timeout_millis=120_000)
            elif name == "kvtrace-process":  # and the resolver's
                waited = time.perf_counter()
                if not process.flush(120):
                    raise SystemExit("the resolver did not catch up within 120 s")
                resolver_wait += time.perf_counter() - waited
            elapsed = time.perf_counter() - started
            seconds[name] += elapsed
            per_round[name].append(elapsed)
            hits[name] += hit
        print(f"  round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {per_round[n][-1]:.2f} s" for n in names),
              file=sys.stderr)
    stats = {}
    for name, emitter in emitters.items():
        emitter.force_flush(timeout_millis=120_000)
        emitter.shutdown()
        stats[name] = emitter.stats()
    if len(set(hits.values())) != 1:
        raise SystemExit(f"the variants disagree on hits: {hits}")

    print(f"{len(prompts)} requests of {args.trace.name}, mix {mix.value}, {route} route, {args.core} core, "
          f"page {page}, {args.kv_tokens:,} KV slots, {args.rounds} rounds, sink {args.sink}; "
          f"SGLang reused {hits['off']:,} tokens in every variant")
    print(f"{'variant':<16} {'seconds':>8} {'x off':>7} {'x off (median round)':>21}")
    for name in names:
        ratios = [a / b for a, b in zip(per_round[name], per_round["off"], strict=True)]
        print(f"{name:<16} {seconds[name]:>8.2f} {seconds[name] / seconds['off']:>7.3f} "
              f"{statistics.median(ratios):>21.3f}")
    for name, st in stats.items():
        rate = st.emitted / seconds[name]
        print(f"{name}: {st.emitted:,} events emitted ({rate:,.0f} per second of replay), "
              f"{st.exported:,} exported, {st.dropped} dropped, shim errors {shims[name].errors}")
    if process is not None:
        st = process.stats()
        cpu = _cpu_seconds(process.process.pid)
        process.close()
        print(f"kvtrace-process: {st.records:,} records, {st.dropped} dropped, {st.events:,} events emitted by the "
              f"resolver, resolver errors {st.resolver_errors}; the resolver process used {cpu:.2f} s of CPU "
              f"on another core; the variant's time includes {resolver_wait:.2f} s of waiting for it at the "
              f"rounds' ends (an engine never waits for it)")
    print(f"SGLang KV events drained: {kv_events:,}")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU of a live process, from /proc (Linux); nan elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


if __name__ == "__main__":
    main()
