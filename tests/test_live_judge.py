"""Live judging in a process of its own (the collector's default): the same verdicts as the
streaming path, a judge process killed mid-stream replaced without a verdict lost or changed,
and no judge process outliving its collector, stopped (SIGTERM) or killed (SIGKILL)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lifecycle import RECIPES, lifecycle_streams
from polars.testing import assert_frame_equal
from test_incremental import _live_rows
from test_paths_agree import BOOK, SORT, streaming
from test_shards import fleet_events

from kvtrace.analysis.evaluate import Policy
from kvtrace.analysis.sql import conform_results
from kvtrace.collector.live import LiveReconstruction
from kvtrace.collector.metrics import CollectorMetrics
from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.simulator import CacheSimulator, SimConfig, SimRequest
from kvtrace.instrumentation.sinks.http import HttpSink
from kvtrace.schema import Event
from kvtrace.schema.kinds import ComponentKind, EventKind, Tier
from kvtrace.schema.recipes import load_recipe
from kvtrace.store.client import Store
from tests.collector_proc import CollectorProcess


@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(events=lifecycle_streams(), cuts=st.lists(st.floats(0, 1), max_size=4), fleet=st.booleans())
def test_a_judge_process_writes_the_streaming_rows(store: Store, events: list[Event], cuts: list[float],
                                                   fleet: bool) -> None:
    policy = Policy(fleet=fleet)
    got = _live_rows(store, events, cuts, policy, own_process=True)
    assert_frame_equal(got, streaming(events, policy), check_exact=True)


def _stored_alone(store: Store, events: list[Event]) -> None:
    """The store holding these events alone, and no verdicts: the collector stores every batch
    before it is judged, and a rebuilt instance reads them back."""
    store.command(f"TRUNCATE TABLE {store.db}.events")
    store.command(f"TRUNCATE TABLE {store.db}.verdicts")
    store.insert_events(events)


def _live_verdicts(store: Store) -> pl.DataFrame:
    return conform_results(store.query_polars(f"SELECT * FROM {store.db}.verdicts FINAL")).sort(SORT)


def test_a_judge_process_killed_mid_stream_is_replaced_and_no_verdict_changes(store: Store) -> None:
    """SIGKILL the judge between batches and while it judges: a fresh one reads each instance's
    judged events back from the store, and the rows are the full run's."""
    events = sorted(fleet_events(instances=3, requests=40), key=lambda e: (e.ts_ns, e.source_id, e.seq))
    _stored_alone(store, events)
    live = LiveReconstruction(store, BOOK, CollectorMetrics(), lateness_ns=0, own_process=True)
    try:
        batches = [events[a:a + 300] for a in range(0, len(events), 300)]
        assert len(batches) >= 4
        for i, batch in enumerate(batches):
            if i in (1, 3):
                os.kill(live.judges.pid, signal.SIGKILL)
                time.sleep(0.2)
            live.feed(batch)
        live.tick(force=True)
        assert live.judges.restarts == 2 and live.rebuilt_events > 0
    finally:
        live.close()
    got = _live_verdicts(store)
    assert_frame_equal(got, streaming(events), check_exact=True)


def test_a_judge_not_waited_for_at_start_answers_late_and_judges_as_ever(store: Store) -> None:
    """The collector waits for its judge's first answer only so long (a loaded machine, an import
    that hangs must not keep it from serving): the ping it stopped waiting for is answered later,
    and that answer is read before the next call's, so no call takes another's reply."""
    events = sorted(fleet_events(instances=2, requests=30), key=lambda e: (e.ts_ns, e.source_id, e.seq))
    _stored_alone(store, events)
    live = LiveReconstruction(store, BOOK, CollectorMetrics(), lateness_ns=0, own_process=True)
    try:
        assert live.judges.warm(timeout_s=0) is False  # a fresh process cannot have answered yet
        assert live.judges.warm(timeout_s=0) is False  # still owed: not asked twice
        for a in range(0, len(events), 200):
            live.feed(events[a:a + 200])
        live.tick(force=True)
        assert live.judges.restarts == 0
    finally:
        live.close()
    got = _live_verdicts(store)
    assert_frame_equal(got, streaming(events), check_exact=True)


def _fed_then_judge_killed(store: Store) -> tuple[list[Event], LiveReconstruction]:
    """Two instances' events, each without its last request's adopt (a lookup left waiting),
    stored and fed to a live reconstruction whose judge process is then SIGKILLed."""
    events = sorted(fleet_events(instances=2, requests=30), key=lambda e: (e.ts_ns, e.source_id, e.seq))
    last = {e.instance: e.request_id for e in events if e.kind is EventKind.LOOKUP}  # each instance's last request
    events = [e for e in events if not (e.kind is EventKind.ADOPT and last.get(e.instance) == e.request_id)]
    _stored_alone(store, events)
    live = LiveReconstruction(store, BOOK, CollectorMetrics(), lateness_ns=0, own_process=True)
    try:
        for a in range(0, len(events), 300):
            live.feed(events[a:a + 300])
        os.kill(live.judges.pid, signal.SIGKILL)
        time.sleep(0.2)
    except BaseException:
        live.close()
        raise
    return events, live


def _rows_equal_streaming(store: Store, events: list[Event]) -> None:
    got = _live_verdicts(store)
    want = streaming(events)
    assert want.filter(pl.col("adopt_seen") == 0).height >= 2  # the two lookups left waiting
    assert_frame_equal(got, want, check_exact=True)


def test_a_judge_lost_at_the_final_tick_still_writes_the_lookups_left_without_an_adopt(store: Store) -> None:
    """The collector stops (its last tick finishes every instance) just after the judge died: the
    fresh judge rebuilds each instance, and the lookups whose adopt never came still get their
    verdicts, as the streaming path gives them at its end."""
    events, live = _fed_then_judge_killed(store)
    try:
        live.tick(force=True)
        assert live.judges.restarts == 1
    finally:
        live.close()
    _rows_equal_streaming(store, events)


def test_a_judge_lost_when_emitters_end_still_closes_every_ended_source(store: Store) -> None:
    """Two instances' emitters end (their last stats say so) just after the judge died: the
    fresh judge rebuilds both, and both sources are closed in that same call, so their lookups
    left without an adopt get their verdicts now, not when a later tick finds them idle (an
    hour by default). Before, the pass stopped at the lost judge: the second source was never
    marked ended."""
    events, live = _fed_then_judge_killed(store)
    sources = sorted({(e.instance, e.source_id) for e in events})
    assert len(sources) == 2
    try:
        live.ended(sources)
        assert live.judges.restarts == 1
        assert all(not inst.ended for inst in live._instances.values())  # both closed, none left waiting
        live._write([])  # what the feeds held back (written in parts), written now
    finally:
        live.close()
    _rows_equal_streaming(store, events)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _judges(pid: int) -> list[int]:
    """The collector's judge processes (multiprocessing's resource tracker is the other child)."""
    found = []
    for child in _children(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"spawn_main" in cmdline:
            found.append(child)
    return found


def _gone(pids: list[int], timeout_s: float = 20) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                state = Path(f"/proc/{pid}/stat").read_text().split()[2]
                if state != "Z":
                    alive.append(pid)
            except (ProcessLookupError, FileNotFoundError):
                pass
        if not alive:
            return True
        time.sleep(0.1)
    return False


def _serve(url: str, first: int, n: int, start_ns: int) -> None:
    recipe = load_recipe("mamba-hybrid")
    emitter = BatchEmitter(HttpSink(url), BatchConfig(max_export_batch_size=64, schedule_delay_millis=20))
    sim = CacheSimulator(SimConfig(recipe=recipe, model="m", start_ns=start_ns, instance="engine-a"), emitter)
    prefix = list(range(1000, 1000 + 96))
    for i in range(first, first + n):
        sim.serve(SimRequest(request_id=f"r{i}", tokens=prefix + [i] * (16 + i % 32)))
    assert emitter.force_flush(30_000)
    emitter.shutdown()


def test_the_collector_replaces_a_killed_judge_and_leaves_none_behind(tmp_path: Path) -> None:
    """`kvtrace collector` as operators run it: its judge process is up once the collector is
    ready, before any batch; SIGKILLed mid-load it is replaced (every lookup still gets the
    offline verdict), SIGTERM stops the judge with the collector, and a SIGKILLed collector's
    judge exits by itself."""
    proc = CollectorProcess(tmp_path, "--recipe", "mamba-hybrid", "--lateness-ms", "200")
    proc.start()
    assert proc.proc is not None
    assert len(_judges(proc.proc.pid)) == 1, "no judge process when the collector said it was ready"
    t0 = time.time_ns()
    _serve(proc.url, 0, 20, t0)
    deadline = time.monotonic() + 60
    while not (judges := _judges(proc.proc.pid)):
        assert time.monotonic() < deadline, "no judge process started"
        time.sleep(0.1)
    os.kill(judges[0], signal.SIGKILL)
    _serve(proc.url, 20, 20, t0 + 10**9)  # a later stretch of the same engine's clock
    proc.wait_drained()
    time.sleep(1.0)  # past the lateness window and a tick: what was held is judged
    second = _judges(proc.proc.pid)
    assert second and second != judges
    assert proc.stop()
    assert _gone(second), "the judge outlived its collector (SIGTERM)"
    log = (tmp_path / "collector.log").read_text()
    assert "the live judge process died" in log
    code = ("import json,sys; from kvtrace.store.client import Store; from kvtrace.schema.arrow import from_arrow; "
            "from kvtrace.analysis.reconstruct import reconstruct; from kvtrace.schema.recipes import load_recipe; "
            "s = Store(sys.argv[1]); ev = [e for t in s.iter_event_batches() for e in from_arrow(t)]; "
            "off = sorted((r.request_id, r.logical_hit_tokens, r.recoverable_hit_tokens, r.adopted_tokens, "
            "r.verdict.value, r.reason.value) for r in reconstruct(ev, load_recipe('mamba-hybrid'))); "
            "live = sorted(tuple(r.values()) for r in s.query_arrow('SELECT request_id, logical_hit_tokens, "
            "recoverable_hit_tokens, adopted_tokens, verdict, reason FROM kvtrace.verdicts FINAL').to_pylist()); "
            "print(json.dumps([off, live]))")
    out = subprocess.run([sys.executable, "-c", code, proc.dsn], env=proc.env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    offline, live = json.loads(out.stdout)
    assert len(offline) == 40 and live == offline

    # SIGKILL: nothing stops the judge but the pipe it reads closing with its collector.
    (tmp_path / "again").mkdir(exist_ok=True)
    proc2 = CollectorProcess(tmp_path / "again", "--recipe", "mamba-hybrid", "--lateness-ms", "200")
    proc2.start()
    assert proc2.proc is not None
    _serve(proc2.url, 0, 5, time.time_ns())
    deadline = time.monotonic() + 60
    while not (judges := _judges(proc2.proc.pid)):
        assert time.monotonic() < deadline, "no judge process started"
        time.sleep(0.1)
    helpers = _children(proc2.proc.pid)
    proc2.kill()
    assert _gone(helpers), "a helper process outlived its SIGKILLed collector"


def test_a_judge_lost_while_a_new_instance_starts_loses_no_other_instances_rows(store: Store) -> None:
    """A batch whose first rows are a new instance's: the judge dies as that instance's state is
    opened, and the rows of the instance already known that came in the same batch are still
    held, judged, and give the full run's rows."""
    events = sorted(fleet_events(instances=2, requests=30), key=lambda e: (e.ts_ns, e.source_id, e.seq))
    a, b = sorted({e.instance for e in events})
    _stored_alone(store, events)
    half = len(events) // 2
    first = [e for e in events[:half] if e.instance == a]  # only A is known before the loss
    rest = sorted([e for e in events[:half] if e.instance == b] + events[half:],
                  key=lambda e: (e.instance != b, e.ts_ns, e.source_id, e.seq))  # B's rows first in the batch
    live = LiveReconstruction(store, BOOK, CollectorMetrics(), lateness_ns=0, own_process=True)
    try:
        live.feed(first)
        os.kill(live.judges.pid, signal.SIGKILL)
        time.sleep(0.2)
        live.feed(rest)
        live.tick(force=True)
        assert live.judges.restarts == 1
    finally:
        live.close()
    got = _live_verdicts(store)
    assert_frame_equal(got, streaming(events), check_exact=True)


@pytest.mark.parametrize("own_process", [False, True])
def test_a_model_whose_events_contradict_its_given_recipe_gets_no_more_verdicts(store: Store,
                                                                                own_process: bool) -> None:
    """A commit of 8-token blocks where the given recipe says 4: that model's verdicts stop (they
    would be made up), and the other model's are the streaming rows, in either judge."""
    base = dict(engine="vllm", instance="i", source_id=7, component=ComponentKind.FULL_ATTENTION, tier=Tier.DEVICE)
    events: list[Event] = []

    def add(**kw: object) -> None:
        events.append(Event(ts_ns=1_750_000_000 * 10**9 + len(events), seq=len(events), **{**base, **kw}))  # type: ignore[arg-type]

    for r in range(60):
        model = "dense" if r % 2 else "hybrid"
        keys = [r * 10 + i + 1 for i in range(3)]
        span = 8 if r == 30 else RECIPES[model].groups[0].block_size  # request 30 contradicts hybrid's recipe
        add(model=model, kind=EventKind.LOOKUP, request_id=f"r{r}", prompt_tokens=9, group_block_keys=[keys])
        add(model=model, kind=EventKind.ADOPT, request_id=f"r{r}", reused_tiers=[Tier.DEVICE], reused_tokens=[0],
            recomputed_tokens=9)
        add(model=model, kind=EventKind.COMMIT, block_key=keys[0], token_start=0, token_end=span, nbytes=8)
    store.command(f"TRUNCATE TABLE {store.db}.verdicts")
    store.insert_events(events)
    metrics = CollectorMetrics()
    live = LiveReconstruction(store, BOOK, metrics, lateness_ns=0, own_process=own_process)
    try:
        for a in range(0, len(events), 50):
            live.feed(events[a:a + 50])
        live.tick(force=True)
    finally:
        live.close()
    assert ("vllm", "hybrid") in live.refused and "8" in live.refused[("vllm", "hybrid")]
    got = _live_verdicts(store)
    dense = [e for e in events if e.model == "dense"]
    assert_frame_equal(got.filter(pl.col("model") == "dense"), streaming(dense), check_exact=True)
    hybrid = got.filter(pl.col("model") == "hybrid")["request_id"].to_list()
    assert hybrid == [f"r{r}" for r in range(0, 31, 2)]  # up to the contradiction (r30's lookup comes first)
    skipped = metrics.live_skipped.labels("recipe_mismatch")._value.get()
    assert skipped >= 3 * 14  # hybrid's later requests, each of their events


@pytest.mark.parametrize("shared", [True, False], ids=["shared-memory", "pipe"])
def test_tables_reach_the_judge_through_shared_memory_or_the_pipe_with_the_same_verdicts(
        store: Store, monkeypatch: pytest.MonkeyPatch, shared: bool) -> None:
    """The collector's tables and the judge's verdicts cross in memory files both processes map
    (Linux's memfd), or on the pipe where there are none. Batches of ~0.2 and ~1.5 MB: the first
    file (1 MiB) grows, and each side maps it again."""
    from kvtrace.collector import judge

    if not shared:
        monkeypatch.setattr(judge._Shared, "pair", staticmethod(lambda: None))
    events = fleet_events(instances=2, requests=120)
    got = _live_rows(store, events, [0.1, 0.5], Policy(), own_process=True)
    assert got.height > 100
    assert_frame_equal(got, streaming(events, Policy()), check_exact=True)
