"""What the LMCache shim costs: store + retrieve through a real LMCache engine, shim off vs on.

Runs in the LMCache venv (`bash scripts/engine-venv.sh lmcache` builds it):

    .venvs/lmcache/bin/python benchmarks/bench_lmcache_shim.py [--requests 64] [--rounds 4] \
        [--max-tokens 2048] [--geometry qwen0.5b|tiny] [--no-disk]

Two engines with LMCache's local CPU backend and its local disk backend (each its own cache
and folder), one bare and one with `LMCacheShim` emitting through `BatchEmitter` into a sink
that counts and drops (the export path is measured by bench_export.py). Each request of the
Mooncake conversation trace (tokens synthesized from its hash ids, cut to `--max-tokens`) is
stored, then retrieved, as a serving engine's connector does after a prefill and for a later
hit; the disk writes LMCache started are waited for at the end of each slice, so their hooks
are inside the measurement. Requests are split into rounds; each round both engines replay
the round's slice, in alternating order, so drift on a shared machine lands on both.

The KV geometry decides how much work LMCache does per chunk and so what a fixed per-chunk
cost of the shim weighs: `qwen0.5b` is the smallest real model class (24 layers, 2 KV heads of
64, bf16: 12 KiB a token, 3 MiB a 256-token chunk); `tiny` (1 layer, 8 lanes, fp32: 16 KiB a
chunk) shows the worst case, where LMCache's own per-chunk Python work is nearly all there is.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from counting_sink import CountingSink  # beside this script

from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.lmcache.cpu import EngineSpec, build_engine, destroy_engine
from kvtrace.instrumentation.lmcache.driver import kv_for, wait_for_disk
from kvtrace.instrumentation.lmcache.shim import LMCacheShim
from kvtrace.instrumentation.replay import tokens_of
from kvtrace.instrumentation.traces import read_trace

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
GEOMETRY = {
    "qwen0.5b": EngineSpec(layers=24, heads=2, head_size=64, dtype=torch.bfloat16),
    "tiny": EngineSpec(layers=1, heads=1, head_size=8),
}


def run_slice(engine, spec: EngineSpec, prompts: list[tuple[str, list[int], torch.Tensor]]) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    for rid, tokens, kv in prompts:
        slots = torch.arange(len(tokens))
        engine.store(tokens, kvcaches=kv, slot_mapping=slots)
        out = torch.empty_like(kv)
        engine.retrieve(tokens, kvcaches=out, slot_mapping=slots, req_id=rid)
    wait_for_disk(engine, timeout_s=600)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--geometry", choices=sorted(GEOMETRY), default="qwen0.5b")
    ap.add_argument("--cpu-gb", type=float, default=1.0)
    ap.add_argument("--no-disk", action="store_true")
    ap.add_argument("--trace", default=str(TRACE))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp(prefix="kvtrace-bench-lmcache-"))
    try:
        base = replace(GEOMETRY[args.geometry], cpu_gb=args.cpu_gb, disk_gb=64.0)
        specs = {name: replace(base, disk_path="" if args.no_disk else str(folder / name))
                 for name in ("off", "kvtrace")}
        engines = {name: build_engine(spec, f"bench-{name}") for name, spec in specs.items()}
        sink = CountingSink()
        emitter = BatchEmitter(sink, BatchConfig(max_queue_size=1 << 20), register_atexit=False)
        shim = LMCacheShim(engines["kvtrace"], emitter, instance="bench").install()
        requests = [(r.request_id, tokens_of(r)[: args.max_tokens])
                    for r in read_trace(args.trace, limit=args.requests)]
        prompts = [(rid, tokens, kv_for(base, tokens)) for rid, tokens in requests]
        chunks = sum(-(-len(t) // base.chunk_size) for _, t, _ in prompts)
        print(f"{len(prompts)} requests, {sum(len(t) for _, t, _ in prompts)} tokens, {chunks} chunks of "
              f"{base.chunk_bytes / 2**20:.2f} MiB ({args.geometry}); CPU cache {args.cpu_gb} GB, "
              f"disk {'off' if args.no_disk else 'on'}; {args.rounds} rounds", flush=True)
        run_slice(engines["off"], base, prompts[:2])  # warm both: allocator pages, disk folders, lazy imports
        run_slice(engines["kvtrace"], base, prompts[:2])
        times = {name: 0.0 for name in engines}
        per_round = []
        step = max(len(prompts) // args.rounds, 1)
        for i in range(args.rounds):
            piece = prompts[i * step:(i + 1) * step]
            order = ["off", "kvtrace"] if i % 2 == 0 else ["kvtrace", "off"]
            took = {name: run_slice(engines[name], base, piece) for name in order}
            for name, t in took.items():
                times[name] += t
            per_round.append(took["kvtrace"] / took["off"])
        emitter.force_flush(60_000)
        stats = emitter.stats()
        ratio = times["kvtrace"] / times["off"]
        print(f"{'variant':<10}{'seconds':>10}{'ratio':>8}")
        for name in ("off", "kvtrace"):
            print(f"{name:<10}{times[name]:>10.2f}{times[name] / times['off']:>8.3f}")
        print(f"per-round ratios: {' '.join(f'{r:.3f}' for r in per_round)} "
              f"(median {statistics.median(per_round):.3f})")
        print(f"events {sink.events} ({sink.events / times['kvtrace']:.0f}/s), dropped {stats.dropped}, "
              f"shim errors {shim.errors}; target <= 1.10x: {'met' if ratio <= 1.10 else 'NOT met'}")
        emitter.shutdown()
        for name in engines:
            destroy_engine(f"bench-{name}")
    finally:
        # The disk tier holds GBs of chunk files: never leave them behind, even on Ctrl-C.
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
