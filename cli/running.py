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

    uvicorn stops on SIGTERM or SIGINT, then raises the signal again (and `uvicorn.run` swallows
    the KeyboardInterrupt a SIGINT makes). Handlers here take that second signal, and one that
    comes before uvicorn serves: a SIGTERM exits 0, a SIGINT 130 (KeyboardInterrupt), even where
    the process started with SIGINT ignored (a background job)."""
    from kvtrace.store.owner import owning

    if store.dsn.embedded:
        store.client  # noqa: B018 - raises StoreError naming the holder
    received: list[int] = []

    def stop(signum: int, _frame: object) -> None:
        received.append(signum)
        raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    with owning(store.dsn, command, url):
        yield
    if signal.SIGINT in received:
        raise KeyboardInterrupt
