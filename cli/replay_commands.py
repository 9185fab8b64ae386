"""`kvtrace demo`, `replay`, `experiment` and `verify`: requests driven through a cache or an
engine (the reference simulator, vLLM, SGLang, LMCache), their events stored or analyzed.

The engine replays are in `replay_engines`, the policy experiment in `experiment`, the demo and
`verify` in their own modules; each is imported when its command runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from kvtrace.cli.arguments import gib, non_negative, positive

if TYPE_CHECKING:
    from kvtrace.instrumentation.simulator import SimConfig
    from kvtrace.instrumentation.traces import TraceReader
    from kvtrace.store.client import Store


def register(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser("demo", help="replay a real trace through a hybrid multi-tier cache, analyze, report")
    demo.add_argument("--requests", type=positive, default=200,
                      help="requests of the bundled trace (1-400, default 200)")
    demo.add_argument("--report", help="HTML report path (default: $KVTRACE_HOME/demo-report.html)")
    demo.set_defaults(handler=cmd_demo, extra="all")

    replay_p = sub.add_parser("replay", help="replay a request trace through an engine into the store")
    _trace_args(replay_p)
    replay_p.add_argument("--engine", choices=["sim", "vllm", "sglang", "lmcache"], default="sim",
                          help="sim: the reference simulator (default); vllm: vLLM's own KV-cache manager, no model "
                               "(run kvtrace from vLLM's environment); sglang: SGLang's own radix cache on CPU pools, "
                               "no model (run kvtrace from SGLang's environment); lmcache: a real LMCache engine "
                               "(CPU and disk backends) storing and retrieving each request's KV (run kvtrace from "
                               "LMCache's environment)")
    replay_p.add_argument("--vllm-layout", choices=["dense", "full+sliding", "full+mamba"], default="full+sliding",
                          help="vllm: cache groups to build (default full+sliding)")
    replay_p.add_argument("--vllm-blocks", type=positive, default=16384, help="vllm: KV blocks of 16 tokens")
    replay_p.add_argument("--vllm-max-model-len", type=positive, default=1 << 17,
                          help="vllm: max_model_len; longer prompts are refused, as vLLM refuses them (default 131072)")
    replay_p.add_argument("--sglang-mix", choices=["full", "full+swa", "full+mamba", "full+swa+mamba"],
                          default="full", help="sglang: the cache's components (default full)")
    replay_p.add_argument("--sglang-core", choices=["rust", "python"], default="rust", help="sglang: tree core")
    replay_p.add_argument("--sglang-tokens", type=positive, default=1 << 18, help="sglang: device KV slots")
    replay_p.add_argument("--sglang-context-len", type=positive, default=1 << 17,
                          help="sglang: the model's context length; longer prompts are refused, as SGLang refuses them "
                               "(default 131072)")
    replay_p.add_argument("--lmcache-chunk", type=positive, default=256, help="lmcache: tokens per chunk")
    # The cache sizes in GiB (LMCache's own "GB" settings count 2**30 bytes); the -gb spellings still work.
    replay_p.add_argument("--lmcache-cpu-gib", type=gib, default=0.5, dest="lmcache_cpu_gb", metavar="GIB",
                          help="lmcache: CPU cache size in GiB")
    replay_p.add_argument("--lmcache-cpu-gb", type=gib, dest="lmcache_cpu_gb", help=argparse.SUPPRESS)
    replay_p.add_argument("--lmcache-disk-gib", type=gib, default=4.0, dest="lmcache_disk_gb", metavar="GIB",
                          help="lmcache: disk cache size in GiB (0: none)")
    replay_p.add_argument("--lmcache-disk-gb", type=gib, dest="lmcache_disk_gb", help=argparse.SUPPRESS)
    replay_p.add_argument("--lmcache-disk-dir", default="", help="lmcache: disk cache folder (default: a new temp one)")
    replay_p.add_argument("--recipe-out", help="vllm, sglang, lmcache: where to write the recipe derived from the "
                                               "engine (default MODEL.recipe.json)")
    replay_p.add_argument("--policy", default="lru", help="retention: lru, interval:N or branch")
    replay_p.add_argument("--instances", type=positive, default=1,
                          help="sim: this many engines behind a router (instances sim/0, sim/1, ...)")
    replay_p.add_argument("--route", choices=["random", "round_robin", "least_loaded", "prefix_aware"],
                          default="prefix_aware", help="sim with --instances: how the router picks an engine")
    replay_p.add_argument("--speed", type=float, default=0.0, help="0 = as fast as possible, 1 = trace time")
    replay_p.add_argument("--tenant", default="default", help="tenant for requests whose trace names none")
    replay_p.set_defaults(handler=cmd_replay, extra="store")

    verify = sub.add_parser("verify", help="prove a sample of verdicts by re-executing prompts without the cache "
                                           "(run from the engine's environment)")
    verify.add_argument("model", help="model directory or name the engine loads")
    src = verify.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", help='JSONL, one {"prompt_token_ids": [...]} per line')
    src.add_argument("--trace", help="request trace (mooncake, qwen or kvtrace JSONL): tokens from its hash ids")
    verify.add_argument("--limit", type=non_negative, default=0, help="--trace: first N requests only (0 = all)")
    verify.add_argument("--per-class", type=positive, default=2, help="requests verified per verdict class")
    verify.add_argument("--n-gen", type=positive, default=4, help="generated tokens compared per request")
    verify.add_argument("--top-k", type=positive, default=5, help="log-probabilities kept per position")
    verify.add_argument("--noise-prompts", type=positive, default=2, help="prompts run fresh twice for the floor")
    verify.add_argument("--floor-factor", type=float, default=4.0, help="divergence: above this many noise floors")
    verify.add_argument("--atol", type=float, default=1e-4, help="divergence: and above this absolute difference")
    verify.add_argument("--block-size", type=positive, default=32, help="engine KV block size (CPU: multiple of 32)")
    verify.add_argument("--max-model-len", type=positive, default=4096, help="prompts are cut to fit")
    verify.add_argument("--instance", default="verify", help="instance name the events carry")
    verify.add_argument("--no-store", action="store_true", help="print only; store nothing")
    verify.set_defaults(handler=cmd_verify, extra="analysis")

    experiment = sub.add_parser("experiment", help="compare retention policies on one trace (no store needed)")
    _trace_args(experiment)
    experiment.add_argument("--policies", default="lru,interval:512,branch", help="comma-separated policies")
    experiment.add_argument("-o", "--output", help="also write the table to this Parquet file")
    experiment.set_defaults(handler=cmd_experiment, extra="analysis")


def _trace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="trace file: mooncake, qwen or kvtrace JSONL (.gz ok)")
    p.add_argument("--format", choices=["mooncake", "qwen", "kvtrace"], help="default: detected from line 1")
    p.add_argument("--limit", type=non_negative, default=0, help="first N requests only (0 = all)")
    p.add_argument("--skip-bad", action="store_true", help="skip and count malformed lines instead of stopping")
    p.add_argument("--recipe", default="mamba-hybrid", help="built-in recipe or .json/.toml file")
    p.add_argument("--model", default="sim-model", help="model name the events carry")
    p.add_argument("--tiers-gib", default="4,16,64", help="device,host,disk capacity in GiB (0 = no tier)")
    p.add_argument("--bytes-per-token", type=positive, default=4096, help="per cache group (default 4096)")


def tier_bytes(text: str) -> tuple[int, int, int]:
    """`--tiers-gib`: device, host and disk capacity in GiB (0 = no tier; a device is needed), in bytes."""
    try:
        gib = [float(x) for x in text.split(",")]
    except ValueError:
        gib = []
    if len(gib) != 3 or min(gib) < 0 or gib[0] <= 0:
        raise ValueError(f"--tiers-gib takes device,host,disk in GiB with a device > 0, not {text!r}")
    device, host, disk = (int(g * 2**30) for g in gib)
    return device, host, disk


def _sim_config(args: argparse.Namespace) -> SimConfig:
    """The reference engine of the replay, its loads and prefills timed like one GPU's."""
    from kvtrace.instrumentation.simulator import SimConfig, gpu_timed
    from kvtrace.schema.recipes import load_recipe

    capacity = tier_bytes(args.tiers_gib)
    return gpu_timed(SimConfig(recipe=load_recipe(args.recipe), model=args.model, bytes_per_token=args.bytes_per_token,
                               capacity_bytes=capacity))


def _trace(args: argparse.Namespace) -> TraceReader:
    from kvtrace.instrumentation.traces import read_trace

    return read_trace(args.trace, args.format, skip_bad=args.skip_bad, limit=args.limit)


def _store(args: argparse.Namespace) -> Store:
    from kvtrace.store.client import Store

    return Store(args.dsn)


def cmd_replay(args: argparse.Namespace) -> int:
    if args.instances > 1 and args.engine != "sim":
        print(f"error: --instances serves a fleet of reference simulators (--engine sim), not {args.engine}",
              file=sys.stderr)
        return 2
    if args.engine in ("vllm", "sglang", "lmcache"):
        from kvtrace.cli.replay_engines import replay_lmcache, replay_sglang, replay_vllm

        run = {"vllm": replay_vllm, "sglang": replay_sglang, "lmcache": replay_lmcache}[args.engine]
        return run(args, _trace, _store)

    from kvtrace.cli.progress import bar as progress_bar
    from kvtrace.instrumentation.replay import ReplayOptions
    from kvtrace.instrumentation.simulator import PolicySpec
    from kvtrace.instrumentation.traces import TraceError
    from kvtrace.schema.recipes import RecipeError
    from kvtrace.store.client import Store

    try:
        config = PolicySpec.parse(args.policy).apply(_sim_config(args))
        reader = _trace(args)
        with Store(args.dsn) as store:
            # after the store's client: without the store extra, that is the one named
            from kvtrace.instrumentation.fleet import RoutePolicy
            from kvtrace.instrumentation.recording import record_fleet_replay

            store.init()
            with progress_bar(desc="replay", unit="req", disable=None) as bar:
                recorded = record_fleet_replay(store, reader, config, args.instances, RoutePolicy(args.route),
                                               ReplayOptions(speed=args.speed, tenant=args.tenant),
                                               progress=lambda _: bar.update())
    except (TraceError, RecipeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report, stats = recorded.report, recorded.stats
    print(f"replayed {report.requests} requests ({report.prompt_tokens} prompt tokens, "
          f"{report.adopted_tokens} adopted) in {report.seconds:.1f} s: {stats.exported} events stored, "
          f"{stats.dropped} dropped")
    if reader.skipped:
        print(f"skipped {reader.skipped} malformed lines; first: {reader.errors[0]}", file=sys.stderr)
    print("next: kvtrace analyze" + ("   (each lookup judged by the recipe its engine published)" if args.instances == 1
                                      else " --fleet   (where in the fleet each prompt was recoverable)"))
    return 1 if stats.dropped else 0


def cmd_experiment(args: argparse.Namespace) -> int:
    import polars as pl

    from kvtrace.cli.experiment import compare, display
    from kvtrace.cli.progress import bar as progress_bar
    from kvtrace.instrumentation.simulator import PolicySpec
    from kvtrace.instrumentation.traces import TraceError
    from kvtrace.schema.recipes import RecipeError

    try:
        specs = [PolicySpec.parse(p) for p in args.policies.split(",") if p]
        config = _sim_config(args)
        trace = list(_trace(args))
        with progress_bar(total=len(trace) * len(specs), desc="policies", unit="req", disable=None) as bar:
            table = compare(trace, config, specs, progress=lambda _s, _n: bar.update())
    except (TraceError, RecipeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.output:
        table.write_parquet(args.output)
    with pl.Config(tbl_hide_dataframe_shape=True, tbl_hide_column_data_types=True, tbl_width_chars=200,
                   tbl_cols=20):
        print(display(table))
    for row in table.iter_rows(named=True):
        print(f"{row['policy']:<13} {row['note']}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from kvtrace.cli.verify import run_verify

    return run_verify(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from kvtrace.cli.demo import run_demo

    return run_demo(args.dsn, requests=args.requests, report=args.report)
