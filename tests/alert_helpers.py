"""Helpers for the alert tests: a local webhook receiver, the reference simulator writing into a
store with a fault on demand, and the same as a process (chDB is one engine per process, so a
store that a `kvtrace alerts` subprocess reads is filled from another process):

    python tests/alert_helpers.py DSN faulty|healthy

`faulty` serves four clean requests and one whose Mamba checkpoint at the hit boundary is gone
(trace seconds 0-3 and 10); `healthy` serves clean requests at trace seconds 200-203 on a second
instance of the same model, so the faulty lookup has left a 60 s window.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvtrace.instrumentation.emitter import BatchConfig, BatchEmitter
from kvtrace.instrumentation.simulator import AdoptPolicy, CacheSimulator, Fault, SimConfig, SimRequest
from kvtrace.instrumentation.sinks.store import StoreSink
from kvtrace.schema.recipes import BUILTIN
from kvtrace.store.client import Store

PREFIX = list(range(1, 1025))
S = 10**9
START_NS = SimConfig(recipe=BUILTIN["mamba-hybrid"]).start_ns  # trace second 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Receiver:
    """A local Alertmanager-webhook receiver (or Alertmanager alerts endpoint) that keeps what it
    takes; set `status` to make it refuse (what it refuses is not kept)."""

    def __init__(self) -> None:
        received: list[Any] = []
        self.received = received
        self.status = 200
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if receiver.status == 200:
                    received.append(body)
                self.send_response(receiver.status)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def alerts(self) -> list[tuple[str, str]]:
        return [(a["status"], a["labels"]["alertname"]) for body in self.received for a in body["alerts"]]


class Engine:
    """The reference simulator writing into the store, with a clock the test moves."""

    def __init__(self, store: Store, adopt: AdoptPolicy = AdoptPolicy.COMPLETE, model: str = "jamba",
                 instance: str = "sim-0", prefix: list[int] | None = None) -> None:
        self.emitter = BatchEmitter(StoreSink(store), BatchConfig(schedule_delay_millis=10), register_atexit=False)
        self.sim = CacheSimulator(SimConfig(recipe=BUILTIN["mamba-hybrid"], model=model, instance=instance,
                                            adopt=adopt), self.emitter)
        self.prefix = prefix or PREFIX
        self.n = 0

    def serve(self, at_s: float, fault: bool = False) -> None:
        self.n += 1
        arrival = self.sim.config.start_ns + int(at_s * S)
        request = SimRequest(f"{self.sim.config.instance}-r{self.n}", [*self.prefix, self.n, self.n],
                             arrival_ns=arrival)
        if fault:
            self.sim.inject(Fault.SKIP_CHECKPOINT, request, 1024)
        self.sim.serve(request)
        assert self.emitter.force_flush(10_000)


def main(dsn: str, phase: str) -> None:
    store = Store(dsn)
    store.init()
    if phase == "faulty":
        engine = Engine(store)
        for t in range(4):
            engine.serve(t)
        engine.serve(10, fault=True)
    else:
        engine = Engine(store, instance="sim-1", prefix=[p + 5000 for p in PREFIX])
        for t in range(200, 204):
            engine.serve(t)
    engine.emitter.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
