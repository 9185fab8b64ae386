"""The collector end to end on loopback, next to ClickHouse's own insert rate for the same rows.

Rows: a realistic mix of kvtrace events (commit runs, lookups with per-group key chains, adopts,
evictions, offloads and loads) built once, then cut into batches of the emitter's default size
(8,192) and encoded as the emitter's HTTP sink sends them, in each wire format asked for:
msgpack rows (the default, gzip level 1) and Arrow columns (zstd). The sender's CPU per event to
encode each is printed first: the columnar wire moves work from the collector to the sender.

Measured in one run, alternating so machine noise hits all of them:
  raw        the same rows inserted straight into an embedded store in this process, in the
             same batch sizes, both as Arrow tables and as JSON lines (the faster counts): the
             floor of what any ingest path can reach.
  collector  `kvtrace collector` in its own process (its own embedded store, fsync'd spool, no
             auth; live verdicts off, and with --live also on, in the same round: the
             live reconstruction's own cost is the difference; with --live the judge is also timed
             alone, in this process), fed by --clients concurrent
             senders; events/s from the first request to the last event stored (spool
             drained), per-request latency (validate + fsync + reply), and the collector's
             resident memory sampled throughout (bounded: it must not grow with the number of
             events sent).

    .venv/bin/python benchmarks/bench_collector.py [--events 1000000] [--clients 4] [--rounds 2] [--stages]
        [--wire rows,columns]
    .venv/bin/python benchmarks/bench_collector.py --formats [--events 200000]

Each round also prints the CPU time the collector process and this one (the load generator)
spent per event; `--stages` then times each step alone in this process. `--formats` instead
compares, for the same rows, what each input format ClickHouse accepts costs to build in Python
and to parse.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pyarrow as pa

from kvtrace.instrumentation.attach import attach_events
from kvtrace.schema.arrow import to_arrow
from kvtrace.schema.arrow_wire import ARROW_TYPE, Envelope, encode_columns
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import ComponentKind, EventKind, Reason, Tier
from kvtrace.schema.recipes import dense
from kvtrace.schema.wire import CONTENT_TYPE, Batch, encode_batch

BATCH = 8192


def workload(n: int, seed: int = 1, capacity_blocks: int = 65_536) -> list[Event]:
    """A serving-like stream: each request looks up, adopts, commits a run of blocks; the device
    cache holds `capacity_blocks` blocks (a GPU's worth of 16-token blocks) and evicts the oldest
    runs past that, as an engine does (each eviction one event naming its run); some runs move
    to host and back. (Until 2026-12-04 it evicted one block of every third run, so its live
    objects grew without bound: 9M objects at 1M events, which the collector's live state then
    had to hold.)"""
    rng = random.Random(seed)
    t = time.time_ns() - n * 50_000  # recent: the collector quarantines rows stamped over 30 days before arrival
    source = rng.getrandbits(63) + 1
    out: list[Event] = []
    seq = 0
    r = 0
    resident: collections.deque[list[int]] = collections.deque()  # device runs, oldest first
    held = 0

    def ev(**kw: object) -> None:
        nonlocal seq, t
        t += rng.randint(1_000, 50_000)
        out.append(Event(ts_ns=t, source_id=source, seq=seq, engine="vllm", instance="bench-0",
                         model="meta-llama/Llama-3.1-8B", kv_dtype="bfloat16", block_size=16, **kw))  # type: ignore[arg-type]
        seq += 1

    # The engine attaches first, as a shim does: its recipe turns the live verdicts on, so with
    # --live every lookup is judged (without it the collector would skip them as of no known model).
    for attached in attach_events(Event(kind=EventKind.ATTACH), dense(), engine_version="bench"):
        ev(**{f: getattr(attached, f) for f in ("kind", "engine_version", "recipe", "tier", "reason")})
    while len(out) < n:
        r += 1
        rid = f"req-{r}"
        blocks = rng.randint(4, 64)
        keys = [rng.getrandbits(64) or 1 for _ in range(blocks)]
        hit = rng.randint(0, blocks) * 16
        ev(kind=EventKind.LOOKUP, request_id=rid, prompt_tokens=blocks * 16 + rng.randint(0, 15),
           reported_hit_tokens=hit, group_block_keys=[keys], group_hit_tokens=[hit])
        ev(kind=EventKind.ADOPT, request_id=rid, reused_tiers=[Tier.DEVICE], reused_tokens=[hit],
           recomputed_tokens=blocks * 16 - hit)
        ev(kind=EventKind.COMMIT, component=ComponentKind.FULL_ATTENTION, tier=Tier.DEVICE, block_key=keys[0],
           more_keys=keys[1:], token_start=0, token_end=blocks * 16, nbytes=2 << 20)
        resident.append(keys)
        held += blocks
        while held > capacity_blocks:
            old = resident.popleft()
            held -= len(old)
            ev(kind=EventKind.EVICT, component=ComponentKind.FULL_ATTENTION, tier=Tier.DEVICE, block_key=old[0],
               more_keys=old[1:], reason=Reason.CAPACITY, nbytes=2 << 20)
        if r % 5 == 0:
            ev(kind=EventKind.OFFLOAD, component=ComponentKind.FULL_ATTENTION, src_tier=Tier.DEVICE,
               dst_tier=Tier.HOST, block_key=keys[0], more_keys=keys[1:4], nbytes=2 << 20, duration_ns=80_000)
            ev(kind=EventKind.LOAD, component=ComponentKind.FULL_ATTENTION, src_tier=Tier.HOST,
               dst_tier=Tier.DEVICE, block_key=keys[0], nbytes=2 << 20, duration_ns=60_000, request_id=rid)
    return out[:n]


def _rows_body(part: list[Event], seq: int) -> bytes:
    return encode_batch(Batch(source_id=part[0].source_id, batch_seq=seq, sent_ns=time.time_ns(), events=part))


def _columns_body(part: list[Event], seq: int) -> bytes:
    return encode_columns(Envelope(source_id=part[0].source_id, batch_seq=seq, sent_ns=time.time_ns()), part)


def _zstd(body: bytes) -> bytes:
    return pa.compress(body, "zstd", asbytes=True)


def _gzip(body: bytes) -> bytes:
    return gzip.compress(body, 1)


WIRES = {"rows": (_rows_body, CONTENT_TYPE, _gzip, "gzip"), "columns": (_columns_body, ARROW_TYPE, _zstd, "zstd")}
"""Each wire format as the emitter's HTTP sink sends it: encoder, Content-Type, compression."""


def raw_insert(events: list[Event], root: Path) -> dict[str, float]:
    """Rows/s of inserting the rows straight into an embedded store (Arrow built beforehand,
    JSON lines encoded beforehand: only the insert is timed)."""
    import msgspec

    from kvtrace.store.client import Store

    store = Store(f"chdb://{root}/raw?database=raw_{int(time.time() * 1000)}")
    store.init()
    parts = [events[i:i + BATCH] for i in range(0, len(events), BATCH)]
    tables = [to_arrow(p) for p in parts]
    lines = [msgspec.json.Encoder().encode_lines(p) for p in parts]
    t = time.perf_counter()
    for table in tables:
        store.insert_arrow("events", table)
    arrow = len(events) / (time.perf_counter() - t)
    store.command(f"TRUNCATE TABLE {store.db}.events")
    t = time.perf_counter()
    for block in lines:
        store.insert_json_lines("events", block)
    json_rate = len(events) / (time.perf_counter() - t)
    store.command(f"TRUNCATE TABLE {store.db}.events")
    streams = []
    for table in tables:  # Arrow IPC bytes handed to ClickHouse as they are: its fastest input here
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        streams.append(sink.getvalue().to_pybytes())
    t = time.perf_counter()
    for block in streams:
        store.client.raw_insert(f"{store.db}.events", insert_block=block, fmt="ArrowStream")
    ipc = len(events) / (time.perf_counter() - t)
    store.command(f"DROP DATABASE {store.db}")
    return {"arrow": arrow, "json": json_rate, "arrow_ipc": ipc}


def insert_formats(events: list[Event], root: Path) -> dict[str, float]:
    """CPU per row (this process, ClickHouse's threads included) of each way the same rows could
    reach the embedded store: building the input in Python, then ClickHouse parsing it.
    Also how much of a Python thread's speed survives a one-thread insert beside it: near 100 %
    if chDB lets go of the GIL while ClickHouse works, near 0 if not."""
    import msgspec
    import pyarrow.json as pj

    from kvtrace.schema.arrow import arrow_schema
    from kvtrace.store.client import Store

    store = Store(f"chdb://{root}/formats?database=formats_{int(time.time() * 1000)}")
    store.init()
    table = f"{store.db}.events"
    names = list(Event.__struct_fields__)
    enc = msgspec.msgpack.Encoder()
    header = len(enc.encode((None,) * len(names))) - len(names)  # the array header before each row's values
    chunks = [events[i:i + 49152] for i in range(0, len(events), 49152)]
    out: dict[str, float] = {}

    def timed(name: str, build, insert=None) -> list:  # noqa: ANN001
        t = time.process_time()
        blocks = [build(c) for c in chunks]
        out[f"build {name}"] = (time.process_time() - t) / len(events) * 1e6
        if insert is not None:
            t = time.process_time()
            for block in blocks:
                insert(block)
            out[f"insert {name}"] = (time.process_time() - t) / len(events) * 1e6
            store.command(f"TRUNCATE TABLE {table}")
        return blocks

    json_lines = timed("JSONEachRow", msgspec.json.Encoder().encode_lines,
                       lambda b: store.insert_json_lines("events", b))
    timed("JSONCompactEachRow", lambda c: msgspec.json.Encoder().encode_lines([msgspec.structs.astuple(e) for e in c]),
          lambda b: store.client.raw_insert(table, column_names=names, insert_block=b, fmt="JSONCompactEachRow"))
    timed("MsgPack", lambda c: b"".join(enc.encode(msgspec.structs.astuple(e))[header:] for e in c),
          lambda b: store.client.raw_insert(table, column_names=names, insert_block=b, fmt="MsgPack"))

    def ipc(c: list[Event]) -> bytes:
        tab = to_arrow(c)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, tab.schema) as writer:
            writer.write_table(tab)
        return sink.getvalue().to_pybytes()

    timed("ArrowStream (to_arrow + IPC)", ipc,
          lambda b: store.client.raw_insert(table, insert_block=b, fmt="ArrowStream"))
    nullable = pa.schema([f.with_nullable(True) for f in arrow_schema()])  # omitted defaults read as nulls
    t = time.process_time()
    for block in json_lines:
        pj.read_json(pa.BufferReader(block), read_options=pj.ReadOptions(use_threads=False),
                     parse_options=pj.ParseOptions(explicit_schema=nullable))
    out["build Arrow from JSON lines (pyarrow's reader)"] = (time.process_time() - t) / len(events) * 1e6

    spins: list[int] = []
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1
        spins.append(n)

    for during_insert in (False, True):
        th = threading.Thread(target=spin)
        th.start()
        t = time.perf_counter()
        if during_insert:  # on one ClickHouse thread, so that the other core is the spinner's
            for block in json_lines:
                store.client.raw_insert(table, insert_block=block, fmt="JSONEachRow",
                                        settings={"max_threads": 1, "input_format_parallel_parsing": 0})
        else:
            time.sleep(1.0)
        elapsed = time.perf_counter() - t
        stop.set()
        th.join()
        stop.clear()
        spins[-1] /= elapsed
    out["python thread speed during an insert, % of alone"] = spins[1] / spins[0] * 100
    store.command(f"DROP DATABASE {store.db}")
    return out


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def collector_run(bodies: list[bytes], n_events: int, clients: int, root: Path,
                  content_type: str = CONTENT_TYPE, encoding: str = "gzip", live: bool = False,
                  lookups: int = 0) -> dict[str, float]:
    port = 20000 + random.randint(0, 20000)
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "KVTRACE_HOME": str(root), "KVTRACE_DSN": f"chdb://{root}/db",
           "KVTRACE_COLLECTOR_SPOOL_DIR": str(root / "spool")}
    env.pop("KVTRACE_COLLECTOR_TOKENS", None)
    proc = subprocess.Popen([sys.executable, "-m", "kvtrace.cli.main", "collector", "--port", str(port),
                             "--log-level", "warning", *(() if live else ("--no-live",))], env=env,
                            stderr=subprocess.DEVNULL)
    # One client for every poll: a new httpx client builds a TLS context (~30 ms of CPU), and
    # polling with fresh ones took most of a core from the collector while it drained.
    poll = httpx.Client(timeout=10)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if poll.get(url + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "collector did not start"
            time.sleep(0.1)
        idle_rss = rss_kib(proc.pid)
        rss: list[int] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.1):
                rss.append(rss_kib(proc.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        written: list[tuple[float, float]] = []  # (time, verdicts written), while live

        def count_verdicts() -> None:
            with httpx.Client(timeout=10) as c:
                while not stop.wait(0.1):
                    written.append((time.perf_counter(), _verdicts_written(c, url)))

        counter = threading.Thread(target=count_verdicts, daemon=True)
        if live:
            counter.start()
        latencies: list[float] = []
        lock = threading.Lock()
        todo = list(range(len(bodies)))

        def send() -> None:
            with httpx.Client(timeout=60) as c:
                while True:
                    with lock:
                        if not todo:
                            return
                        i = todo.pop(0)
                    while True:
                        t0 = time.perf_counter()
                        r = c.post(url + "/v1/batches", content=bodies[i],
                                   headers={"Content-Type": content_type, "Content-Encoding": encoding})
                        if r.status_code == 200:
                            with lock:
                                latencies.append(time.perf_counter() - t0)
                            break
                        time.sleep(float(r.headers.get("Retry-After", "0.5")))

        cpu0, own0 = cpu_s(proc.pid), time.process_time()
        start = time.perf_counter()
        threads = [threading.Thread(target=send) for _ in range(clients)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        acked = time.perf_counter() - start
        while poll.get(url + "/readyz").json()["spool_pending_bytes"]:
            time.sleep(0.05)
        stored = time.perf_counter() - start
        judged = stored
        if live:  # every lookup's verdict written: the last ones wait out the lateness window (2 s) first
            deadline = time.monotonic() + 300
            while _verdicts_written(poll, url) < lookups:
                assert time.monotonic() < deadline, "the live verdicts did not all come"
                time.sleep(0.05)
            judged = time.perf_counter() - start
        cpu, own = cpu_s(proc.pid) - cpu0, time.process_time() - own0
        stop.set()
        sampler.join()
        if live:
            counter.join()
        half = rss[: max(1, len(rss) // 4)]
        return {"events_per_s": n_events / stored, "ack_events_per_s": n_events / acked,
                "judged_events_per_s": n_events / judged,
                "judging_events_per_s": _judging_rate(written, lookups, n_events) if live else 0.0,
                "p50_ms": statistics.median(latencies) * 1e3,
                "p99_ms": statistics.quantiles(latencies, n=100)[98] * 1e3,
                "rss_idle_mib": idle_rss / 1024, "rss_peak_first_quarter_mib": max(half) / 1024,
                "rss_peak_mib": max(rss) / 1024, "cpu_us_per_event": cpu / n_events * 1e6,
                "sender_cpu_us_per_event": own / n_events * 1e6}
    finally:
        poll.close()
        proc.terminate()
        proc.wait(120)


def judge_alone(events: list[Event]) -> float:
    """Events/s of the live judge by itself (`LocalJudges`, this process, one thread) over the
    same events in the collector's chunks: what it can keep up with given a core of its own."""
    from kvtrace.analysis.evaluate import Policy
    from kvtrace.collector.judge import LocalJudges
    from kvtrace.schema.recipes import RecipeBook

    tables = [to_arrow(events[i:i + BATCH]) for i in range(0, len(events), BATCH)]
    judges = LocalJudges(RecipeBook.of(None), Policy())
    judges.open("bench")
    t = time.process_time()
    for table in tables:
        judges.feed("bench", table)
    judges.finish("bench")
    return len(events) / (time.process_time() - t)


def _judging_rate(written: list[tuple[float, float]], lookups: int, n_events: int) -> float:
    """Events judged per second while the stream flowed: the verdicts' slope from 10 % to 60 % of
    the lookups, as events (the stream's events per lookup). Why not only the time to the last
    verdict: the newest `lateness` (2 s of event time) waits for its instance to go quiet for
    2 s of wall time, a fixed delay, not a rate; on a stream that takes seconds to send it
    dominates the end-to-end figure, which is printed too."""
    def crossed(share: float) -> float:
        return next(t for t, n in written if n >= share * lookups)

    try:
        return 0.5 * n_events / (crossed(0.6) - crossed(0.1))
    except (StopIteration, ZeroDivisionError):
        return 0.0


def _verdicts_written(poll: httpx.Client, url: str) -> float:
    for line in poll.get(url + "/metrics").text.splitlines():
        if line.startswith("kvtrace_collector_verdicts_written_total "):
            return float(line.split()[1])
    return 0.0


def stage_costs(bodies: list[bytes], n_events: int, root: Path) -> dict[str, float]:
    """CPU per event of each step, run one after another in this process (no HTTP, no
    threads competing): where the collector's time goes, apart from serving requests."""
    from kvtrace.collector.intake import decompress, intake_batch
    from kvtrace.collector.service import Collector, config_from_env

    # The raw inserts' embedded store: one chDB path per process.
    collector = Collector(config_from_env({}, dsn=f"chdb://{root}/raw?database=stages_{int(time.time() * 1000)}",
                                          spool_dir=str(root / "stages-spool")))
    collector.store.init()
    grant = collector.authenticate(None)
    assert grant is not None
    costs = dict.fromkeys(("decompress", "decode + validate", "spool (JSON lines, frame, write, fsync)",
                           "free the decoded rows", "drain: read + ClickHouse insert (all threads)"), 0.0)
    names = list(costs)
    for body in bodies:
        t0 = time.thread_time()
        payload = decompress(body, "gzip", 1 << 30)
        t1 = time.thread_time()
        intake = intake_batch(payload, CONTENT_TYPE, grant)
        t2 = time.thread_time()
        collector._spool(intake, grant, time.perf_counter())
        t3 = time.thread_time()
        del intake
        t4 = time.thread_time()
        for name, dt in zip(names, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=False):
            costs[name] += dt
    while (chunk := collector.spool.read(max_bytes=collector.drain.chunk_bytes)) is not None:
        c0 = time.process_time()  # ClickHouse parses on its own threads: count them all
        collector.drain._store(chunk)
        costs[names[4]] += time.process_time() - c0
        collector.spool.done(chunk)
    assert collector.store.count_events() == n_events
    collector.store.command(f"DROP DATABASE {collector.store.db}")
    return {name: v / n_events * 1e6 for name, v in costs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--stages", action="store_true", help="also time each step alone, in this process")
    ap.add_argument("--formats", action="store_true",
                    help="only compare insert formats for the same rows (CPU per row), then exit")
    ap.add_argument("--live", action="store_true",
                    help="also with live verdicts (the collector's default): each round runs the collector "
                         "without and with them, on the same events")
    ap.add_argument("--wire", default="rows,columns",
                    help="wire formats the senders use, each measured in every round: rows (msgpack), columns (Arrow)")
    args = ap.parse_args()
    wires = [w.strip() for w in args.wire.split(",") if w.strip()]
    if not wires or any(w not in WIRES for w in wires):
        ap.error(f"--wire {args.wire!r}: expected a comma-separated subset of {', '.join(WIRES)}")
    t = time.perf_counter()
    events = workload(args.events)
    lookups = sum(e.kind is EventKind.LOOKUP for e in events)
    print(f"bench_collector: {len(events):,} events in batches of {BATCH}, built in {time.perf_counter() - t:.1f} s; "
          f"{platform.python_version()}, {os.cpu_count()} CPUs")
    bodies: dict[str, list[bytes]] = {}
    for wire in wires:
        t = time.process_time()
        encode, _, compress, encoding = WIRES[wire]
        bodies[wire] = [compress(encode(events[i:i + BATCH], i // BATCH + 1)) for i in range(0, len(events), BATCH)]
        print(f"  {wire:<8} sender's CPU to encode + {encoding}: "
              f"{(time.process_time() - t) / len(events) * 1e6:.2f} us/event, "
              f"{sum(map(len, bodies[wire])) / len(events):.0f} B/event on the wire")
    if args.formats:
        with tempfile.TemporaryDirectory(prefix="kvt-bench-formats-") as tmp:
            for name, value in insert_formats(events, Path(tmp)).items():
                print(f"  {name:<52} {value:8.2f}{'' if name.startswith('python') else ' us/row'}")
        return
    raws: list[dict[str, float]] = []
    modes = (False, True) if args.live else (False,)
    runs: dict[tuple[str, bool], list[dict[str, float]]] = {(w, m): [] for w in wires for m in modes}
    with tempfile.TemporaryDirectory(prefix="kvt-bench-collector-") as tmp:
        for k in range(args.rounds):
            raws.append(raw_insert(events, Path(tmp)))
            raw_best = max(raws[-1].values())
            print(f"round {k + 1}: raw insert arrow {raws[-1]['arrow']:,.0f} rows/s, arrow IPC "
                  f"{raws[-1]['arrow_ipc']:,.0f} rows/s, json {raws[-1]['json']:,.0f} rows/s")
            if args.live:
                alone = judge_alone(events)
                print(f"  the live judge alone (one thread, CPU time): {alone:,.0f} events/s, "
                      f"{1e6 / alone:.2f} us per event, ratio to the raw insert {alone / raw_best:.2f}")
            order = [(w, m) for w in wires for m in modes]
            for wire, live in order if k % 2 == 0 else order[::-1]:  # alternate which goes first
                root = Path(tmp) / f"c{k}-{wire}-{'live' if live else 'ingest'}"
                root.mkdir()
                c = collector_run(bodies[wire], len(events), args.clients, root, WIRES[wire][1], WIRES[wire][3],
                                  live, lookups)
                runs[(wire, live)].append(c)
                print(f"  {wire:<8} {'live on ' if live else 'live off'} collector {c['events_per_s']:,.0f} events/s "
                      f"stored end to end ({c['ack_events_per_s']:,.0f}/s acknowledged), ratio "
                      f"{c['events_per_s'] / raw_best:.2f} | request p50 {c['p50_ms']:.1f} ms "
                      f"p99 {c['p99_ms']:.1f} ms | "
                      f"RSS idle {c['rss_idle_mib']:.0f} MiB, peak in first quarter "
                      f"{c['rss_peak_first_quarter_mib']:.0f} MiB, peak {c['rss_peak_mib']:.0f} MiB | CPU per event: "
                      f"collector {c['cpu_us_per_event']:.1f} us, load generator {c['sender_cpu_us_per_event']:.1f} us"
                      + (f" | judging {c['judging_events_per_s']:,.0f} events/s, ratio "
                         f"{c['judging_events_per_s'] / raw_best:.2f}; every verdict written (after the 2 s "
                         f"lateness wait): {c['judged_events_per_s']:,.0f} events/s, ratio "
                         f"{c['judged_events_per_s'] / raw_best:.2f}" if live else ""))
        if args.stages and "rows" in bodies:
            stages = stage_costs(bodies["rows"], len(events), Path(tmp))
            print("rows, each step alone, CPU per event: " + ", ".join(f"{k} {v:.2f} us" for k, v in stages.items())
                  + f"; total {sum(stages.values()):.2f} us")
    for wire, live in runs:
        done = runs[(wire, live)]
        ratios = [c["events_per_s"] / max(r.values()) for r, c in zip(raws, done, strict=True)]
        same_format = [c["events_per_s"] / r["json" if wire == "rows" else "arrow_ipc"]
                       for r, c in zip(raws, done, strict=True)]
        print(f"{wire}, live verdicts {'on' if live else 'off'}: median collector / fastest raw ClickHouse insert of "
              f"the same rows: {statistics.median(ratios):.2f} (target >= {0.7 if live else 0.5}); / raw insert in the "
              f"collector's own insert format ({'JSON lines' if wire == 'rows' else 'Arrow IPC'}): "
              f"{statistics.median(same_format):.2f}"
              + (f"; judging: {statistics.median(c['judging_events_per_s'] / max(r.values()) for r, c in zip(raws, done, strict=True)):.2f}"  # noqa: E501
                 f"; every verdict written: {statistics.median(c['judged_events_per_s'] / max(r.values()) for r, c in zip(raws, done, strict=True)):.2f}"  # noqa: E501
                 if live else ""))

if __name__ == "__main__":
    main()
