"""What the long-running commands (`serve`, `collector`, `dashboard`) share: holding the
embedded store for the whole run, named in its owner file, and a clean exit on SIGTERM."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtrace.store.client import Store


@contextlib.contextmanager
def holding(store: Store, command: str, url: str) -> Iterator[None]:
    """Open an embedded store now, so one another process holds is a one-line error before
    anything starts, and name this process in its owner file until the block ends. A
    server's store is left to connect when first used (the collector spools while it is away).

    uvicorn stops on SIGTERM and then raises the signal again, which would end the process
    with -SIGTERM after a clean stop; a handler takes that second one, so the exit is 0."""
    from kvtrace.store.owner import owning

    if store.dsn.embedded:
        store.client  # noqa: B018 - raises StoreError naming the holder
    signal.signal(signal.SIGTERM, lambda *_: None)
    with owning(store.dsn, command, url):
        yield
