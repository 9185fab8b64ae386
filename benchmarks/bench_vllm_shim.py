"""What the vLLM shim costs: a real trace through vLLM's own KV-cache manager, shim off vs on.

Runs in the vLLM venv (`bash scripts/engine-venv.sh vllm` builds it):

    .venvs/vllm/bin/python benchmarks/bench_vllm_shim.py [--requests 2000] [--rounds 4] [--layout full+sliding]

Four variants replay the same requests of the Mooncake conversation trace (tokens synthesized
from its hash ids) through `kvtrace.instrumentation.vllm.driver`, each on its own manager:

  off        vLLM's KVCacheManager alone (prefix caching and stats on)
  kvtrace    the same with CacheManagerShim installed, emitting through BatchEmitter into a
             sink that counts and drops (the export path is measured by bench_export.py);
             events wait in memory, the worker encodes them (`--encode`) or not (the default)
  journal    the same, events encoded into the emitter's journal as they are emitted (what an
             engine process that sends to a collector or spool files runs by default), the
             worker handing the records to the counting sink as they are
  kv-events  vLLM's own KV-event path instead: enable_kv_cache_events=True and the queue drained
             after every request with take_events(), as the scheduler does before publishing

The requests are split into rounds; in each round every variant replays the round's slice on
its own manager, in a rotating order, so drift on a shared machine lands on all of them. The
table gives each variant's total time and its ratio to `off` (a variant's time includes flushing
its emitter after each round, so the work left to its worker is charged to it, not to the next
variant), the same in CPU time of the whole process (steadier than wall time on a shared host),
the events kvtrace emitted per second of replay, and its drop count.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from counting_sink import CountingSink, EncodingSink  # beside this script

from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter, JournalConfig
from kvtrace.instrumentation.replay import tokens_of
from kvtrace.instrumentation.traces import read_trace
from kvtrace.instrumentation.vllm.driver import Driver, DriverConfig, Layout, build_manager
from kvtrace.instrumentation.vllm.shim import CacheManagerShim, Identity

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


class GcPauses:
    """The garbage collector's runs and time while each variant replays (gc.callbacks), charged
    to the variant whose thread (or emitter worker) allocated enough to start them."""

    def __init__(self) -> None:
        self.variant = ""
        self.runs: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self.variant:
            self.runs[self.variant] = self.runs.get(self.variant, 0) + 1
            self.seconds[self.variant] = self.seconds.get(self.variant, 0.0) + time.perf_counter() - self._started


VARIANTS = ("off", "kvtrace", "journal", "kv-events")


class Variant:
    """One variant's manager, driver and (for the traced ones) emitter and journal folder."""

    def __init__(self, name: str, config: DriverConfig, args: argparse.Namespace) -> None:
        self.name = name
        self.driver = Driver(build_manager(config, enable_kv_cache_events=name == "kv-events"), config)
        self.emitter: BatchEmitter | None = None
        self._folder: tempfile.TemporaryDirectory[str] | None = None
        self.kv_events = 0
        if name == "kvtrace":
            sink = EncodingSink() if args.encode else CountingSink()
            self.emitter = BatchEmitter(sink, BatchConfig(max_queue_size=1 << 20), register_atexit=False)
        elif name == "journal":
            self._folder = tempfile.TemporaryDirectory(prefix="bench-vllm-", dir=args.journal_dir)
            self.emitter = BatchEmitter(CountingSink(), BatchConfig(max_queue_size=1 << 20), register_atexit=False,
                                        journal=JournalConfig(self._folder.name, 64 << 20, shipper=None,
                                                              ship_leftovers=False))
            if self.emitter._journal is None:
                raise SystemExit("no journal could be made in the temporary directory")
        if self.emitter is not None:
            CacheManagerShim(self.driver.manager, self.emitter, Identity(instance="bench", model="m")).install()

    def replay(self, chunk: list[tuple[str, list[int]]]) -> None:
        driver = self.driver
        for rid, tokens in chunk:
            driver.serve(rid, tokens)
            if self.name == "kv-events":
                self.kv_events += len(driver.manager.take_events())
        # A variant is charged for the work it left its emitter's worker, which would otherwise
        # run during the next variant's replay.
        if self.emitter is not None:
            self.emitter.force_flush(timeout_millis=120_000)

    def close(self) -> tuple[int, int, int]:
        """(vLLM's hit tokens, events emitted, events dropped)."""
        emitted = dropped = 0
        if self.emitter is not None:
            self.emitter.force_flush(timeout_millis=120_000)
            self.emitter.shutdown()
            stats = self.emitter.stats()
            emitted, dropped = stats.emitted, stats.dropped
        if self._folder is not None:
            self._folder.cleanup()
        return self.driver.stats().hits, emitted, dropped


def freeze(args: argparse.Namespace) -> None:
    if not args.no_freeze:  # as vLLM's EngineCore does once it has started (vllm.utils.gc_utils.freeze_gc_heap)
        gc.collect()
        gc.freeze()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--isolated", type=int, default=0, metavar="N",
                    help="instead of one process, run each variant in a process of its own, N times over, the "
                         "order rotating; print each variant's CPU time over off's in the same repetition")
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--layout", choices=[x.value for x in Layout], default=Layout.SLIDING.value)
    ap.add_argument("--num-blocks", type=int, default=16384)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--journal-dir", type=Path, default=None,
                    help="where the journal variant's journal lives (default: a new folder under the system "
                         "temporary directory); e.g. /dev/shm for a journal in memory-backed files")
    ap.add_argument("--no-freeze", action="store_true",
                    help="leave the start-up heap (the managers' block pools) to the garbage collector; vLLM's "
                         "engine core freezes it (gc.freeze) after start-up, so the default does the same")
    ap.add_argument("--encode", action="store_true",
                    help="the in-memory variant's sink encodes each batch (msgpack rows), as the spool and HTTP "
                         "sinks do, so the worker's encoding is in its time as it is in the journal's")
    args = ap.parse_args()

    trace = list(read_trace(args.trace, limit=args.requests))
    prompts = [(r.request_id, tokens_of(r)) for r in trace]
    config = DriverConfig(layout=Layout(args.layout), num_blocks=args.num_blocks)
    if args.child:
        child(args, prompts, config)
    elif args.isolated:
        isolated(args, len(prompts))
    else:
        shared(args, prompts, config)


def child(args: argparse.Namespace, prompts: list[tuple[str, list[int]]], config: DriverConfig) -> None:
    variant = Variant(args.child, config, args)
    freeze(args)
    started, cpu_started = time.perf_counter(), time.process_time()
    variant.replay(prompts)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    hits, emitted, dropped = variant.close()
    print(json.dumps({"wall": wall, "cpu": cpu, "hits": hits, "emitted": emitted, "dropped": dropped}))


def isolated(args: argparse.Namespace, requests: int) -> None:
    """Each variant alone in a fresh process: no other manager's memory in its caches, no
    interpreter state shared with another variant. Repetitions rotate the order, and each
    variant's ratio is taken against off's run in the same repetition."""
    passed = ["--requests", str(args.requests), "--layout", args.layout, "--num-blocks", str(args.num_blocks),
              "--trace", str(args.trace), *(["--journal-dir", str(args.journal_dir)] if args.journal_dir else []),
              *(["--no-freeze"] if args.no_freeze else []), *(["--encode"] if args.encode else [])]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    for rep in range(args.isolated):
        for name in VARIANTS[rep % len(VARIANTS):] + VARIANTS[: rep % len(VARIANTS)]:
            out = subprocess.run([sys.executable, __file__, *passed, "--child", name], check=True,
                                 capture_output=True, text=True).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
    hits = {r["hits"] for rs in runs.values() for r in rs}
    if len(hits) != 1:
        raise SystemExit(f"the variants disagree on hits: {hits}")
    print(f"{requests} requests of {args.trace.name}, layout {args.layout}, each variant alone in a process, "
          f"{args.isolated} repetitions; vLLM hits {hits.pop():,} tokens in every run")
    print(f"{'variant':<10} {'cpu s (median)':>15} {'cpu x off (median)':>19} {'cpu x off (each)':>30} {'dropped':>8}")
    for name, rs in runs.items():
        ratios = [r["cpu"] / o["cpu"] for r, o in zip(rs, runs["off"], strict=True)]
        print(f"{name:<10} {statistics.median(r['cpu'] for r in rs):>15.2f} {statistics.median(ratios):>19.3f} "
              f"{' '.join(f'{x:.3f}' for x in ratios):>30} {sum(r['dropped'] for r in rs):>8}")


def shared(args: argparse.Namespace, prompts: list[tuple[str, list[int]]], config: DriverConfig) -> None:
    """Every variant in this process, each on its own manager, in interleaved rounds."""
    variants = {name: Variant(name, config, args) for name in VARIANTS}
    freeze(args)
    pauses = GcPauses()
    seconds = dict.fromkeys(variants, 0.0)
    cpu = dict.fromkeys(variants, 0.0)  # CPU time of the whole process: steadier than wall time on a busy host
    per_round: dict[str, list[float]] = {k: [] for k in variants}
    size = -(-len(prompts) // args.rounds)
    names = list(variants)
    for r in range(args.rounds):
        chunk = prompts[r * size : (r + 1) * size]
        for name in names[r % len(names) :] + names[: r % len(names)]:
            pauses.variant = name
            started, cpu_started = time.perf_counter(), time.process_time()
            variants[name].replay(chunk)
            elapsed = time.perf_counter() - started
            seconds[name] += elapsed
            cpu[name] += time.process_time() - cpu_started
            per_round[name].append(elapsed)
    pauses.variant = ""
    closed = {name: v.close() for name, v in variants.items()}
    hits = {name: c[0] for name, c in closed.items()}
    if len(set(hits.values())) != 1:
        raise SystemExit(f"the variants disagree on hits: {hits}")

    print(f"{len(prompts)} requests of {args.trace.name}, layout {args.layout}, {args.rounds} rounds; "
          f"vLLM hits {hits['off']:,} tokens in every variant; start-up heap "
          + ("left to the collector" if args.no_freeze else "frozen, as vLLM's engine core does"))
    print(f"{'variant':<10} {'seconds':>8} {'x off':>7} {'x off (median round)':>21} {'cpu s':>7} {'cpu x off':>10}"
          f" {'gc runs':>8} {'gc s':>6}")
    for name in variants:
        ratios = [a / b for a, b in zip(per_round[name], per_round["off"], strict=True)]
        print(f"{name:<10} {seconds[name]:>8.2f} {seconds[name] / seconds['off']:>7.3f} "
              f"{statistics.median(ratios):>21.3f} {cpu[name]:>7.2f} {cpu[name] / cpu['off']:>10.3f}"
              f" {pauses.runs.get(name, 0):>8} {pauses.seconds.get(name, 0.0):>6.2f}")
    _, emitted, dropped = closed["kvtrace"]
    encoded = " (the worker encoded every batch)" if args.encode else " (the worker encoded nothing)"
    print(f"kvtrace: {emitted:,} events emitted ({emitted / seconds['kvtrace']:,.0f} per second of replay), "
          f"{dropped} dropped{encoded}")
    _, emitted, dropped = closed["journal"]
    print(f"journal: {emitted:,} events emitted, {dropped} dropped")
    print(f"vLLM KV events drained: {variants['kv-events'].kv_events:,}")


if __name__ == "__main__":
    main()
