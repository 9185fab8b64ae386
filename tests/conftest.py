"""Shared fixtures: one embedded ClickHouse engine per test session, a database per test.

chDB hosts one engine directory per process, so every test shares the session's engine and
isolates itself with its own database.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

_SESSION_HOME = Path(tempfile.mkdtemp(prefix="kvtrace-tests-"))
# Set before any kvtrace import reads it: the default DSN then points at the session engine.
os.environ["KVTRACE_HOME"] = str(_SESSION_HOME)
os.environ.pop("KVTRACE_DSN", None)

from kvtrace.store.client import Store  # noqa: E402


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The session's engine directory goes with the session: every run made one and left it."""
    shutil.rmtree(_SESSION_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def chdb_path() -> Path:
    return _SESSION_HOME / "chdb"


@pytest.fixture
def store_dsn(chdb_path: Path) -> str:
    return f"chdb://{chdb_path}?database=t_{uuid.uuid4().hex[:12]}"


@pytest.fixture
def store(store_dsn: str) -> Iterator[Store]:
    """A fresh, initialized kvtrace database on the session's embedded engine."""
    s = Store(store_dsn)
    s.init()
    yield s
    s.client.command(f"DROP DATABASE IF EXISTS {s.db}")
    s.close()
