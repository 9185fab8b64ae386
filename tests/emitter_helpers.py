"""What the emitter tests share: the process-wide emitter put back after each test, and a poll."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from kvtrace.instrumentation.api import set_emitter


@pytest.fixture(autouse=True)
def _restore_global_emitter() -> Iterator[None]:
    """Import it into a test module to make it autouse there: a test that configures the
    process-wide emitter leaves the next test the one it found, and shuts its own down."""
    previous = set_emitter(None)
    yield
    current = set_emitter(previous)
    if current is not previous:
        current.shutdown()


def wait_until(predicate: Callable[[], object], timeout_s: float = 10.0, poll_s: float = 0.005) -> bool:
    """Poll `predicate` until it holds or `timeout_s` passes; its last answer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll_s)
    return bool(predicate())
