"""What kvtrace adds to a vLLM process: import time, modules and memory, tracing off vs on.

Runs in the vLLM venv (`bash scripts/engine-venv.sh vllm` builds it):

    .venvs/vllm/bin/python benchmarks/bench_engine_footprint.py [--rounds 3]

Each run is a fresh interpreter running the engine of tests/engines/vllm/test_footprint.py (a
tiny random-weight Llama on the CPU, the engine core in-process, the same five requests with
shared prefixes) under `-X importtime`, in one of three variants chosen by environment only:

  none   kvtrace's plugin not loaded (VLLM_PLUGINS names every other vLLM plugin): the baseline
  off    the plugin loaded, KVTRACE_ENABLED=0 (what an engine image with kvtrace installed pays)
  on     KVTRACE_ENABLED=1, the default spool sink, into a temporary directory

Per run: the import time of kvtrace's modules (the cumulative `-X importtime` time of every
kvtrace import not nested in another one, so what they pulled in counts too), the modules the
process holds after serving (and how many more than `none`), its resident set size then (VmRSS)
and at peak (VmHWM), and its start-up time (imports and engine build). A round runs the three
variants in a rotating order; the table gives medians over the rounds, the deltas to `none`
paired within each round, and `on` over `off` ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from importlib.metadata import entry_points
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[1] / "tests" / "engines" / "vllm" / "test_footprint.py"
sys.path.insert(0, str(ENGINE.parent))
from test_footprint import FORBIDDEN, engine_env  # noqa: E402 - the engine and its environment, as the test has them

VARIANTS = ("none", "off", "on")


def kvtrace_import_us(stderr: str) -> tuple[int, int]:
    """(kvtrace's import time, the whole process's import time) in microseconds, from `-X importtime`.

    Its lines come children first; read backwards, each line's ancestors are the lines above it
    with a smaller indent. A kvtrace line without a kvtrace ancestor is one import kvtrace started:
    its cumulative time holds everything that import loaded."""
    lines = []
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "imported package" in line:
            continue
        _, cumulative, name = line[len("import time:"):].split("|")
        depth = (len(name) - len(name.lstrip(" "))) // 2
        lines.append((depth, int(cumulative), name.strip()))
    kvtrace = total = 0
    stack: list[tuple[int, bool]] = []  # (depth, is kvtrace) of the ancestors of the line read
    for depth, cumulative, name in reversed(lines):
        while stack and stack[-1][0] >= depth:
            stack.pop()
        mine = name == "kvtrace" or name.startswith("kvtrace.")
        if mine and not any(k for _, k in stack):
            kvtrace += cumulative
        if depth == 0:
            total += cumulative
        stack.append((depth, mine))
    return kvtrace, total


def run(variant: str, work: Path) -> dict:
    env = engine_env(work, tracing=variant == "on")
    if variant == "none":
        others = sorted({e.name for e in entry_points(group="vllm.general_plugins")} - {"kvtrace"})
        env["VLLM_PLUGINS"] = ",".join(others) or "none"
    proc = subprocess.run([sys.executable, "-X", "importtime", str(ENGINE), str(work)], check=False, env=env,
                          capture_output=True, text=True, timeout=600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise SystemExit(f"{variant}: the engine failed\n{proc.stderr[-4000:]}")
    got = json.loads(line[len("RESULT "):])
    got["kvtrace_us"], got["imports_us"] = kvtrace_import_us(proc.stderr)
    got["kvtrace_modules"] = sum(m == "kvtrace" or m.startswith("kvtrace.") for m in got["modules"])
    if got["traced"] != (variant == "on"):
        raise SystemExit(f"{variant}: the plugin {'did not attach' if variant == 'on' else 'attached'}")
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="kvtrace-bench-footprint-") as tmp:
        for r in range(args.rounds):
            for variant in VARIANTS[r % 3 :] + VARIANTS[: r % 3]:
                runs[variant].append(run(variant, Path(tmp) / f"{r}-{variant}"))
                print(f"round {r + 1}/{args.rounds}: {variant} done", file=sys.stderr)
    cached = {v: {tuple(x["cached"]) for x in runs[v]} for v in VARIANTS}
    if len({c for cs in cached.values() for c in cs}) != 1:
        raise SystemExit(f"the variants disagree on vLLM's cached tokens: {cached}")

    def med(variant: str, key: str, scale: float = 1.0) -> float:
        return statistics.median(x[key] for x in runs[variant]) / scale

    def delta(variant: str, key: str, scale: float = 1.0) -> float:
        """Median over the rounds of the difference to `none` in the same round."""
        pairs = zip(runs[variant], runs["none"], strict=True)
        return statistics.median(a[key] - b[key] for a, b in pairs) / scale

    for x in (y for v in VARIANTS for y in runs[v]):
        x["module_count"] = len(x["modules"])
        x["startup_s"] = x["import_s"] + x["build_s"]
    base = {frozenset(x["modules"]) for x in runs["none"]}
    added = {v: statistics.median(len(set(x["modules"]) - set(b["modules"]))
                                  for x, b in zip(runs[v], runs["none"], strict=True)) for v in VARIANTS}
    print(f"vLLM in-process engine, tiny Llama on the CPU, {len(runs['on'][0]['cached'])} requests "
          f"(cached tokens {runs['on'][0]['cached']} in every run), {args.rounds} rounds, medians"
          + ("" if len(base) == 1 else f"; the baseline's module set varied over {len(base)} runs"))
    print(f"{'variant':<8} {'kvtrace import ms':>17} {'% of imports':>12} {'modules':>8} {'kvtrace':>8} "
          f"{'added':>6} {'RSS MB':>8} {'RSS +MB':>8} {'peak +MB':>9} {'start-up s':>11}")
    for v in VARIANTS:
        share = statistics.median(x["kvtrace_us"] / x["imports_us"] for x in runs[v]) * 100
        print(f"{v:<8} {med(v, 'kvtrace_us', 1e3):>17.1f} {share:>11.2f}% {med(v, 'module_count'):>8.0f} "
              f"{med(v, 'kvtrace_modules'):>8.0f} {added[v]:>6.0f} {med(v, 'rss_kb', 1024):>8.1f} "
              f"{delta(v, 'rss_kb', 1024):>8.1f} {delta(v, 'peak_rss_kb', 1024):>9.1f} "
              f"{med(v, 'startup_s'):>11.2f}")

    def ratio(key: str, over: str) -> float:
        """Median over the rounds of `on` over `over` in the same round."""
        return statistics.median(a[key] / b[key] for a, b in zip(runs["on"], runs[over], strict=True))

    print(f"on / off: kvtrace import time {ratio('kvtrace_us', 'off'):.2f}x, kvtrace modules "
          f"{ratio('kvtrace_modules', 'off'):.2f}x, modules {ratio('module_count', 'off'):.4f}x, "
          f"RSS {ratio('rss_kb', 'off'):.4f}x, start-up {ratio('startup_s', 'off'):.3f}x")
    print(f"on / none: modules {ratio('module_count', 'none'):.4f}x, RSS {ratio('rss_kb', 'none'):.4f}x, "
          f"start-up {ratio('startup_s', 'none'):.3f}x")
    forbidden = sorted({m.split(".")[0] for a, b in zip(runs["on"], runs["none"], strict=True)
                        for m in set(a["modules"]) - set(b["modules"])} & FORBIDDEN)
    print(f"store, DataFrame, query-engine or web packages tracing added: {', '.join(forbidden) or 'none'}")

if __name__ == "__main__":
    main()
