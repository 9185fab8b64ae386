"""The wheel as users get it: built from the working tree in an isolated build, installed (not
editable) into clean virtual environments made here, one with the core alone and one with `all`.

- The wheel holds every module and data file of the tree's rooms (packages are found, not listed).
- Every module the wheel holds is imported, each in a fresh interpreter. With the core alone the
  engine side (kvtrace.schema, kvtrace.instrumentation) imports, but for the few modules in
  BEYOND_CORE and ENGINE_ONLY, which must fail on what they are said to need (so the tables
  cannot go stale); the other rooms may fail only on a module one of the extras installs. With
  `all`, everything imports but the modules that drive an engine.
- With the core alone, `kvtrace` runs and a command that needs an extra says which, in one line;
  a sink whose extra is missing is refused at start-up, naming it.
- Spool files written by the reference simulator through the core's emitter (default spool sink,
  configured from the environment) are ingested and analyzed with `all`, and the analysis counts
  what the simulator served.

It downloads and installs the `all` dependencies (about 360 MB of wheels) each run: the file
took 77-111 s on two shared cores (installs ~25 s, importing every module ~30 s, removing the
venvs at the end 10-15 s).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
ENGINE_SIDE = frozenset({"schema", "instrumentation"})  # the rooms an engine process imports from
# What the engine side must not load: stores, DataFrames, query engines, web frameworks.
FORBIDDEN = frozenset({"clickhouse_connect", "chdb", "polars", "pyarrow", "duckdb", "fastapi", "plotly"})
_SGLANG = "kvtrace.instrumentation.sglang."
_STORE = frozenset({"pyarrow", "polars", "clickhouse_connect", "chdb"})  # the `store` extra (with `arrow`)
# Engine-side modules that need more than the core, and the top-level modules they may find
# missing there: Arrow and the store (extras `arrow`, `store`), or numpy, which every engine ships.
BEYOND_CORE: dict[str, frozenset[str]] = {
    "kvtrace.schema.arrow": frozenset({"pyarrow"}),
    "kvtrace.schema.arrow_checks": frozenset({"pyarrow", "numpy"}),
    "kvtrace.schema.arrow_wire": frozenset({"pyarrow"}),
    "kvtrace.instrumentation.sinks.store": _STORE,
    "kvtrace.instrumentation.recording": _STORE,
    "kvtrace.instrumentation.page_keys": frozenset({"numpy"}),
    "kvtrace.instrumentation.ring": frozenset({"numpy"}),
    **{_SGLANG + m: frozenset({"numpy"})
       for m in ("capture", "hicache", "keys", "ledger", "resolver", "shim")},
}
# Modules that drive or plug into an engine: they fail even with every extra, on their engine or
# the torch it brings.
ENGINE_ONLY: dict[str, frozenset[str]] = {
    "kvtrace.instrumentation.lmcache.cpu": frozenset({"lmcache", "torch"}),
    "kvtrace.instrumentation.lmcache.driver": frozenset({"lmcache", "torch"}),
    "kvtrace.instrumentation.sglang.driver": frozenset({"sglang", "torch"}),
    "kvtrace.instrumentation.vllm.connector": frozenset({"vllm", "torch"}),
    "kvtrace.instrumentation.vllm.driver": frozenset({"vllm", "torch"}),
}

# One import in a fresh interpreter; a failure printed as [type, missing module, message].
IMPORT_ONE = """
import importlib, json, sys
try:
    importlib.import_module(sys.argv[1])
except BaseException as exc:
    print(json.dumps([type(exc).__name__, getattr(exc, "name", None), str(exc)]))
"""
# Top-level modules the environment's distributions install.
TOP_LEVEL = "import importlib.metadata as m, json; print(json.dumps(sorted(m.packages_distributions())))"
# An engine's start with the core alone: the emitter configured from the environment (spool
# sink by default), a few dozen requests with shared prefixes through the reference simulator.
SERVE = """
import json, random, sys
from kvtrace.instrumentation.config import configure
from kvtrace.instrumentation.simulator import CacheSimulator, SimConfig, SimRequest
from kvtrace.schema.recipes import BUILTIN

emitter = configure(engine="sim")
sim = CacheSimulator(SimConfig(recipe=BUILTIN["mamba-hybrid"], model="wheel-model"), emitter)
rng = random.Random(30)
prefixes = [list(range(1000 * p, 1000 * p + 256)) for p in range(1, 4)]
outcomes = []
for i in range(36):
    shared = rng.choice(prefixes)[: rng.choice((64, 128, 256))]
    own = range(10_000 + 100 * i, 10_000 + 100 * i + rng.randint(1, 90))
    outcomes.append(sim.serve(SimRequest(f"r{i}", [*shared, *own], tenant="t1")))
flushed = emitter.shutdown()
stats = emitter.stats()
print(json.dumps({
    "emitter": type(emitter).__name__, "flushed": flushed, "events": sim.events, "emitted": stats.emitted,
    "exported": stats.exported, "dropped": stats.dropped,
    "prompt_tokens": {o.request_id: o.prompt_tokens for o in outcomes},
    "adopted_tokens": {o.request_id: o.adopted_tokens for o in outcomes}, "modules": sorted(sys.modules),
}))
"""
# An engine plugin's start with KVTRACE_SINK=store and the core alone.
START_WITH_STORE_SINK = """
import logging, sys
logging.basicConfig(format="%(levelname)s %(message)s", stream=sys.stdout)
from kvtrace.instrumentation.config import ConfigError, EmitterSettings
try:
    EmitterSettings.from_env()
    print("accepted")
except ConfigError as exc:
    print(f"refused: {exc}")
from kvtrace.instrumentation.vllm.plugin import register
register()
from kvtrace.instrumentation.api import get_emitter
print(f"emitter: {type(get_emitter()).__name__}")
"""


def _env(home: Path, **extra: str) -> dict[str, str]:
    """The environment a user's shell would give: no PYTHON* paths, no kvtrace settings but ours."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVTRACE_", "PYTHON", "VIRTUAL_ENV"))}
    return {**env, "KVTRACE_HOME": str(home), **extra}


def _run(cmd: list[str | Path], timeout: float = 120, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(c) for c in cmd], check=False, capture_output=True, text=True, timeout=timeout,
                          **kwargs)


def _bin(env_dir: Path, name: str) -> Path:
    return env_dir / "bin" / name


def _pip_install(env_dir: Path, requirement: str, cache: Path) -> None:
    """pip keeps its downloads under the test's own temporary folder (shared by its venvs)."""
    venv.create(env_dir, with_pip=True)
    proc = _run([_bin(env_dir, "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                 "--no-compile", "--cache-dir", cache, requirement], timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _tree_files() -> list[Path]:
    """The working tree as git sees it: tracked and untracked files, none it ignores."""
    proc = _run(["git", "-C", ROOT, "ls-files", "-z", "--cached", "--others", "--exclude-standard"])
    assert proc.returncode == 0, proc.stderr
    return [Path(p) for p in proc.stdout.split("\0") if p and (ROOT / p).is_file()]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("wheel")
    yield path
    shutil.rmtree(path, ignore_errors=True)  # over a GB of venvs: pytest would keep three runs' worth


@pytest.fixture(scope="module")
def tree(base: Path) -> Path:
    """A copy of the working tree: the build writes its build/ and egg-info there, not here."""
    dst = base / "tree"
    for rel in _tree_files():
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dst / rel)
    return dst


@pytest.fixture(scope="module")
def wheel(base: Path, tree: Path) -> Path:
    proc = _run([sys.executable, "-m", "build", "--wheel", "--outdir", base / "dist", tree], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (built,) = (base / "dist").glob("kvtrace-*.whl")
    return built


@pytest.fixture(scope="module")
def core(base: Path, wheel: Path) -> Path:
    _pip_install(base / "core", str(wheel), base / "pip-cache")
    return base / "core"


@pytest.fixture(scope="module")
def everything(base: Path, wheel: Path) -> Path:
    _pip_install(base / "all", f"{wheel}[all]", base / "pip-cache")
    return base / "all"


def wheel_modules(wheel: Path) -> list[str]:
    """The modules the wheel holds, from its own file list."""
    names = zipfile.ZipFile(wheel).namelist()
    return sorted(n[: -len(".py")].replace("/", ".").removesuffix(".__init__") for n in names
                  if n.startswith("kvtrace/") and n.endswith(".py"))


def import_each(env_dir: Path, modules: list[str], home: Path) -> dict[str, list | None]:
    """Each module imported in its own fresh interpreter (-I: the venv's site-packages alone)."""
    def one(module: str) -> list | None:
        proc = _run([_bin(env_dir, "python"), "-I", "-c", IMPORT_ONE, module], env=_env(home))
        return json.loads(proc.stdout) if proc.stdout.strip() else None

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return dict(zip(modules, pool.map(one, modules), strict=True))


def top_level(env_dir: Path) -> set[str]:
    proc = _run([_bin(env_dir, "python"), "-I", "-c", TOP_LEVEL])
    assert proc.returncode == 0, proc.stderr
    return set(json.loads(proc.stdout))


def failed_on(result: list | None, allowed: frozenset[str] | set[str]) -> bool:
    """Did the import fail for lack of one of `allowed` (top-level modules), and for nothing else?"""
    return (result is not None and result[0] == "ModuleNotFoundError"
            and (result[1] or "").split(".")[0] in allowed)


def test_the_wheel_holds_every_module_and_data_file_of_the_rooms(tree: Path, wheel: Path) -> None:
    rooms = sorted(p.parent.name for p in tree.glob("*/__init__.py"))
    assert {"schema", "store", "instrumentation", "analysis", "collector", "dashboards", "cli"} <= set(rooms)
    files = [p for room in rooms for p in (tree / room).rglob("*.py")]
    files += (tree / "cli" / "data").iterdir()  # the package data
    want = {f"kvtrace/{p.relative_to(tree).as_posix()}" for p in files}
    # Each C source, compiled for this Python (the build's compiler is on every machine the
    # tests run on: without it, the wheel would be pure Python, and the reconstructor slower).
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    want |= {f"kvtrace/{p.relative_to(tree).with_suffix('').as_posix()}{suffix}"
             for room in rooms for p in (tree / room).rglob("*.c")}
    assert "kvtrace/instrumentation/lmcache/shim.py" in want and "kvtrace/analysis/_native" + suffix in want
    got = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("kvtrace/")}
    assert sorted(want - got) == [] and sorted(got - want) == []


def test_with_the_core_alone_the_engine_side_imports(core: Path, everything: Path, wheel: Path,
                                                     base: Path) -> None:
    modules = wheel_modules(wheel)
    assert sorted((set(BEYOND_CORE) | set(ENGINE_ONLY)) - set(modules)) == [], "a table names a module gone"
    extras = top_level(everything) - top_level(core)  # what the extras install
    assert FORBIDDEN | {"numpy"} <= extras
    results = import_each(core, modules, base / "home")
    wrong = []
    for module, result in results.items():
        if module in BEYOND_CORE or module in ENGINE_ONLY:
            ok = failed_on(result, BEYOND_CORE.get(module) or ENGINE_ONLY[module])
        elif module.split(".")[1] in ENGINE_SIDE:
            ok = result is None
        else:  # the rooms above: they may need an extra, and nothing but an extra
            ok = result is None or failed_on(result, extras)
        if not ok:
            wrong.append(f"{module}: {'imports' if result is None else result[2]}")
    assert wrong == []
    assert results["kvtrace.instrumentation.lmcache.shim"] is None and results["kvtrace.cli.main"] is None


def test_with_all_extras_everything_but_the_engine_drivers_imports(everything: Path, wheel: Path,
                                                                   base: Path) -> None:
    results = import_each(everything, wheel_modules(wheel), base / "home")
    wrong = [f"{m}: {'imports' if r is None else r[2]}" for m, r in results.items()
             if not (failed_on(r, ENGINE_ONLY[m]) if m in ENGINE_ONLY else r is None)]
    assert wrong == []


def test_with_the_core_alone_a_command_that_needs_an_extra_names_it(core: Path, base: Path) -> None:
    kvtrace, env = _bin(core, "kvtrace"), _env(base / "home")
    helped = _run([kvtrace, "--help"], env=env, cwd=base)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: kvtrace")
    status = _run([kvtrace, "db", "status"], env=env, cwd=base)
    assert (status.returncode, status.stdout) == (1, "")
    assert re.fullmatch(r"error: kvtrace db: this command needs kvtrace's 'store' extra \(no module '\w+' "
                        r"here\): pip install 'kvtrace\[store\]'\n", status.stderr), status.stderr
    for command in (["ingest", "events.jsonl"], ["analyze", "--recipe", "dense"]):
        proc = _run([kvtrace, *command], env=env, cwd=base)
        assert proc.returncode == 1 and proc.stdout == "", proc.stderr
        one_line = r"error: kvtrace \w+: .* needs kvtrace's '(\w+)' extra .*: pip install 'kvtrace\[\1\]'\n"
        assert re.fullmatch(one_line, proc.stderr), proc.stderr


def test_with_the_core_alone_the_store_sink_is_refused_at_start_up(core: Path, base: Path) -> None:
    env = _env(base / "home", KVTRACE_ENABLED="1", KVTRACE_SINK="store", KVTRACE_DSN=f"chdb://{base}/never")
    proc = _run([_bin(core, "python"), "-I", "-c", START_WITH_STORE_SINK], env=env)
    assert proc.returncode == 0, proc.stderr
    refusal = ("KVTRACE_SINK=store needs kvtrace's 'store' extra, which this environment lacks "
               "(no module 'clickhouse_connect'): pip install 'kvtrace[store]'")
    assert proc.stdout.splitlines() == [
        f"refused: {refusal}",
        f"ERROR kvtrace: {refusal}; tracing is off",  # the vLLM plugin: one line, and the engine untouched
        "emitter: NoopEmitter",
    ]
    assert not (base / "never").exists()


def _serve(env_dir: Path, work: Path) -> dict:
    env = _env(work / "home", KVTRACE_ENABLED="1", KVTRACE_SPOOL_DIR=str(work / "spool"))
    proc = _run([_bin(env_dir, "python"), "-I", "-c", SERVE], env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    served = json.loads(proc.stdout)
    assert served["emitter"] == "BatchEmitter" and served["flushed"]
    assert served["emitted"] == served["exported"] == served["events"] > 0 and served["dropped"] == 0
    return served


def _funnel(stdout: str) -> dict[str, str]:
    """The first row of the funnel table `kvtrace analyze` prints, by column header."""
    rows = [[c.strip(" │") for c in line.split("┆")] for line in stdout.splitlines() if "┆" in line]
    return dict(zip(rows[0], rows[1], strict=True))


def test_spool_files_from_the_core_are_ingested_and_analyzed_with_all(core: Path, everything: Path,
                                                                      tmp_path: Path) -> None:
    served = _serve(core, tmp_path / "engine")
    # The same start where the store, DataFrame and web packages are installed: none is loaded.
    loaded = {m.split(".")[0] for m in _serve(everything, tmp_path / "engine-all")["modules"]}
    assert sorted(loaded & FORBIDDEN) == []
    spool = sorted((tmp_path / "engine" / "spool").iterdir())
    assert spool and all(p.suffix == ".kvspool" for p in spool)
    # The spool went where it was told; the data dir holds only the journals' folder, emptied by
    # the emitter's clean shutdown (a journal left there would be shipped by the next start).
    home = tmp_path / "engine" / "home"
    assert sorted(str(p.relative_to(home)) for p in home.rglob("*")) == ["journal"]

    kvtrace, env = _bin(everything, "kvtrace"), _env(tmp_path / "home")
    dsn = f"chdb://{tmp_path / 'store'}"
    assert dsn.startswith("chdb:///")
    ingested = _run([kvtrace, "--dsn", dsn, "ingest", *spool], env=env, cwd=tmp_path, timeout=300)
    assert ingested.returncode == 0, ingested.stderr
    stored = re.findall(r"(\d+) stored, 0 quarantined", ingested.stdout)
    assert len(stored) == len(spool) and sum(map(int, stored)) == served["events"]

    results = tmp_path / "lookups.parquet"
    analyzed = _run([kvtrace, "--dsn", dsn, "analyze", "--recipe", "wheel-model=mamba-hybrid", "-o", results],
                    env=env, cwd=tmp_path, timeout=300)
    assert analyzed.returncode == 0, analyzed.stderr
    prompt, adopted = sum(served["prompt_tokens"].values()), sum(served["adopted_tokens"].values())
    assert 0 < adopted < prompt
    assert analyzed.stdout.startswith(f"{len(served['prompt_tokens'])} lookups (clickhouse path)\n")
    row = _funnel(analyzed.stdout)
    assert row["lookups"] == str(len(served["prompt_tokens"])) and row["prompt tok"] == str(prompt)
    assert row["adopted"] == f"{100 * adopted / prompt:.1f}%" and row["unsafe"] == "0"

    import polars as pl  # per lookup, read here (the test's own environment has every extra)

    frame = pl.read_parquet(results)
    assert dict(zip(frame["request_id"], frame["prompt_tokens"], strict=True)) == served["prompt_tokens"]
    assert dict(zip(frame["request_id"], frame["adopted_tokens"], strict=True)) == served["adopted_tokens"]


# An engine that sends Arrow columns to the collector with the `arrow` extra alone.
SEND_COLUMNS = """
import sys
from kvtrace.instrumentation.config import EmitterSettings, build_sink
sink = build_sink(EmitterSettings.from_env())
loaded = {m.split(".")[0] for m in sys.modules}
print(type(sink).__name__, sink.wire.value, sorted(loaded & set(sys.argv[1:])))
"""


def test_the_arrow_extra_alone_sends_columns(base: Path, wheel: Path) -> None:
    _pip_install(base / "arrow", f"{wheel}[arrow]", base / "pip-cache")
    env = _env(base / "home", KVTRACE_ENABLED="1", KVTRACE_COLLECTOR_URL="http://127.0.0.1:9",
               KVTRACE_COLLECTOR_WIRE="columns")
    proc = _run([_bin(base / "arrow", "python"), "-I", "-c", SEND_COLUMNS, *sorted(FORBIDDEN)], env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == "HttpSink columns ['pyarrow']\n"
