"""`kvtrace demo`: trace a small prefix-sharing workload end to end into the store.

This first version drives a tiny single-group LRU prefix cache (device tier only) through the
real emitter and store sink, then reads the numbers back with SQL. The hybrid multi-tier
simulator, the bundled real trace and the full analysis replace it as those parts land.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from urllib.parse import quote

from kvtrace.analysis.funnel import funnel, results_frame
from kvtrace.analysis.reconstruct import Reconstructor
from kvtrace.schema.recipes import dense
from kvtrace.collector.store import Store, default_dsn, parse_dsn
from kvtrace.instrumentation.emitter import BatchEmitter
from kvtrace.instrumentation.sinks.store import StoreSink
from kvtrace.schema.arrow import from_arrow
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import ComponentKind, EventKind, Reason, Tier

DEMO_DATABASE = "kvtrace_demo"
BLOCK = 16
CAPACITY_BLOCKS = 256


def _chain(parts: list[int]) -> list[int]:
    """Prefix-chained keys: a block's key depends on every block before it."""
    out, parent = [], 0
    for part in parts:
        parent = hash((parent, part)) & 0xFFFFFFFFFFFFFFFF or 1
        out.append(parent)
    return out


def _workload(requests: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for i in range(requests):
        system = rng.randrange(4)  # four shared system prompts
        doc = rng.randrange(max(1, requests // 8))  # documents asked about more than once
        parts = [1000 + system * 10 + k for k in range(4)]
        parts += [100000 + doc * 100 + k for k in range(rng.randint(2, 12))]
        parts += [10**7 + i * 100 + k for k in range(rng.randint(1, 4))]  # the unique question
        prompts.append(parts)
    return prompts


def _simulate(emitter: BatchEmitter, prompts: list[list[int]]) -> None:
    cache: OrderedDict[int, int] = OrderedDict()  # block key -> parent key, in LRU order
    ident = {"engine": "sim", "instance": "demo-0", "model": "demo-llama", "block_size": BLOCK}
    for i, parts in enumerate(prompts):
        keys = _chain(parts)
        rid = f"req-{i}"
        hit = 0
        while hit < len(keys) and keys[hit] in cache:
            cache.move_to_end(keys[hit])
            hit += 1
        prompt = len(keys) * BLOCK
        emitter.emit(Event(kind=EventKind.LOOKUP, request_id=rid,
                           prompt_tokens=prompt, group_block_keys=[keys], group_hit_tokens=[hit * BLOCK],
                           reported_hit_tokens=hit * BLOCK, **ident))
        for j in range(hit, len(keys)):
            parent = keys[j - 1] if j else 0
            common = dict(component=ComponentKind.FULL_ATTENTION, block_key=keys[j], parent_key=parent,
                          token_start=j * BLOCK, token_end=(j + 1) * BLOCK, tier=Tier.DEVICE, nbytes=BLOCK * 4096)
            emitter.emit(Event(kind=EventKind.CREATE, **common, **ident))
            emitter.emit(Event(kind=EventKind.COMMIT, **common, **ident))
            cache[keys[j]] = parent
            while len(cache) > CAPACITY_BLOCKS:
                victim, _ = cache.popitem(last=False)
                emitter.emit(Event(kind=EventKind.EVICT, block_key=victim,
                                   component=ComponentKind.FULL_ATTENTION, tier=Tier.DEVICE,
                                   reason=Reason.CAPACITY, **ident))
        emitter.emit(Event(kind=EventKind.ADOPT, request_id=rid,
                           reused_tiers=[Tier.DEVICE] if hit else [], reused_tokens=[hit * BLOCK] if hit else [],
                           recomputed_tokens=prompt - hit * BLOCK, **ident))


def run_demo(dsn: str | None = None, requests: int = 200) -> int:
    base = parse_dsn(dsn or default_dsn())
    demo_dsn = f"chdb://{base.path}?database={DEMO_DATABASE}" if base.embedded else \
        f"{base.scheme}://{quote(base.username, safe='')}:{quote(base.password, safe='')}@{base.host}:{base.port}/{DEMO_DATABASE}"
    started = time.monotonic()
    with Store(demo_dsn) as store:
        print(f"[1/3] store {store.dsn}: resetting the demo database")
        store.client.command(f"DROP DATABASE IF EXISTS {DEMO_DATABASE}")
        store.init()
        print(f"[2/3] tracing {requests} requests through the emitter into the store")
        emitter = BatchEmitter(StoreSink(store), instance="demo-0", engine="sim", register_atexit=False)
        _simulate(emitter, _workload(requests))
        emitter.shutdown()
        stats = emitter.stats()
        print("[3/3] reading it back")
        by_kind = {
            r["kind"]: r["n"]
            for r in store.query_arrow(
                f"SELECT kind, count() AS n FROM {DEMO_DATABASE}.events FINAL GROUP BY kind"
            ).to_pylist()
        }
        rates = store.query_arrow(
            f"SELECT sumIf(reported_hit_tokens, kind = 'lookup') AS logical, "
            f"sumIf(arraySum(reused_tokens), kind = 'adopt') AS adopted, "
            f"sumIf(prompt_tokens, kind = 'lookup') AS prompt FROM {DEMO_DATABASE}.events FINAL"
        ).to_pylist()[0]
        results = results_frame(
            Reconstructor(dense(BLOCK)).run(
                e for table in store.iter_event_batches() for e in from_arrow(table)
            )
        )
    summary = funnel(results).row(0, named=True)
    total = sum(by_kind.values())
    print()
    print(f"requests          {requests}")
    print(f"events stored     {total}  ({', '.join(f'{k} {v}' for k, v in sorted(by_kind.items()))})")
    print(f"emitter           emitted {stats.emitted}, exported {stats.exported}, dropped {stats.dropped}")
    prompt = rates["prompt"] or 1
    print(f"logical hit rate  {rates['logical'] / prompt:.1%} of prompt tokens (hash lookup)")
    print(f"recoverable rate  {summary['recoverable_token_rate']:.1%} of prompt tokens (reconstructed, dense recipe)")
    print(f"adopted hit rate  {rates['adopted'] / prompt:.1%} of prompt tokens (reused by the engine)")
    print(f"unsafe reuse      {summary['unsafe_reuse']} lookups")
    print()
    print("This demo runs a dense single-tier cache; the hybrid multi-tier simulator with fault")
    print("injection, the bundled real trace and the HTML report are not built yet.")
    print(f"Data: {store.dsn}   ({time.monotonic() - started:.1f} s)")
    print("Next: kvtrace db status --dsn '<that DSN>'; kvtrace export -o events.parquet; duckdb on the file")
    return 0
