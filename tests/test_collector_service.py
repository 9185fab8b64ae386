"""The collector served over real HTTP (uvicorn on loopback) into the embedded store."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import uvicorn
from msgspec.structs import replace
from strategies import event_key, seeded_events

from kvtrace.analysis.reconstruct import reconstruct
from kvtrace.collector.app import create_app
from kvtrace.collector.auth import TokenTable
from kvtrace.collector.service import Collector, CollectorConfig
from kvtrace.collector.spool import SpoolRecord, encode_record
from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter, JournalConfig
from kvtrace.instrumentation.simulator import CacheSimulator, SimConfig, SimRequest
from kvtrace.instrumentation.sinks.base import ExportStatus
from kvtrace.instrumentation.sinks.http import HttpSink
from kvtrace.schema.arrow import from_arrow, to_arrow
from kvtrace.schema.arrow_wire import ARROW_TYPE, Envelope, encode_columns, write_stream
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import ComponentKind, EventKind, Tier
from kvtrace.schema.recipes import RecipeBook, load_recipe
from kvtrace.schema.verdicts import LookupResult
from kvtrace.schema.wire import CONTENT_TYPE, Batch, encode_batch
from kvtrace.store.client import Store

TOKENS = "tok-acme=acme;tok-beta=beta;tok-op=*"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    """A collector behind uvicorn in a thread, stopped (and drained) on exit."""

    def __init__(self, config: CollectorConfig) -> None:
        self.collector = Collector(config)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.collector), host="127.0.0.1", port=self.port,
                                                    log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Served:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "collector did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(60)

    def client(self, token: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def settle(self, timeout_s: float = 30) -> None:
        """Wait until everything spooled is in the store."""
        deadline = time.monotonic() + timeout_s
        while self.collector.spool.pending_bytes:
            assert time.monotonic() < deadline, "spool did not drain"
            time.sleep(0.02)


@pytest.fixture
def served(store: Store, store_dsn: str, tmp_path: Path) -> Iterator[Served]:
    with Served(CollectorConfig(dsn=store_dsn, spool_dir=str(tmp_path / "spool"),
                                tokens=TokenTable.parse_env(TOKENS))) as s:
        yield s


def events(n: int, tenant: str = "", source: int = 11, instance: str = "i1") -> list[Event]:
    t0 = time.time_ns()
    return [Event(kind=EventKind.LOOKUP, ts_ns=t0 + i, source_id=source, seq=i, instance=instance, model="m",
                  request_id=f"{tenant or 'x'}-{i}", prompt_tokens=64, tenant=tenant) for i in range(n)]


def stored(store: Store) -> list[Event]:
    return [e for table in store.iter_event_batches() for e in from_arrow(table)]


def post(client: httpx.Client, evs: list[Event], seq: int = 1) -> httpx.Response:
    body = encode_batch(Batch(source_id=evs[0].source_id if evs else 1, batch_seq=seq, sent_ns=time.time_ns(),
                              events=evs))
    return client.post("/v1/batches", content=body, headers={"Content-Type": CONTENT_TYPE})


@pytest.mark.parametrize("journal", [False, True], ids=["in-memory", "journaled"])
@pytest.mark.parametrize("wire", ["rows", "columns"])
def test_the_emitter_delivers_through_the_collector_into_the_store(served: Served, store: Store, wire: str,
                                                                  journal: bool, tmp_path: Path) -> None:
    """Journaled, rows go out as the journal holds them (never decoded in the engine), columns
    from decoded events: the collector takes both as it takes an in-memory emitter's."""
    emitter = BatchEmitter(HttpSink(served.url, token="tok-acme", wire=wire), BatchConfig(max_export_batch_size=500),
                           journal=JournalConfig(str(tmp_path / "journal"), 1 << 20) if journal else None)
    assert (emitter._journal is not None) == journal
    sent = events(3000)
    for e in sent:
        emitter.emit(e)
    assert emitter.force_flush(30_000)
    emitter.shutdown()
    served.settle()
    assert emitter.stats().exported == 3000 and emitter.stats().dropped == 0
    assert store.count_events() == 3000
    assert store.scalar(f"SELECT uniqExact(tenant) FROM {store.db}.events") == 1
    assert store.scalar(f"SELECT any(tenant) FROM {store.db}.events") == "acme"  # stamped with the token's tenant
    stats = store.scalar(f"SELECT max(exported) FROM {store.db}.emitter_stats")
    assert stats and stats > 0
    assert store.scalar(f"SELECT argMax(ended, ts_ns) FROM {store.db}.emitter_stats") == "clean"


def test_bad_rows_are_quarantined_and_the_reply_says_why(served: Served, store: Store) -> None:
    raw = [msgspec.to_builtins(e) for e in events(3)]
    raw[1]["token_start"], raw[1]["token_end"] = 10, 5
    body = msgspec.json.encode({"wire_version": 1, "source_id": 11, "batch_seq": 1, "sent_ns": 1, "events": raw})
    with served.client("tok-acme") as c:
        r = c.post("/v1/batches", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 200
    reply = r.json()
    assert (reply["received"], reply["accepted"], reply["quarantined"]) == (3, 2, 1)
    assert reply["problems"] == [{"row": 2, "field": "token_end", "reason": "token_end 5 < token_start 10"}]
    served.settle()
    assert store.count_events() == 2
    row = store.query_arrow(f"SELECT row, field, reason FROM {store.db}.quarantine").to_pylist()
    assert row == [{"row": 2, "field": "token_end", "reason": "token_end 5 < token_start 10"}]


ENDPOINTS = [("POST", "/v1/batches"), ("POST", "/v1/logs"), ("GET", "/v1/events"), ("GET", "/v1/verdicts"),
             ("GET", "/v1/hit-rates")]


def test_every_data_endpoint_refuses_a_missing_or_unknown_token(served: Served) -> None:
    for token in (None, "tok-unknown"):
        with served.client(token) as c:
            for method, path in ENDPOINTS:
                r = c.request(method, path, content=b"{}", headers={"Content-Type": "application/json"})
                assert r.status_code == 401, (method, path, token)
                assert r.json() == {"error": "missing or unknown bearer token"}
                assert r.headers["WWW-Authenticate"].startswith("Bearer")
    with served.client() as c:  # probes need no token
        assert c.get("/healthz").status_code == 200 and c.get("/readyz").status_code == 200
        docs = c.get("/openapi.json").text + c.get("/docs").text
        assert "acme" not in docs and "beta" not in docs  # the API's description names no tenant
        assert c.get("/metrics").status_code == 401  # its series are labelled by tenant
    with served.client("tok-acme") as c:
        r = c.get("/metrics")
        assert r.status_code == 403 and "operator token" in r.json()["error"]
    with served.client("tok-op") as c:
        assert c.get("/metrics").status_code == 200


def test_metrics_can_be_made_public(store: Store, store_dsn: str, tmp_path: Path) -> None:
    config = CollectorConfig(dsn=store_dsn, spool_dir=str(tmp_path / "spool"), tokens=TokenTable.parse_env(TOKENS),
                             public_metrics=True)
    with Served(config) as s, s.client() as c:
        assert c.get("/metrics").status_code == 200


def test_tenants_are_isolated_on_every_endpoint(served: Served, store: Store) -> None:
    with served.client("tok-acme") as acme, served.client("tok-beta") as beta, served.client("tok-op") as op:
        assert post(acme, events(5, source=21)).status_code == 200
        assert post(beta, events(3, source=22, instance="i2")).status_code == 200
        # writing into another tenant's namespace is refused whole, on both ingest paths
        r = post(beta, events(2, tenant="acme", source=23))
        assert r.status_code == 403 and "'acme'" in r.json()["error"] and "outside" in r.json()["error"]
        from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

        req = ExportLogsServiceRequest()
        rec = req.resource_logs.add().scope_logs.add().log_records.add()
        rec.event_name = "kvtrace.event"
        rec.body.string_value = msgspec.json.encode(events(1, tenant="acme", source=24)[0]).decode()
        r = beta.post("/v1/logs", content=req.SerializeToString(), headers={"Content-Type": "application/x-protobuf"})
        assert r.status_code == 403
        served.settle()
        # the lookups become verdict rows here directly, as live reconstruction would write them
        rows = [replace(r, adopt_seen=True) for r in reconstruct(stored(store), load_recipe("dense"))]
        store.insert_arrow("verdicts", to_arrow(rows, LookupResult))
        for path in ("/v1/events", "/v1/verdicts"):
            a, b, o = acme.get(path).json(), beta.get(path).json(), op.get(path).json()
            assert {r["tenant"] for r in a} == {"acme"} and len(a) == 5, path
            assert {r["tenant"] for r in b} == {"beta"} and len(b) == 3, path
            assert len(o) == 8, path
            assert beta.get(path, params={"instance": "i1"}).json() == []  # filters cannot widen the scope
        rates = {t: [r["key"] for r in c.get("/v1/hit-rates", params={"by": "tenant"}).json()]
                 for t, c in (("acme", acme), ("beta", beta), ("op", op))}
        assert rates == {"acme": ["acme"], "beta": ["beta"], "op": ["acme", "beta"]}
        assert store.count_events() == 8  # nothing of the refused requests was stored


def test_backpressure_answers_429_with_retry_after_and_the_emitter_waits(tmp_path: Path) -> None:
    """The store is down: the spool fills to its bound, then the collector says 429 (try later);
    a batch larger than the whole bound gets 413 at once (it would never fit)."""
    down = f"http://127.0.0.1:{free_port()}/kvtrace"
    config = CollectorConfig(dsn=down, spool_dir=str(tmp_path / "spool"), max_spool_bytes=64 << 10, drain_timeout_s=1)
    with Served(config) as s, s.client() as c:
        r = post(c, events(2000))
        assert r.status_code == 413 and "can never fit" in r.json()["error"]
        codes = [post(c, events(20, source=1 + i), seq=i).status_code for i in range(100)]
        assert codes[0] == 200 and 429 in codes, codes
        r = post(c, events(20, source=999))
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1 and "spool is full" in r.json()["error"]
        sink = HttpSink(s.url)  # the emitter's sink (compressed columns: smaller) is told to wait too
        results = [sink.export(Batch(source_id=1, batch_seq=i, sent_ns=1, events=events(20))) for i in range(50)]
        waits = [r for r in results if r.status is ExportStatus.RETRY]
        assert waits and all(r.retry_after_s >= 1 for r in waits)
        assert s.collector.spool.pending_bytes > 0


def test_one_tenant_filling_the_spool_leaves_the_others_their_share(tmp_path: Path) -> None:
    """The store is down and tenant A sends as fast as it can: A is told 429 once past its share
    of the spool, while B, within its share, still gets its batches in."""
    down = f"http://127.0.0.1:{free_port()}/kvtrace"
    config = CollectorConfig(dsn=down, spool_dir=str(tmp_path / "spool"), max_spool_bytes=256 << 10,
                             tokens=TokenTable.parse_env(TOKENS), drain_timeout_s=1)
    with Served(config) as s, s.client("tok-acme") as acme, s.client("tok-beta") as beta:
        codes = [post(acme, events(20, source=1 + i), seq=i).status_code for i in range(200)]
        assert 429 in codes
        first = codes.index(429)
        assert all(c == 429 for c in codes[first:])  # nothing drains: A stays refused
        assert s.collector.spool.pending_bytes >= 0.8 * config.max_spool_bytes * config.high_water
        got = [post(beta, events(20, source=1000 + i), seq=i).status_code for i in range(5)]
        assert got == [200] * 5, got  # B is within its share: taken, above A's high water
        r = post(acme, events(20, source=999))
        assert r.status_code == 429 and "its share" in r.json()["error"]


def test_graceful_stop_drains_the_spool_and_restart_finds_nothing_left(store: Store, store_dsn: str,
                                                                         tmp_path: Path) -> None:
    config = CollectorConfig(dsn=store_dsn, spool_dir=str(tmp_path / "spool"))
    with Served(config) as s, s.client() as c:
        for i in range(20):
            assert post(c, events(100, source=100 + i), seq=i).status_code == 200
    assert s.collector.spool.pending_bytes == 0
    assert store.count_events() == 2000


def test_readiness_and_metrics_report_what_happened(served: Served) -> None:
    with served.client("tok-acme") as c:
        assert c.get("/readyz").json()["ready"] is True
        post(c, events(10))
        c.post("/v1/batches", content=b"nope", headers={"Content-Type": CONTENT_TYPE})
        served.settle()
    with served.client("tok-op") as c:
        text = c.get("/metrics").text
    assert 'kvtrace_collector_events_accepted_total{tenant="acme"} 10.0' in text
    assert 'kvtrace_collector_requests_rejected_total{code="400",tenant="acme"} 1.0' in text
    assert 'kvtrace_collector_events_stored_total{tenant="acme"} 10.0' in text
    assert "kvtrace_collector_spool_pending_bytes 0.0" in text


@pytest.mark.parametrize(("wire", "given"), [("rows", True), ("columns", True), ("rows", False)],
                         ids=["rows", "columns", "engine-recipe"])
def test_live_reconstruction_writes_the_same_verdicts_as_offline_analysis(store: Store, store_dsn: str,
                                                                         tmp_path: Path, wire: str,
                                                                         given: bool) -> None:
    """With a recipe given, or with none: then the live state judges the engine's lookups by the
    recipe the engine published when it attached (what `kvtrace collector` does by default)."""
    recipe = load_recipe("mamba-hybrid")
    config = CollectorConfig(dsn=store_dsn, spool_dir=str(tmp_path / "spool"),
                             recipes=recipe if given else RecipeBook(), lateness_ns=200_000_000)
    with Served(config) as s:
        emitter = BatchEmitter(HttpSink(s.url, wire=wire),
                               BatchConfig(max_export_batch_size=256, schedule_delay_millis=20))
        sim = CacheSimulator(SimConfig(recipe=recipe, model="m", start_ns=time.time_ns()), emitter)
        prefix = list(range(1000, 1000 + 96))
        for i in range(40):
            sim.serve(SimRequest(request_id=f"r{i}", tokens=prefix + [i] * (16 + i % 32)))
        assert emitter.force_flush(30_000)
        emitter.shutdown()
        s.settle()
    # stopping flushed the live state; every lookup has its verdict row
    offline = sorted((r for r in reconstruct(stored(store), recipe if given else None)),
                     key=lambda r: (r.ts_ns, r.seq))
    live = store.query_arrow(f"SELECT * FROM {store.db}.verdicts FINAL ORDER BY ts_ns, seq").to_pylist()
    assert len(live) == len(offline) == 40
    for a, b in zip(live, offline, strict=True):
        assert (a["request_id"], a["logical_hit_tokens"], a["recoverable_hit_tokens"], a["adopted_tokens"],
                a["verdict"], a["reason"]) == (b.request_id, b.logical_hit_tokens, b.recoverable_hit_tokens,
                                               b.adopted_tokens, b.verdict.value, b.reason.value)
    assert sum(r["recoverable_hit_tokens"] for r in live) > 0


def test_ingest_goes_on_while_the_live_verdicts_store_calls_are_held_up(store: Store, store_dsn: str,
                                                                        tmp_path: Path) -> None:
    """The drain stores through a handle of its own: while the live path's calls on the store
    wait (a long verdict insert, a rebuild reading an instance's history), batches still reach
    the store, and their verdicts come once the live path goes on."""
    config = CollectorConfig(dsn=store_dsn, spool_dir=str(tmp_path / "spool"), recipes=load_recipe("mamba-hybrid"),
                             lateness_ns=0)
    before = store.scalar(f"SELECT count() FROM {store.db}.verdicts")
    with Served(config) as s:
        assert s.collector.live_store is not None
        with s.collector.live_store._lock, s.client() as c:  # the live path's handle busy
            assert post(c, events(50, instance="held-up")).status_code == 200
            s.settle()
            assert store.scalar(f"SELECT count() FROM {store.db}.events WHERE instance = 'held-up'") == 50
            assert store.scalar(f"SELECT count() FROM {store.db}.verdicts") == before
    # stopping waited for the live path, then flushed it: each lookup has its verdict
    assert store.scalar(f"SELECT count() FROM {store.db}.verdicts FINAL WHERE instance = 'held-up'") == 50


def test_every_field_survives_the_collector_exactly(store: Store, store_dsn: str, tmp_path: Path) -> None:
    """Extremes, non-ASCII text, NUL bytes, every kind and enum: stored as sent, whether they
    came as rows or as columns (alternately, so that drain chunks hold both). Timestamps too,
    from a collector told to take any time (the default quarantines implausible ones)."""
    sent = seeded_events(3000, seed=5)
    config = CollectorConfig(dsn=store_dsn, spool_dir=str(tmp_path / "spool"), tokens=TokenTable.parse_env(TOKENS),
                             time_window=None)
    with Served(config) as served, served.client("tok-op") as c:
        for i in range(0, len(sent), 500):
            part = sent[i:i + 500]
            if i // 500 % 2:
                body, ctype = encode_columns(Envelope(source_id=1, batch_seq=i, sent_ns=1), part), ARROW_TYPE
            else:
                body, ctype = encode_batch(Batch(source_id=1, batch_seq=i, sent_ns=1, events=part)), CONTENT_TYPE
            r = c.post("/v1/batches", headers={"Content-Type": ctype}, content=body)
            assert r.status_code == 200 and r.json()["accepted"] == len(part), r.text
    served.settle()
    assert sorted(stored(store), key=event_key) == sorted(sent, key=event_key)


def test_a_poison_batch_in_the_spool_is_quarantined_and_the_drain_goes_on(store: Store, store_dsn: str,
                                                                          tmp_path: Path) -> None:
    """Intake never spools what cannot be stored; if a frame ever cannot be read back (say, a
    spool left by another kvtrace version), it must not stall the drain."""
    config = CollectorConfig(dsn=store_dsn, spool_dir=str(tmp_path / "spool"))
    older = to_arrow(events(3, source=98)).drop_columns(["noise_floor", "probe_of"])  # as an older schema spooled it
    with Served(config) as s:
        s.collector.spool.append(b"\x93not a batch")
        s.collector.spool.append(encode_record(SpoolRecord(received_ns=1, origin="t", events=1, tenants={}, lines=b"",
                                                           columns=b"not an Arrow stream")))
        s.collector.spool.append(encode_record(SpoolRecord(received_ns=1, origin="t", events=3, tenants={}, lines=b"",
                                                           columns=write_stream(older))))
        s.collector.drain.poke()
        with s.client() as c:
            assert post(c, events(7, source=99)).status_code == 200
        s.settle()
    assert store.count_events() == 10
    rows = store.query_arrow(f"SELECT origin, reason FROM {store.db}.quarantine").to_pylist()
    assert len(rows) == 2
    assert all(r["origin"].startswith("spool:") and "cannot store this record" in r["reason"] for r in rows)


def _serve_requests(url: str, sim: CacheSimulator, requests: list[SimRequest]) -> None:
    emitter = BatchEmitter(HttpSink(url), BatchConfig(max_export_batch_size=256, schedule_delay_millis=20))
    sim._emitter = emitter  # the engine's stream moves to another collector, as a load balancer does
    for r in requests:
        sim.serve(r)
    assert emitter.force_flush(30_000)
    emitter.shutdown()


@pytest.mark.parametrize("rebuild", [True, False])
def test_a_collector_taking_over_an_instance_rebuilds_its_state_from_the_store(
        store: Store, store_dsn: str, tmp_path: Path, rebuild: bool) -> None:
    recipe = load_recipe("mamba-hybrid")
    prefix = list(range(5000, 5000 + 128))
    requests = [SimRequest(request_id=f"r{i}", tokens=prefix + [i] * (16 + i % 40)) for i in range(30)]
    sim = CacheSimulator(SimConfig(recipe=recipe, model="m", instance="engine-7", start_ns=time.time_ns()),
                         BatchEmitter(HttpSink("http://x")))

    def config(name: str) -> CollectorConfig:
        return CollectorConfig(dsn=store_dsn, spool_dir=str(tmp_path / name), recipes=recipe,
                               lateness_ns=100_000_000)

    with Served(config("first")) as first:
        _serve_requests(first.url, sim, requests[:12])
        first.settle()
    second = Served(config("second"))
    assert second.collector.live is not None
    second.collector.live.rebuild = rebuild
    with second:
        _serve_requests(second.url, sim, requests[12:])
        second.settle()
    offline = {r.request_id: r for r in reconstruct(stored(store), recipe)}
    live = {r["request_id"]: r for r in
            store.query_arrow(f"SELECT * FROM {store.db}.verdicts FINAL").to_pylist()}
    assert set(live) == set(offline) == {r.request_id for r in requests}
    later = [r.request_id for r in requests[12:]]
    same = [(live[k]["recoverable_hit_tokens"], live[k]["verdict"]) ==
            (offline[k].recoverable_hit_tokens, offline[k].verdict.value) for k in later]
    assert sum(offline[k].recoverable_hit_tokens for k in later) > 0  # the later requests reuse the prefix
    if rebuild:
        assert all(same)
        assert second.collector.live.rebuilt_events > 0
    else:  # the control: without the store's history the taken-over instance looks cold
        assert not all(same)


def test_subscriber_mode_stores_an_engines_kv_event_stream(store: Store, store_dsn: str, tmp_path: Path) -> None:
    import zmq

    from kvtrace.collector.subscribe import KvEventSource

    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    source = KvEventSource(endpoint=f"tcp://127.0.0.1:{port}", instance="engine-z", model="m", tenant="acme")
    config = CollectorConfig(dsn=store_dsn, spool_dir=str(tmp_path / "spool"), kv_event_sources=(source,))

    def publish(seq: int, *events: dict) -> None:
        pub.send_multipart([b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([1.5 + seq, list(events), 0])])

    stored_ = {"type": "BlockStored", "parent_block_hash": None, "token_ids": [], "block_size": 16,
               "lora_id": None, "medium": "GPU"}
    try:
        with Served(config) as s:
            time.sleep(0.5)  # a SUB socket misses what is published before it has joined
            publish(0, {**stored_, "block_hashes": [101, 102, 103]})
            publish(1, {**stored_, "block_hashes": [104]}, {"type": "BlockRemoved", "block_hashes": [101],
                                                             "medium": "GPU"})
            deadline = time.monotonic() + 20
            while s.collector.drain.stored_events < 3:
                assert time.monotonic() < deadline, "the stream's events were not stored"
                time.sleep(0.05)
    finally:
        pub.close()
    got = sorted(stored(store), key=event_key)
    assert [(e.kind, e.block_key, e.more_keys) for e in got] == [
        (EventKind.COMMIT, 101, [102, 103]), (EventKind.COMMIT, 104, []), (EventKind.EVICT, 101, [])]
    assert {(e.instance, e.model, e.tenant) for e in got} == {("engine-z", "m", "acme")}


def test_idle_instances_are_finished_and_forgotten(store: Store, store_dsn: str, tmp_path: Path) -> None:
    from kvtrace.collector.live import LiveReconstruction
    from kvtrace.collector.metrics import CollectorMetrics

    live = LiveReconstruction(store, load_recipe("dense"), CollectorMetrics(), lateness_ns=0, idle_s=0.0)
    evs = events(3, instance="gone-soon")
    store.insert_events(evs)
    live.feed(evs)
    assert live.instances() == ["gone-soon"]
    written = live.tick()
    assert live.instances() == [] and written == 3  # its lookups got their (adopt-less) verdicts first
    assert store.scalar(f"SELECT count() FROM {store.db}.verdicts") == 3



def test_a_dead_emitters_open_lookups_get_their_verdicts_when_its_end_arrives(store: Store, store_dsn: str,
                                                                              tmp_path: Path) -> None:
    """A server killed mid-load leaves lookups whose adopt never comes. Once its emitter's last
    stats say it ended, the live state closes them (as the end of the stream would), instead of
    holding them until the instance has been idle for an hour; a running emitter's stay open."""
    from kvtrace.schema.kinds import Ending
    from kvtrace.schema.records import EmitterStats

    config = CollectorConfig(dsn=store_dsn, spool_dir=str(tmp_path / "spool"), recipes=load_recipe("dense"),
                             lateness_ns=50_000_000)
    with Served(config) as s, s.client() as client:
        dead = [replace(e, request_id=f"dead-{e.seq}") for e in events(3, source=31, instance="eng")]
        alive = [replace(e, request_id=f"alive-{e.seq}") for e in events(2, source=32, instance="eng")]
        assert post(client, alive).status_code == 200
        last = EmitterStats(ts_ns=time.time_ns(), source_id=31, instance="eng", engine="vllm", emitted=3,
                            exported=3, ended=Ending.UNCLEAN, ended_ns=time.time_ns())
        body = encode_batch(Batch(source_id=31, batch_seq=1, sent_ns=time.time_ns(), events=dead, stats=last))
        assert client.post("/v1/batches", content=body, headers={"Content-Type": CONTENT_TYPE}).status_code == 200
        deadline = time.monotonic() + 30
        while s.collector.live.verdicts_written < 3:
            assert time.monotonic() < deadline, s.collector.live.verdicts_written
            time.sleep(0.05)
        time.sleep(0.5)  # several ticks: the running emitter's lookups are still open
        written = store.query_arrow(f"SELECT request_id, adopt_seen FROM {store.db}.verdicts FINAL").to_pylist()
        assert sorted((r["request_id"], r["adopt_seen"]) for r in written) == [
            ("dead-0", False), ("dead-1", False), ("dead-2", False)]
    # stopping closes the rest
    assert store.scalar(f"SELECT count() FROM {store.db}.verdicts FINAL") == 5

def test_a_dead_emitters_journal_shipped_in_several_batches_keeps_every_adopt(store: Store, store_dsn: str,
                                                                           tmp_path: Path) -> None:
    """The shipper of a killed engine's journal sends it in batches, each with the dead
    emitter's stats (ended unclean) and the depth still to go. A lookup in the first batch whose
    adopt is in the second keeps it, however long the second takes; the source's open lookups
    are closed only by the stats with nothing left to send."""
    from kvtrace.schema.kinds import Ending
    from kvtrace.schema.records import EmitterStats

    config = CollectorConfig(dsn=store_dsn, spool_dir=str(tmp_path / "spool"), recipes=load_recipe("dense"),
                             lateness_ns=50_000_000)
    t = time.time_ns()
    base = {"source_id": 41, "instance": "eng", "engine": "vllm", "model": "m"}
    commit = Event(kind=EventKind.COMMIT, ts_ns=t, seq=0, block_size=16, component=ComponentKind.FULL_ATTENTION,
                   block_key=11, tier=Tier.DEVICE, token_end=16, **base)
    lookups = [Event(kind=EventKind.LOOKUP, ts_ns=t + 1 + i, seq=1 + i, request_id=f"r{i}", prompt_tokens=20,
                     reported_hit_tokens=16, group_block_keys=[[11]], group_hit_tokens=[16], **base) for i in range(2)]
    adopt = Event(kind=EventKind.ADOPT, ts_ns=t + 3, seq=3, request_id="r0", reused_tiers=[Tier.DEVICE],
                  reused_tokens=[16], recomputed_tokens=4, **base)

    def shipped(evs: list[Event], seq: int, depth: int) -> bytes:
        stats = EmitterStats(ts_ns=time.time_ns(), source_id=41, instance="eng", engine="vllm", emitted=4,
                             exported=seq * 2, recovered=seq * 2, queue_depth=depth, ended=Ending.UNCLEAN,
                             ended_ns=t + 3)
        return encode_batch(Batch(source_id=41, batch_seq=seq, sent_ns=time.time_ns(), events=evs, stats=stats))

    headers = {"Content-Type": CONTENT_TYPE}
    with Served(config) as s, s.client() as client:
        assert client.post("/v1/batches", content=shipped([commit, *lookups], 1, 1), headers=headers).status_code == 200
        time.sleep(1.0)  # ticks past the lateness window: the first batch's rows all judged
        assert s.collector.live.verdicts_written == 0  # the source ended, but has more to send
        assert client.post("/v1/batches", content=shipped([adopt], 2, 0), headers=headers).status_code == 200
        deadline = time.monotonic() + 30
        while s.collector.live.verdicts_written < 2:
            assert time.monotonic() < deadline, s.collector.live.verdicts_written
            time.sleep(0.05)
        written = store.query_arrow(f"SELECT request_id, adopt_seen, adopted_tokens FROM {store.db}.verdicts FINAL")
    assert sorted(written.to_pylist(), key=lambda r: r["request_id"]) == [
        {"request_id": "r0", "adopt_seen": True, "adopted_tokens": 16},
        {"request_id": "r1", "adopt_seen": False, "adopted_tokens": 0}]


def test_live_reconstruction_judges_a_canarys_probe_against_its_re_run(store: Store) -> None:
    """A probe arrives after its re-run's adopt: the verdict and the probe make one verification row."""
    from kvtrace.collector.live import LiveReconstruction
    from kvtrace.collector.metrics import CollectorMetrics

    live = LiveReconstruction(store, load_recipe("dense"), CollectorMetrics(), lateness_ns=0, idle_s=3600.0)
    t, src = time.time_ns(), 99
    commit = Event(kind=EventKind.COMMIT, ts_ns=t, source_id=src, seq=0, instance="eng", model="m", block_size=16,
                   component=ComponentKind.FULL_ATTENTION, block_key=11, tier=Tier.DEVICE, token_end=16)
    rid = "kvtrace-verify-1"
    lookup = Event(kind=EventKind.LOOKUP, ts_ns=t + 1, source_id=src, seq=1, instance="eng", model="m",
                   request_id=rid, prompt_tokens=20, reported_hit_tokens=16, group_block_keys=[[11]],
                   group_hit_tokens=[16])
    adopt = Event(kind=EventKind.ADOPT, ts_ns=t + 2, source_id=src, seq=2, instance="eng", model="m",
                  request_id=rid, reused_tiers=[Tier.DEVICE], reused_tokens=[16], recomputed_tokens=4)
    probe = Event(kind=EventKind.PROBE, ts_ns=t + 3, source_id=src, seq=3, instance="eng", model="m",
                  request_id=rid, probe_of="user-7", prompt_tokens=20, reported_hit_tokens=16, probe_positions=8,
                  probe_max_abs_diff=0.0)
    evs = [commit, lookup, adopt, probe]
    store.insert_events(evs)
    live.feed(evs)
    live.tick(force=True)
    assert live.verifications_written == 1
    got = store.query_polars(f"SELECT request_id, agreement, adopted_tokens, detail FROM {store.db}.verifications")
    assert got["request_id"].to_list() == [rid] and got["agreement"].to_list() == ["recoverable_identical"]
    assert got["adopted_tokens"].to_list() == [16] and got["detail"][0].startswith("probe of user-7: ")


@pytest.mark.parametrize(("env", "want"), [(None, "jemalloc"), ("mimalloc", "mimalloc"), ("system", "system")])
def test_the_collector_process_gives_arrow_to_jemalloc_unless_the_operator_chose(env: str | None, want: str) -> None:
    """A process-wide choice, so each case runs in a process of its own (as `kvtrace collector`
    does); `ARROW_DEFAULT_MEMORY_POOL` set by the operator wins."""
    import os
    import subprocess
    import sys

    environ = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    if env:
        environ["ARROW_DEFAULT_MEMORY_POOL"] = env
    code = ("import pyarrow as pa; from kvtrace.collector.serve import arrow_pool; got = arrow_pool(); "
            "kept = pa.array(range(1000)); "
            "print(got, pa.default_memory_pool().backend_name, pa.total_allocated_bytes() > 0)")
    out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [want, want, "True"]
