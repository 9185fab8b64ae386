"""The `kvtrace` command, run in-process against the session's embedded ClickHouse."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import pyarrow.parquet as pq
import pytest
from strategies import STORE_TS_BASE

from kvtrace.cli.demo import DEMO_DATABASE
from kvtrace.cli.main import main
from kvtrace.schema.arrow import from_arrow
from kvtrace.schema.clickhouse import TABLES
from kvtrace.schema.events import FIELD_NAMES, SCHEMA_VERSION, Event
from kvtrace.schema.kinds import EventKind, Reason
from kvtrace.schema.recipes import BUILTIN
from kvtrace.store.client import Store
from kvtrace.store.dsn import default_dsn

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _events(n: int) -> list[Event]:
    return [
        Event(kind=EventKind.INVALIDATE, ts_ns=STORE_TS_BASE + i, source_id=5, seq=i, reason=Reason.RESET,
              instance=f"i{i % 2}")
        for i in range(n)
    ]


def test_db_init_twice_then_status(capsys, store_dsn):
    code, out, _ = run(capsys, "--dsn", store_dsn, "db", "init")
    assert code == 0
    assert f"schema version {SCHEMA_VERSION}" in out
    assert f"applied: schema_version None -> {SCHEMA_VERSION}" in out

    code, out, _ = run(capsys, "--dsn", store_dsn, "db", "init")
    assert code == 0
    assert "already up to date" in out and "applied" not in out

    with Store(store_dsn) as s:
        s.insert_events(_events(7))
    code, out, _ = run(capsys, "--dsn", store_dsn, "db", "status")
    assert code == 0
    assert "schema version" in out
    assert f"schema version:  {SCHEMA_VERSION} (this kvtrace: {SCHEMA_VERSION})" in out
    assert re.search(r"events\s+7 rows", out), out
    assert re.search(r"quarantine\s+0 rows", out), out
    assert "event sources:   1" in out
    with Store(store_dsn) as s:
        s.client.command(f"DROP DATABASE IF EXISTS {s.db}")


def test_db_status_lists_each_instances_engine_as_it_attached(capsys, store):
    _simulated(store)  # the reference simulator attaches as an engine's shim does
    (engine,) = store.engines()
    assert (engine.instance, engine.engine, engine.model) == ("sim-0", "sim", "jamba")
    assert engine.recipe.groups == BUILTIN["mamba-hybrid"].groups and engine.attached_ns > 0
    code, out, _ = run(capsys, "--dsn", str(store.dsn), "db", "status")
    assert code == 0 and "engines:         1 attached" in out
    assert "sim-0" in out and "jamba  [full_attention/16, mamba/64]" in out


def test_db_status_before_init(capsys, store_dsn):
    code, out, _ = run(capsys, "--dsn", store_dsn, "db", "status")
    assert code == 1
    assert "kvtrace db init" in out


def test_db_init_with_ttl(capsys, store):
    code, out, _ = run(capsys, "--dsn", str(store.dsn), "db", "init", "--ttl-days", "30")
    assert code == 0
    ddl = store.scalar(
        "SELECT engine_full FROM system.tables WHERE database = {db:String} AND name = 'events'",
        {"db": store.db},
    )
    assert "toIntervalDay(30)" in ddl


def test_ingest_mixed_file_reports_line_and_field(capsys, store, tmp_path):
    good = _events(3)
    lines = [msgspec.json.encode(e).decode() for e in good]
    no_component = {"kind": "create", "ts_ns": 1, "source_id": 1, "seq": 1, "block_key": 2, "tier": "host"}
    lines.insert(1, json.dumps(no_component))
    lines.insert(3, "")
    lines.insert(4, '{"kind": "lookup", "ts_ns": 1, "source_id": 1, "seq": 2, "prompt_tokens": "many"}')
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")

    code, out, err = run(capsys, "--dsn", str(store.dsn), "ingest", str(path))

    assert code == 1
    assert f"{path}: jsonl, 3 stored, 2 quarantined" in out
    assert f"{path} row 2: component: required for a create event" in err
    assert f"{path} row 5: prompt_tokens: " in err
    assert [e for t in store.iter_event_batches() for e in from_arrow(t)] == good
    assert store.scalar(f"SELECT count() FROM {store.db}.quarantine") == 2


def test_ingest_clean_file_and_missing_file(capsys, store, tmp_path):
    path = tmp_path / "ok.jsonl"
    path.write_bytes(b"".join(msgspec.json.encode(e) + b"\n" for e in _events(4)))
    code, out, err = run(capsys, "--dsn", str(store.dsn), "ingest", str(path))
    assert (code, err) == (0, "")
    assert "4 stored, 0 quarantined" in out

    missing = tmp_path / "missing.jsonl"
    code, out, err = run(capsys, "--dsn", str(store.dsn), "ingest", str(missing), str(path))
    assert code == 1
    assert f"error: {missing}: no such file" in err
    assert f"{path}: jsonl, 4 stored" in out  # the other file is still loaded
    assert store.count_events() == 4


def test_ingest_initializes_a_fresh_store(capsys, store_dsn, tmp_path):
    path = tmp_path / "ok.jsonl"
    path.write_bytes(b"".join(msgspec.json.encode(e) + b"\n" for e in _events(2)))
    code, _, _ = run(capsys, "--dsn", store_dsn, "ingest", str(path))
    assert code == 0
    with Store(store_dsn) as s:
        assert s.count_events() == 2
        s.client.command(f"DROP DATABASE IF EXISTS {s.db}")


def test_export_parquet_and_jsonl(capsys, store, tmp_path):
    events = _events(10)
    store.insert_events(events)
    out_path = tmp_path / "x.parquet"
    code, out, _ = run(capsys, "--dsn", str(store.dsn), "export", "-o", str(out_path))
    assert code == 0
    assert f"wrote 10 events to {out_path}" in out
    table = pq.read_table(out_path)
    assert table.num_rows == 10 and tuple(table.column_names) == FIELD_NAMES
    assert from_arrow(table) == events

    jl = tmp_path / "x.jsonl"
    code, out, _ = run(capsys, "--dsn", str(store.dsn), "export", "-o", str(jl), "--format", "jsonl",
                       "--instance", "i1", "--since", str(STORE_TS_BASE + 2))
    assert code == 0
    want = [e for e in events if e.instance == "i1" and e.ts_ns >= STORE_TS_BASE + 2]
    assert f"wrote {len(want)} events" in out
    assert [msgspec.json.decode(line, type=Event) for line in jl.read_bytes().splitlines()] == want


def test_export_from_an_uninitialized_store_fails_clearly(capsys, store_dsn, tmp_path):
    code, _, err = run(capsys, "--dsn", store_dsn, "export", "-o", str(tmp_path / "x.parquet"))
    assert code == 1  # a runtime failure; 2 is for usage errors
    assert "kvtrace db init" in err
    assert not (tmp_path / "x.parquet").exists()


def test_bad_dsn_is_a_usage_error_before_or_after_the_command(capsys, monkeypatch):
    for argv in (["--dsn", "postgres://x", "db", "status"], ["db", "status", "--dsn", "postgres://x"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        assert "argument --dsn: DSN 'postgres://x': scheme must be" in capsys.readouterr().err
    monkeypatch.setenv("KVTRACE_DSN", "postgres://x")  # from the environment: no option to blame, a failure
    code, _, err = run(capsys, "db", "status")
    assert code == 1 and err == "error: DSN 'postgres://x': scheme must be chdb, http or https\n"


@pytest.mark.parametrize("fmt", ["json", "batch-json"])
def test_schema_json(capsys, fmt):
    code, out, _ = run(capsys, "schema", "--format", fmt)
    assert code == 0
    schema = json.loads(out)
    assert tuple(schema["$defs"]["Event"]["properties"]) == FIELD_NAMES
    assert sorted(schema["$defs"]["Event"]["required"]) == sorted(["kind", "ts_ns", "source_id", "seq"])


def test_schema_ddl_and_arrow(capsys):
    code, out, _ = run(capsys, "schema", "--format", "ddl")
    assert code == 0
    assert "CREATE TABLE IF NOT EXISTS kvtrace.events" in out and "ReplacingMergeTree()" in out
    assert out.rstrip().endswith(";")
    code, out, _ = run(capsys, "schema", "--format", "arrow")
    assert code == 0
    for name in FIELD_NAMES:
        assert re.search(rf"^{name}: ", out, re.MULTILINE), name


def test_db_ddl_for_a_cluster(capsys, store):
    code, out, _ = run(capsys, "db", "ddl", "--cluster", "c1", "--database", "kvc", "--ttl-days", "3")
    assert code == 0
    statements = [s.strip() for s in out.strip().rstrip(";").split(";\n\n")]
    assert len(statements) == 2 + 2 * len(TABLES)  # database, meta, then a local and a distributed table each
    for stmt in statements:
        text = store.client.query("SELECT formatQuery({q:String})", parameters={"q": stmt}).result_rows[0][0]
        assert "ON CLUSTER c1" in text
    assert "ReplicatedReplacingMergeTree" in out and "Distributed('c1', kvc, events_local" in out
    assert "INTERVAL 3 DAY" in out


def test_bad_arguments_exit_with_usage(capsys):
    with pytest.raises(SystemExit) as err:
        main(["db", "init", "--ttl-days", "-1"])
    assert err.value.code == 2
    assert "must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["export"])  # -o is required


def test_demo_runs_on_the_default_store_and_is_repeatable(capsys, chdb_path, tmp_path):
    from kvtrace.analysis.funnel import funnel
    from kvtrace.analysis.sql import clickhouse_results
    from kvtrace.schema.recipes import BUILTIN

    assert default_dsn() == f"chdb://{chdb_path}"  # conftest points the default at the session engine
    report = tmp_path / "report.html"
    code, out, _ = run(capsys, "demo", "--requests", "30", "--report", str(report))
    assert code == 0
    first = int(re.search(r"events stored\s+(\d+) \(emitted (\d+), dropped 0\)", out).group(1))
    assert "requests             30" in out
    printed = {name: float(re.search(rf"{name} (?:hit )?rate\s+([\d.]+)%", out).group(1))
               for name in ("logical", "recoverable", "resident", "adopted")}
    assert f"report     {report}" in out and "Plotly" in report.read_text()
    assert all(p in out for p in ("lru", "interval:512", "branch"))

    # The printed numbers are what the analysis API says about the same store.
    with Store(f"chdb://{chdb_path}?database={DEMO_DATABASE}") as s:
        assert s.count_events() == first
        kinds = dict(s.client.query(
            f"SELECT kind, count() FROM {DEMO_DATABASE}.events FINAL GROUP BY kind").result_rows)
        assert kinds["lookup"] == kinds["adopt"] == 30
        assert {"create", "commit", "evict", "offload"} <= set(kinds)
        rates = funnel(clickhouse_results(s, BUILTIN["mamba-hybrid"])).row(0, named=True)
    for name, value in printed.items():
        assert value == pytest.approx(rates[f"{name}_token_rate"] * 100, abs=0.051), name
    assert printed["logical"] > 0

    # Every dashboard page and `kvtrace costs` have data: verdicts, timed loads and prefills.
    with Store(f"chdb://{chdb_path}?database={DEMO_DATABASE}") as s:
        assert s.scalar(f"SELECT count() FROM {DEMO_DATABASE}.verdicts FINAL") == 30
        assert s.scalar(f"SELECT count() FROM {DEMO_DATABASE}.events WHERE kind = 'load' AND duration_ns = 0") == 0
        assert s.scalar(f"SELECT count() FROM {DEMO_DATABASE}.events WHERE kind = 'adopt' AND duration_ns > 0") == 30
    chosen = re.search(r"^policy\s+(\S+): ", out, re.M).group(1)
    assert chosen in ("lru", "interval:512", "branch")
    assert re.search(rf"^{re.escape(chosen)}\s", out, re.M)  # it is one of the compared rows
    last = out.strip().splitlines()[-1]
    assert last.startswith("dashboard ") and f"--dsn 'chdb://{chdb_path}?database={DEMO_DATABASE}' dashboard" in last

    code, out, _ = run(capsys, "demo", "--requests", "30", "--report", str(report))
    assert code == 0
    assert int(re.search(r"events stored\s+(\d+)", out).group(1)) == first
    with Store(f"chdb://{chdb_path}?database={DEMO_DATABASE}") as s:
        assert s.count_events() == first
        assert s.scalar(f"SELECT uniqExact(source_id) FROM {DEMO_DATABASE}.events") == 1


def test_help_mentions_every_command(capsys):
    with pytest.raises(SystemExit) as err:
        main(["--help"])
    assert err.value.code == 0
    out = capsys.readouterr().out
    for command in ("demo", "db", "ingest", "export", "schema"):
        assert command in out
    assert Path(default_dsn().removeprefix("chdb://")).is_absolute()


def _simulated(store: Store) -> None:
    from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
    from kvtrace.instrumentation.simulator import CacheSimulator, Fault, SimConfig, SimRequest
    from kvtrace.instrumentation.sinks.store import StoreSink
    from kvtrace.schema.recipes import BUILTIN

    emitter = BatchEmitter(StoreSink(store), BatchConfig(schedule_delay_millis=10), register_atexit=False)
    sim = CacheSimulator(SimConfig(recipe=BUILTIN["mamba-hybrid"], model="jamba"), emitter)
    prefix = list(range(1, 1025))
    sim.serve(SimRequest("a", [*prefix, 7, 7, 7], tenant="t"))
    sim.inject(Fault.SKIP_CHECKPOINT, SimRequest("b", prefix), 1024)
    sim.serve(SimRequest("b", [*prefix, 8, 8, 8], tenant="t"))
    assert emitter.shutdown()


def test_analyze_by_each_path_prints_the_same_funnel(capsys, store, tmp_path):
    _simulated(store)
    outputs = {}
    for path in ("clickhouse", "stream"):
        out_file = tmp_path / f"{path}.parquet"
        code, out, err = run(capsys, "--dsn", str(store.dsn), "analyze", "--recipe", "jamba=mamba-hybrid",
                             "--path", path, "-o", str(out_file), "--by", "model")
        assert code == 0, err
        outputs[path] = (out, pq.read_table(out_file).to_pylist())
    export = tmp_path / "events.parquet"
    assert run(capsys, "--dsn", str(store.dsn), "export", "-o", str(export))[0] == 0
    code, out, err = run(capsys, "analyze", "--recipe", "mamba-hybrid", "--path", "duckdb", str(export),
                         "-o", str(tmp_path / "d.parquet"))
    assert code == 0, err
    rows = pq.read_table(tmp_path / "d.parquet").to_pylist()
    assert outputs["clickhouse"][1] == outputs["stream"][1] == rows
    assert "2 lookups" in out and "no_checkpoint_at_boundary" in out
    assert rows[1]["recoverable_hit_tokens"] == 960 and rows[1]["reason"] == "no_checkpoint_at_boundary"


def test_analyze_reads_shards_and_joins_their_rows(capsys, store, chdb_path, tmp_path):
    from kvtrace.store.shards import route_to_shards

    _simulated(store)
    shards = [Store(f"chdb://{chdb_path}?database={store.db}_s{k}") for k in range(2)]
    try:
        for s in shards:
            s.init()
        route_to_shards(store, shards)
        code, out, err = run(capsys, "--dsn", str(store.dsn), "analyze", "-o", str(tmp_path / "one.parquet"))
        assert code == 0, err
        args = [a for s in shards for a in ("--shard", str(s.dsn))]
        code, out, err = run(capsys, "analyze", *args, "-o", str(tmp_path / "sharded.parquet"))
        assert code == 0 and "2 lookups" in out, err
        assert pq.read_table(tmp_path / "sharded.parquet") == pq.read_table(tmp_path / "one.parquet")
        code, _, err = run(capsys, "analyze", *args, "--path", "stream")
        assert code == 2 and "shards are analysed inside ClickHouse" in err
    finally:
        for s in shards:
            s.command(f"DROP DATABASE IF EXISTS {s.db}")
            s.close()


def test_analyze_names_what_is_wrong(capsys, store, tmp_path):
    _simulated(store)
    code, _, err = run(capsys, "--dsn", str(store.dsn), "analyze", "--recipe", "nonsense")
    assert code == 2 and "no built-in recipe or file named 'nonsense'" in err
    # A recipe for another model overrides nothing: jamba is judged by the recipe its engine published.
    code, out, err = run(capsys, "--dsn", str(store.dsn), "analyze", "--recipe", "other=dense")
    assert code == 0 and "2 lookups" in out, err
    # A recipe the engine contradicts is refused, naming the model, the engine and the group.
    code, _, err = run(capsys, "--dsn", str(store.dsn), "analyze", "--recipe", "jamba=dense")
    assert code == 2 and "'dense' given for model 'jamba' contradicts what its engine reported (sim" in err, err
    assert "the recipe has 1 cache group(s), the engine 2" in err
    # Events from an engine that published no recipe (an older writer), and none given: named.
    store.command(f"ALTER TABLE {store.db}.events DELETE WHERE kind = 'attach'", settings={"mutations_sync": 1})
    code, _, err = run(capsys, "--dsn", str(store.dsn), "analyze", "--recipe", "other=dense")
    assert code == 2 and "no recipe for model 'jamba'" in err
    code, _, err = run(capsys, "analyze", "--recipe", "dense", "--path", "duckdb")
    assert code == 2 and "Parquet" in err
    code, _, err = run(capsys, "--dsn", str(store.dsn), "analyze", "--recipe", "dense", "--by", "colour")
    assert code == 2 and "colour" in err


def _trace_file(tmp_path: Path, rows: int = 12, bad_line: bool = False) -> Path:
    import gzip
    import itertools
    from importlib import resources

    src = resources.files("kvtrace.cli") / "data" / "mooncake_conversation_head.jsonl.gz"
    with gzip.open(str(src), "rt") as f:
        lines = list(itertools.islice(f, rows))
    if bad_line:
        lines.insert(3, '{"timestamp": 1, "input_length": 9000, "output_length": 1, "hash_ids": [1]}\n')
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(lines))
    return path


def test_replay_into_the_store_then_analyze(capsys, store, tmp_path):
    trace = _trace_file(tmp_path)
    code, out, err = run(capsys, "--dsn", str(store.dsn), "replay", str(trace), "--recipe", "sliding-window-hybrid",
                         "--model", "gemma", "--tiers-gib", "0.25,0.5,1")
    assert code == 0, err
    m = re.search(r"replayed 12 requests .* (\d+) events stored, 0 dropped", out)
    assert m and int(m.group(1)) == store.count_events()
    code, out, err = run(capsys, "--dsn", str(store.dsn), "analyze", "--recipe", "gemma=sliding-window-hybrid")
    assert code == 0 and "12 lookups" in out, err


def test_replay_a_fleet_then_analyze_where_in_the_fleet_each_prompt_was_recoverable(capsys, store, tmp_path):
    trace = TRACES / "mooncake_synthetic_trace.jsonl"
    code, out, err = run(capsys, "--dsn", str(store.dsn), "replay", str(trace), "--limit", "60", "--instances", "3",
                         "--route", "round_robin", "--tiers-gib", "0.25,0.5,0")
    assert code == 0 and "kvtrace analyze --fleet" in out, err
    m = re.search(r"replayed 60 requests .* (\d+) events stored, 0 dropped", out)
    assert m and int(m.group(1)) == store.count_events()
    result = tmp_path / "fleet.parquet"
    code, out, err = run(capsys, "--dsn", str(store.dsn), "analyze", "--fleet", "--path", "stream", "-o", str(result))
    assert code == 0 and "60 lookups (stream path)" in out and "where each prompt token went" in out, err
    rows = pq.read_table(result).to_pylist()
    in_store = tmp_path / "fleet_sql.parquet"  # the default path: ClickHouse, the same rows
    code, out, err = run(capsys, "--dsn", str(store.dsn), "analyze", "--fleet", "-o", str(in_store))
    assert code == 0 and "60 lookups (clickhouse path)" in out, err
    def by_lookup(table: list[dict]) -> list[dict]:
        return sorted(table, key=lambda r: (r["ts_ns"], r["source_id"], r["seq"]))

    assert by_lookup(pq.read_table(in_store).to_pylist()) == by_lookup(rows)
    assert {r["instance"] for r in rows} == {"sim-0/0", "sim-0/1", "sim-0/2"}
    regret = [r for r in rows if r["routing_regret_tokens"]]
    assert regret and all(r["best_instance"] not in ("", r["instance"]) for r in regret)
    assert "routing regret by instance pair" in out and regret[0]["best_instance"] in out
    # The replay's prefills are timed, so the regret is priced in seconds, where a restore on the
    # best instance has a fitted path (this short replay made no loads: those lookups say so).
    code, out, err = run(capsys, "--dsn", str(store.dsn), "costs", "--fleet")
    assert code == 0 and "routing regret in seconds, by instance pair" in out, err
    unpriced = sum(1 for r in regret if r["best_restore_bytes"] or r["restore_host_bytes"])
    line = next(line for line in out.splitlines() if f" {regret[0]['instance']} " in line and "unpriced" not in line
                and f" {regret[0]['best_instance']} " in line)
    assert f" {len(regret)} " in line and f" {unpriced} " in line, out
    code, _, err = run(capsys, "--dsn", str(store.dsn), "analyze", "--fleet", "--shard", str(store.dsn))
    assert code == 2 and "--fleet needs every instance's events in one place" in err
    code, _, err = run(capsys, "--dsn", str(store.dsn), "replay", str(trace), "--engine", "vllm", "--instances", "2")
    assert code == 2 and "--instances serves a fleet of reference simulators" in err


def test_replay_stops_at_a_bad_line_or_skips_it(capsys, store, tmp_path):
    trace = _trace_file(tmp_path, rows=5, bad_line=True)
    code, _, err = run(capsys, "--dsn", str(store.dsn), "replay", str(trace))
    assert code == 2 and "trace.jsonl:4: hash_ids: 1 ids do not cover input_length 9000" in err
    code, out, err = run(capsys, "--dsn", str(store.dsn), "replay", str(trace), "--skip-bad")
    assert code == 0 and "replayed 5 requests" in out and "skipped 1 malformed lines" in err
    code, _, err = run(capsys, "--dsn", str(store.dsn), "replay", str(trace), "--tiers-gib", "0,1,1")
    assert code == 2 and "--tiers-gib" in err


def test_experiment_prints_and_writes_the_policy_table(capsys, tmp_path):
    trace = _trace_file(tmp_path, rows=20)
    out_file = tmp_path / "policies.parquet"
    code, out, err = run(capsys, "experiment", str(trace), "--policies", "lru,interval:256,branch",
                         "--tiers-gib", "0.25,0.5,1", "-o", str(out_file))
    assert code == 0, err
    table = pq.read_table(out_file).to_pylist()
    assert [r["policy"] for r in table] == ["lru", "interval:256", "branch"]
    assert all(r["requests"] == 20 and 0 <= r["recoverable_rate"] <= r["object_hit_rate"] <= 1 for r in table)
    # fewer checkpoints written: less device write traffic than one per block
    assert table[1]["device_write_bytes"] < table[0]["device_write_bytes"]
    code, _, err = run(capsys, "experiment", str(trace), "--policies", "fifo")
    assert code == 2 and "unknown policy 'fifo'" in err


def test_replay_through_vllm_says_where_vllm_lives(capsys, store, tmp_path):
    """In this (core) environment vLLM is not installed; tests/engines/vllm runs the real path."""
    trace = _trace_file(tmp_path, rows=2)
    code, _, err = run(capsys, "--dsn", str(store.dsn), "replay", str(trace), "--engine", "vllm")
    assert code == 2 and "--engine vllm needs vLLM in this environment" in err and "engine-venv.sh vllm" in err
    code, _, err = run(capsys, "--dsn", str(store.dsn), "replay", str(trace), "--engine", "sglang")
    assert code == 2 and "--engine sglang needs SGLang in this environment" in err and "engine-venv.sh sglang" in err


def test_verify_names_bad_prompts_and_where_vllm_lives(capsys, store, tmp_path):
    """In this (core) environment vLLM is not installed; tests/engines/vllm/test_verify runs it."""
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt_token_ids": [1, 2, 3]}\n{"prompt_token_ids": [4, -5]}\n')
    code, _, err = run(capsys, "--dsn", str(store.dsn), "verify", "m", "--prompts", str(bad))
    assert code == 2 and f"{bad}:2: expected a non-empty list of non-negative token ids" in err
    bad.write_text('{"prompt_token_ids": [1, 2, 3]}\n')
    code, _, err = run(capsys, "--dsn", str(store.dsn), "verify", "m", "--prompts", str(bad))
    assert code == 2 and "kvtrace verify needs vLLM in this environment" in err


def test_collector_refuses_bad_settings_before_serving(capsys, tmp_path):
    code, _, err = run(capsys, "collector", "--tokens-file", str(tmp_path / "missing"))
    assert code == 2 and "cannot read token file" in err and "missing" in err
    tokens = tmp_path / "tokens"
    tokens.write_text("only-a-token\n")
    code, _, err = run(capsys, "collector", "--tokens-file", str(tokens))
    assert code == 2 and f"{tokens}:1" in err and "only-a-token" not in err
    code, _, err = run(capsys, "collector", "--recipe", "no-such-recipe")
    assert code == 2 and "no-such-recipe" in err


def _timed(store: Store) -> None:
    """A workload with known load and prefill costs (the simulator reports them)."""
    import random

    from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
    from kvtrace.instrumentation.simulator import CacheSimulator, SimConfig, SimRequest
    from kvtrace.instrumentation.sinks.store import StoreSink
    from kvtrace.schema.recipes import BUILTIN

    rng = random.Random(5)
    emitter = BatchEmitter(StoreSink(store), BatchConfig(max_queue_size=1 << 20, max_export_batch_size=1 << 14),
                           register_atexit=False)
    sim = CacheSimulator(SimConfig(recipe=BUILTIN["dense"], model="llama", capacity_bytes=(8 << 20, 64 << 20, 0),
                                   load_latency_ns=(50_000, 0), load_bytes_per_s=(10e9, 1e9),
                                   prefill_ns_per_token=40_000, prefill_ns_per_token_pair=4), emitter)
    docs = [[d * 10_000 + i for i in range(rng.choice([256, 512, 1024]))] for d in range(12)]
    for i in range(150):
        doc = rng.choice(docs)
        sim.serve(SimRequest(f"r{i}", doc[: rng.randint(len(doc) // 2, len(doc))] + [i] * rng.randint(1, 100)))
    assert emitter.shutdown()


def test_costs_and_capacity_read_the_store_and_parquet_alike(capsys, store, tmp_path):
    _timed(store)
    export = tmp_path / "events.parquet"
    assert run(capsys, "--dsn", str(store.dsn), "export", "-o", str(export))[0] == 0
    outs = []
    for source in (["--dsn", str(store.dsn), "costs"], ["costs", str(export)]):
        code, out, err = run(capsys, *source, "--recipe", "llama=dense", "--starts", "0,4096")
        assert code == 0, err
        outs.append(out)
    assert outs[0] == outs[1]
    assert "host->device" in outs[0] and "GiB_per_s" in outs[0]
    assert "9.313" in outs[0]  # 10 GB/s as simulated, shown in the CLI's unit: 10e9 / 2**30 GiB/s
    assert "lost_restoring_s" in outs[0]
    caps = []
    for source in (["--dsn", str(store.dsn), "capacity"], ["capacity", str(export)]):
        code, out, err = run(capsys, *source, "--recipe", "llama=dense", "--capacities", "16,256,4096")
        assert code == 0, err
        caps.append(out)
    assert caps[0] == caps[1] and "model llama" in caps[0] and "blocks" in caps[0] and "GiB" in caps[0]


def test_costs_and_capacity_name_bad_input(capsys, store):
    code, _, err = run(capsys, "--dsn", str(store.dsn), "capacity", "--recipe", "dense", "--capacities", "1,x")
    assert code == 2 and "--capacities" in err
    code, _, err = run(capsys, "--dsn", str(store.dsn), "costs", "--recipe", "dense", "--starts", "-5")
    assert code == 2 and "--starts" in err
    code, _, err = run(capsys, "--dsn", str(store.dsn), "capacity", "--recipe", "dense", "--requests", "1.5")
    assert code == 2 and "--requests" in err


def test_report_from_the_store_and_from_parquet(capsys, store, tmp_path):
    _timed(store)
    export = tmp_path / "events.parquet"
    assert run(capsys, "--dsn", str(store.dsn), "export", "-o", str(export))[0] == 0
    for name, source in (("store", ["--dsn", str(store.dsn), "report"]), ("parquet", ["report", str(export)])):
        out_file = tmp_path / f"{name}.html"
        code, out, err = run(capsys, *source, "--recipe", "llama=dense", "-o", str(out_file))
        assert code == 0, err
        text = out_file.read_text()
        for title in ("Hit funnel over time", "Load vs recompute", "against each group's capacity"):
            assert title in text, (name, title)


def test_offline_analysis_reads_jsonl_and_spool_files_like_parquet(capsys, store, tmp_path):
    from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
    from kvtrace.instrumentation.simulator import CacheSimulator, Fault, SimConfig, SimRequest
    from kvtrace.instrumentation.sinks.spool import SpoolSink
    from kvtrace.schema.recipes import BUILTIN

    spool = tmp_path / "spool"
    emitter = BatchEmitter(SpoolSink(str(spool)), BatchConfig(schedule_delay_millis=10), register_atexit=False)
    sim = CacheSimulator(SimConfig(recipe=BUILTIN["mamba-hybrid"], model="jamba"), emitter)
    prefix = list(range(1, 1025))
    sim.serve(SimRequest("a", [*prefix, 7, 7, 7], tenant="t"))
    sim.inject(Fault.SKIP_CHECKPOINT, SimRequest("b", prefix), 1024)
    sim.serve(SimRequest("b", [*prefix, 8, 8, 8], tenant="t"))
    assert emitter.shutdown()
    files = sorted(str(f) for f in spool.iterdir())
    assert run(capsys, "--dsn", str(store.dsn), "ingest", *files)[0] == 0
    parquet, jsonl = tmp_path / "e.parquet", tmp_path / "e.jsonl"
    assert run(capsys, "--dsn", str(store.dsn), "export", "-o", str(parquet))[0] == 0
    assert run(capsys, "--dsn", str(store.dsn), "export", "--format", "jsonl", "-o", str(jsonl))[0] == 0
    rows = {}
    for name, inputs in (("parquet", [str(parquet)]), ("jsonl", [str(jsonl)]), ("spool", files)):
        out_file = tmp_path / f"{name}.out.parquet"
        code, _, err = run(capsys, "analyze", "--recipe", "mamba-hybrid", "--path", "duckdb", *inputs,
                           "-o", str(out_file))
        assert code == 0, err
        rows[name] = pq.read_table(out_file).to_pylist()
    assert rows["parquet"] == rows["jsonl"] == rows["spool"] and len(rows["spool"]) == 2
    code, _, err = run(capsys, "analyze", "--recipe", "mamba-hybrid", "--path", "duckdb", str(tmp_path / "nope"))
    assert code == 2 and "no such file" in err


def test_the_readmes_duckdb_queries_run(capsys, store, tmp_path, monkeypatch):
    import duckdb

    _timed(store)
    monkeypatch.chdir(tmp_path)
    assert run(capsys, "--dsn", str(store.dsn), "export", "-o", "events.parquet")[0] == 0
    assert run(capsys, "--dsn", str(store.dsn), "analyze", "--recipe", "llama=dense", "-o", "results.parquet")[0] == 0
    readme = (Path(__file__).resolve().parents[1] / "docs" / "analysis.md").read_text()
    section = readme.split("## Offline, in DuckDB", 1)[1].split("\n## ", 1)[0]
    queries = re.findall(r"```sql\n(.*?)```", section, re.S)
    assert len(queries) == 4
    answers = [duckdb.sql(sql).fetchall() for sql in queries]
    assert answers[0] and answers[1] and answers[3]  # (this clean workload loses nothing to a reason)
    assert answers[1][0][0] == "llama" and 0 < answers[1][0][2] <= answers[1][0][1]
    bandwidth = dict(((r[0], r[1]), r[3]) for r in duckdb.sql(queries[3]).fetchall())
    assert 1.0 < bandwidth[("host", "device")] < 10.0  # the simulated 10 GB/s link, slowed by its latency


def test_alerts_once_and_bad_rules(capsys, store, tmp_path):
    _simulated(store)  # a skipped checkpoint: recoverable below logical
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - {name: div, kind: divergence, threshold: 0.01, window_s: 3600}\n")
    code, out, err = run(capsys, "--dsn", str(store.dsn), "alerts", "--once", "--rules", str(rules),
                         "--recipe", "jamba=mamba-hybrid")
    assert code == 0, err
    assert "FIRING   div model=jamba" in out and "1 firing" in out
    rules.write_text("rules:\n  - {name: div, kind: divergence, threshold: nope}\n")
    code, _, err = run(capsys, "--dsn", str(store.dsn), "alerts", "--once", "--rules", str(rules))
    assert code == 2 and "rule div: threshold:" in err
    code, out, _ = run(capsys, "alerts", "--show-default-rules")
    assert code == 0 and "recoverable-below-logical" in out


def test_analyze_a_range_from_its_snapshot(capsys, store, tmp_path):
    from kvtrace.analysis.funnel import results_frame
    from kvtrace.analysis.reconstruct import Reconstructor
    from kvtrace.schema.recipes import RecipeBook

    _simulated(store)
    events = [e for t in store.iter_event_batches() for e in from_arrow(t)]
    lookups = sorted(e.ts_ns for e in events if e.kind is EventKind.LOOKUP)
    cut, end = lookups[1], events[-1].ts_ns + 1
    dsn = ("--dsn", str(store.dsn))
    code, out, err = run(capsys, *dsn, "analyze", "--until", str(cut), "-o", str(tmp_path / "a.parquet"))
    assert code == 0 and "1 lookups (stream path)" in out and "from the first event; snapshots left: 1" in out, err
    code, out, err = run(capsys, *dsn, "analyze", "--since", str(cut), "--until", str(end),
                         "-o", str(tmp_path / "b.parquet"))
    assert code == 0 and "1 lookups (stream path)" in out and "from the snapshot at" in out, err
    full = results_frame(Reconstructor(RecipeBook()).run(events))
    got = pq.read_table(tmp_path / "a.parquet").to_pylist() + pq.read_table(tmp_path / "b.parquet").to_pylist()
    assert [r["recoverable_hit_tokens"] for r in got] == full["recoverable_hit_tokens"].to_list()
    assert got[1]["reason"] == "no_checkpoint_at_boundary"
    code, _, err = run(capsys, *dsn, "analyze", "--since", str(cut), "--path", "clickhouse")
    assert code == 2 and "--since/--until read the store from a snapshot" in err
    code, _, err = run(capsys, *dsn, "analyze", "--since", str(end), "--until", str(cut))
    assert code == 2 and "must be after" in err
