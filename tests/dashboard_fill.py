"""Stores for the dashboard tests, and a real `kvtrace dashboard` over one, drawn by headless Chromium.

`replay` fills a store from the cache simulator (two engines over ten minutes, one of which
reuses unsafely) and judges it. chDB hosts one engine directory per process, so a store that a
separate `kvtrace dashboard` process serves is filled in a process of its own:

    python tests/dashboard_fill.py fill DSN SCENARIO   # prints what the store says, as JSON
    python tests/dashboard_fill.py docs/img/dashboard.png

The second form regenerates the README's screenshot of the funnel page.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from enum import StrEnum
from pathlib import Path

import httpx
import polars as pl

from kvtrace.analysis.evaluate import Policy
from kvtrace.analysis.run import stream_results
from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.simulator import AdoptPolicy, CacheSimulator, Fault, SimConfig, SimRequest
from kvtrace.instrumentation.sinks.store import StoreSink
from kvtrace.schema.arrow import conform, to_arrow
from kvtrace.schema.recipes import BUILTIN
from kvtrace.schema.verdicts import Agreement, LookupResult, Verdict, Verification
from kvtrace.store.client import Store

S = 10**9
ROOT = Path(__file__).resolve().parents[1]


class Scenario(StrEnum):
    FULL = "full"  # a correct engine and one that reuses unsafely, judged
    NO_VERDICTS = "no_verdicts"  # the same events, never analyzed
    SAFE = "safe"  # only the correct engine: zero unsafe reuses
    EMPTY = "empty"  # an initialized store with nothing in it


ENGINES = (("engine-a", AdoptPolicy.COMPLETE), ("engine-b", AdoptPolicy.LOGICAL))


def replay(store: Store, engines: tuple[tuple[str, AdoptPolicy], ...] = ENGINES, verdicts: bool = True) -> None:
    """Engines over ten minutes: a correct one, and one that adopts whatever the hash matched
    (unsafe reuse) while checkpoints go missing; both offload and reload."""
    recipe = BUILTIN["mamba-hybrid"]
    for instance, adopt in engines:
        emitter = BatchEmitter(StoreSink(store), BatchConfig(max_queue_size=1 << 20), register_atexit=False,
                               instance=instance)
        sim = CacheSimulator(SimConfig(recipe=recipe, model="jamba", instance=instance, adopt=adopt,
                                       capacity_bytes=(12 << 20, 1 << 30, 0), load_latency_ns=(40_000, 0),
                                       prefill_ns_per_token=30_000, prefill_ns_per_token_pair=3), emitter)
        docs = [list(range(d * 10_000, d * 10_000 + 512 * (1 + d % 3))) for d in range(8)]
        for i in range(80):
            doc = docs[i % len(docs)]
            request = SimRequest(f"{instance}-{i}", [*doc, i, i, i], tenant=f"t{i % 2}",
                                 arrival_ns=sim.config.start_ns + i * 7 * S)
            if i % 9 == 4:
                sim.inject(Fault.SKIP_CHECKPOINT, request, len(doc) // 256 * 256)
            sim.serve(request)
            if i % 20 == 7:  # preempted after its prefill and admitted again: counted apart
                sim.serve(SimRequest(request.request_id, request.tokens, tenant=request.tenant,
                                     arrival_ns=request.arrival_ns + S, preemptions=1,
                                     computed_before_preemption=len(request.tokens) - 1))
        assert emitter.shutdown()
    if not verdicts:
        return
    # Judged with the fleet view (the stream path): the two engines serve the same documents, so
    # the fleet page has regret to show; the other columns are what every path gives.
    judged = stream_results(store, recipe, Policy(fleet=True))
    store.insert_arrow("verdicts", conform(judged.to_arrow(), LookupResult))
    # What `kvtrace verify` would store for a few of them (its engine side runs in the vLLM suite).
    checks = [Verification(ts_ns=r["ts_ns"], run_id="t", instance=r["instance"], request_id=r["request_id"],
                           model=r["model"], tenant=r["tenant"], verdict=Verdict(r["verdict"]),
                           unsafe_reuse=r["unsafe_reuse"], adopted_tokens=r["adopted_tokens"],
                           max_abs_diff=2.5 if r["unsafe_reuse"] else 0.0,
                           agreement=Agreement.ALARM_CONFIRMED if r["unsafe_reuse"] else Agreement.IDENTICAL)
              for inst, _ in engines
              for r in judged.filter((pl.col("instance") == inst)
                                     & (pl.col("adopted_tokens") > 0)).head(2).to_dicts()]
    store.insert_arrow("verifications", to_arrow(checks, Verification))


def fill(store: Store, scenario: Scenario) -> None:
    if scenario is Scenario.FULL:
        replay(store)
    elif scenario is Scenario.NO_VERDICTS:
        replay(store, verdicts=False)
    elif scenario is Scenario.SAFE:
        replay(store, ENGINES[:1])


def store_says(store: Store) -> dict[str, object]:
    """The headline numbers from the verdict rows themselves (read whole, summed here: not the
    dashboard's SQL), with the events' time bounds."""
    every = store.query_polars(f"SELECT * FROM {store.db}.verdicts FINAL")
    rows = every.filter(pl.col("preemptions") == 0) if every.height else every  # the first admissions
    bounds = store.query_arrow(f"SELECT min(ts_ns) AS lo, max(ts_ns) AS hi FROM {store.db}.events").to_pylist()[0]
    out: dict[str, object] = {"lookups": rows.height, "lo": (bounds["lo"] or 0) // S,
                              "hi": (bounds["hi"] or 0) // S + 1 if bounds["hi"] else 0}
    if rows.height:
        prompt = rows["prompt_tokens"].sum()
        out |= {"logical_rate": rows["logical_hit_tokens"].sum() / prompt,
                "recoverable_rate": rows["recoverable_hit_tokens"].sum() / prompt,
                "adopted_rate": rows["adopted_tokens"].sum() / prompt,
                "tokens_lost": int(rows["logical_hit_tokens"].sum() - rows["recoverable_hit_tokens"].sum()),
                "unsafe_reuses": int(every["unsafe_reuse"].sum()),
                "readmissions": every.height - rows.height,
                "recomputed_on_resume": int((every["computed_before_preemption"].cast(pl.Int64)
                                             - every["adopted_tokens"].cast(pl.Int64)).clip(0).sum()),
                "verdicts": {v: int(n) for v, n in rows.group_by("verdict").len().iter_rows()}}
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(home: Path) -> dict[str, str]:
    env = {**os.environ, "KVTRACE_HOME": str(home)}
    env.pop("KVTRACE_DSN", None)
    return env


def filled(root: Path, scenario: Scenario) -> tuple[str, dict[str, object]]:
    """A store under `root`, filled in a process of its own; its DSN and what it says."""
    dsn = f"chdb://{root / 'db'}"
    done = subprocess.run([sys.executable, __file__, "fill", dsn, scenario.value], capture_output=True, text=True,
                          timeout=600, env=_env(root))
    assert done.returncode == 0, done.stderr[-3000:]
    return dsn, json.loads(done.stdout.strip().splitlines()[-1])


class DashboardProcess:
    """`kvtrace dashboard` in its own process over a DSN."""

    def __init__(self, root: Path, dsn: str) -> None:
        self.root, self.dsn, self.port = root, dsn, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = root / "dashboard.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> DashboardProcess:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvtrace.cli.main", "--dsn", self.dsn, "dashboard",
                                          "--port", str(self.port)], env=_env(self.root), stdout=log, stderr=log)
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the dashboard did not come up"
            try:
                if httpx.get(self.url + "/static/plotly.min.js", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "headless Chromium is needed (Debian's `chromium`; scripts/test.sh installs it)"
    return path


def _args() -> list[str]:
    return [chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--hide-scrollbars", "--enable-logging=stderr", "--v=0", "--virtual-time-budget=15000"]


def dom(url: str) -> tuple[str, list[str]]:
    """The page's DOM once its scripts ran (plotly drew), and the console lines Chromium logged."""
    done = subprocess.run([*_args(), "--dump-dom", url], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout, [line for line in done.stderr.splitlines() if "CONSOLE" in line]


def screenshot(url: str, path: Path, size: str = "1300,1900") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([*_args(), f"--window-size={size}", f"--screenshot={path}", url], capture_output=True,
                   timeout=180, check=True)
    return path


def regenerate_readme_image(target: Path) -> Path:
    """The funnel page of a filled store, as docs/img/dashboard.png shows it."""
    with tempfile.TemporaryDirectory(prefix="kvtrace-shot-") as tmp:
        root = Path(tmp)
        dsn, _ = filled(root, Scenario.FULL)
        with DashboardProcess(root, dsn) as dash:
            return screenshot(f"{dash.url}/?range=all", target, "1300,1500")


def main(argv: list[str]) -> int:
    if argv[:1] == ["fill"]:
        dsn, scenario = argv[1], Scenario(argv[2])
        with Store(dsn) as store:
            store.init()
            fill(store, scenario)
            print(json.dumps(store_says(store)))
        return 0
    if len(argv) == 1:
        print(regenerate_readme_image(Path(argv[0]).resolve()))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
