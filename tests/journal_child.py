"""An engine process stand-in for the journal tests: it configures kvtrace from its environment
as an engine plugin does, emits, prints its emitter's source id, then ends as told.

    python tests/journal_child.py EVENTS [--end exit|kill|term|hang] [--no-shipper] [--stalled-sink]
                                         [--threads N] [--forever]

`--end exit` returns normally (atexit shuts the emitter down); `kill` / `term` send this process
SIGKILL / SIGTERM right after the last emit() returned, with nothing flushed; `hang` waits to be
killed. `--no-shipper` makes the journal without its shipper process (the next start ships it);
`--stalled-sink` gives the emitter a sink that never returns, so the journal fills, while the
shipper still builds the real sink from the environment. `--forever` emits large events until
killed (the kill then lands in the middle of writes).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from kvtrace.instrumentation.api import set_emitter
from kvtrace.instrumentation.config import EmitterSettings, build_sink, configure, start_shipper
from kvtrace.instrumentation.emitter import BatchEmitter, JournalConfig
from kvtrace.schema.events import Event
from kvtrace.schema.kinds import ComponentKind, EventKind, Tier


class StalledSink:
    takes_encoded = True

    def export(self, batch: object) -> object:
        threading.Event().wait()  # never
        raise AssertionError

    def shutdown(self) -> None:
        pass


def event(key: int, keys: int = 0) -> Event:
    return Event(kind=EventKind.COMMIT, component=ComponentKind.FULL_ATTENTION, block_key=key, tier=Tier.DEVICE,
                 instance="child", engine="test", more_keys=list(range(1, keys + 1)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("events", type=int)
    ap.add_argument("--end", choices=["exit", "kill", "term", "hang"], default="kill")
    ap.add_argument("--no-shipper", action="store_true")
    ap.add_argument("--stalled-sink", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--forever", action="store_true")
    args = ap.parse_args()

    settings = EmitterSettings.from_env()
    if args.no_shipper or args.stalled_sink:
        journal = settings.journal_config()
        assert journal is not None
        shipper = None if args.no_shipper else lambda path: start_shipper(path, settings.environment())
        journal = JournalConfig(journal.directory, journal.size_bytes, shipper=shipper)
        sink = StalledSink() if args.stalled_sink else build_sink(settings)
        em = BatchEmitter(sink, settings.batch, instance=settings.instance, engine="test", journal=journal)
        set_emitter(em)
    else:
        em = configure(settings, engine="test")
    print(em.source_id, flush=True)

    if args.forever:
        key = 0
        while True:
            key += 1
            em.emit(event(key, keys=key % 200))

    def work(first: int) -> None:
        for i in range(first, args.events, args.threads):
            em.emit(event(i + 1))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("emitted", flush=True)
    if args.end == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif args.end == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    elif args.end == "hang":
        time.sleep(3600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
