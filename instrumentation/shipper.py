"""The process that ships an emitter's journal when the emitter's process dies before it can.

An engine process's emitter starts one per journal (`kvtrace.instrumentation.config.start_shipper`),
detached: the first process only
forks the shipper and exits, so the shipper is nobody's child in the engine's process tree (a
process-tree kill such as vLLM's, which walks children, does not find it) and is in a session of
its own (a terminal's Ctrl-C does not reach it). It waits on the journal's lock, which the
emitter holds for its life and the kernel drops when the emitter's process ends, however it
ends. Then:

- the journal is gone (the emitter shut down cleanly and removed it): the shipper exits;
- otherwise it owns what is left: it ships the records under the dead emitter's own source id
  and batch numbering, then that emitter's final stats (ended unclean, unless it had shut down
  cleanly with records it could not deliver), and removes the journal. What it cannot deliver
  in time stays for the next emitter that starts with the same journal directory.

It builds its sink from kvtrace's settings in its environment, the engine's environment plus
the engine emitter's own sink settings (`kvtrace.instrumentation.config`).

    python -m kvtrace.instrumentation.shipper JOURNAL [--no-detach]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

SHIP_TIMEOUT_MILLIS = 300_000  # how long a shipper keeps trying to deliver before leaving the rest


def _wait_for_the_lock(path: Path) -> bool:
    """Block until the journal's emitter lets go of it (its process ends, or it shut down); False
    when there is no journal. Waits with nothing of kvtrace imported: a shipper waits for its
    engine's whole life, so it waits small (its lock is let go again here, and claimed after)."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    finally:
        os.close(fd)
    return True


def ship(path: Path, wait: bool = True) -> int:
    """Claim the journal at `path` (waiting for its emitter's process to end when `wait`) and
    ship what is left in it; 0 when there was nothing to ship or all of it was delivered."""
    import logging

    if wait and not _wait_for_the_lock(path):
        return 0
    from kvtrace.instrumentation.journal import Journal, JournalError

    log = logging.getLogger("kvtrace.shipper")
    try:
        journal = Journal.claim(path, wait=wait)
    except (OSError, JournalError) as exc:
        log.error("kvtrace shipper: cannot read %s: %s", path, exc)
        return 1
    if journal is None:
        return 0
    from kvtrace.instrumentation.config import ConfigError, EmitterSettings, build_sink
    from kvtrace.instrumentation.emitter import BatchEmitter

    try:
        settings = EmitterSettings.from_env()
        sink = build_sink(settings)
    except (ConfigError, OSError, ValueError) as exc:
        log.error("kvtrace shipper: no sink for %s (%s); it waits for the next start", path, exc)
        journal.close(journal.state)
        return 1
    config = dataclasses.replace(settings.batch, shutdown_timeout_millis=SHIP_TIMEOUT_MILLIS)
    try:
        emitter = BatchEmitter(sink, config, register_atexit=False, adopt=journal)
        done = emitter.shutdown()
    finally:
        sink.shutdown()
    if not done:
        log.warning("kvtrace shipper: could not deliver all of %s; it waits for the next start", path)
    return 0 if done else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvtrace.instrumentation.shipper", description=__doc__.split("\n\n")[0])
    ap.add_argument("journal", type=Path)
    ap.add_argument("--no-detach", action="store_true", help="ship from this process, without forking first")
    ap.add_argument("--no-wait", action="store_true", help="give up at once if the journal's emitter still runs")
    args = ap.parse_args(argv)
    if not args.no_detach and os.fork() > 0:
        os._exit(0)  # the first process: its parent waits for it and no further
    return ship(args.journal, wait=not args.no_wait)


if __name__ == "__main__":
    sys.exit(main())
