"""Where the store is: one DSN names an embedded chDB engine or a ClickHouse server.

Parsed without touching ClickHouse, so a command can name (or refuse) a store before the
driver is imported, and the password never reaches a log line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

from kvtrace.schema.clickhouse import DEFAULT_DATABASE
from kvtrace.schema.paths import data_dir


class StoreError(RuntimeError):
    """The store cannot do what was asked; the message says why and what to do."""


def default_dsn() -> str:
    """$KVTRACE_DSN, else an embedded store under the data directory."""
    return os.environ.get("KVTRACE_DSN") or f"chdb://{data_dir() / 'chdb'}"


@dataclass(frozen=True, slots=True)
class Dsn:
    """A parsed store address. The password never appears in `str()`."""

    scheme: str
    path: str = ""  # chdb: engine directory, or ":memory:"
    host: str = ""
    port: int = 0
    username: str = "default"
    password: str = field(default="", repr=False)
    database: str = DEFAULT_DATABASE

    @property
    def embedded(self) -> bool:
        return self.scheme == "chdb"

    def __str__(self) -> str:
        if self.embedded:
            return f"chdb://{self.path}?database={self.database}"
        return f"{self.scheme}://{self.username}@{self.host}:{self.port}/{self.database}"


def parse_dsn(dsn: str) -> Dsn:
    """`chdb:///abs/path[?database=db]`, `chdb://memory` or `http(s)://user:pass@host:port/db`."""
    parts = urlsplit(dsn)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    if parts.scheme == "chdb":
        if parts.netloc in ("memory", ":memory:"):
            path = ":memory:"
        elif parts.netloc:
            raise StoreError(f"chdb DSN {dsn!r} needs an absolute path: chdb:///abs/path or chdb://memory")
        else:
            path = unquote(parts.path)
            if not path.startswith("/"):
                raise StoreError(f"chdb DSN {dsn!r} needs an absolute path")
        out = Dsn("chdb", path=path, database=query.get("database", DEFAULT_DATABASE))
    elif parts.scheme in ("http", "https"):
        if not parts.hostname:
            raise StoreError(f"DSN {dsn!r} has no host")
        database = parts.path.strip("/") or query.get("database", DEFAULT_DATABASE)
        out = Dsn(
            parts.scheme,
            host=parts.hostname,
            port=parts.port or (8443 if parts.scheme == "https" else 8123),
            username=unquote(parts.username or "default"),
            password=unquote(parts.password or ""),
            database=database,
        )
    else:
        raise StoreError(f"DSN {dsn!r}: scheme must be chdb, http or https")
    if not out.database.isidentifier():
        raise StoreError(f"DSN {dsn!r}: database name {out.database!r} must be a plain identifier")
    return out
