"""Bearer tokens and the tenant namespaces they may write and read.

A token grants a set of tenants, or every tenant (an operator token, `*`). Tokens come from a
file (one `token tenant[,tenant...]` per line, `#` comments) or from `KVTRACE_COLLECTOR_TOKENS`
(`token=tenant[,tenant];token=...`). Only SHA-256 digests are kept in memory, a presented token
is compared against every digest in constant time, and no token is ever logged or echoed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

ANY_TENANT = "*"
ENV_TOKENS = "KVTRACE_COLLECTOR_TOKENS"
ENV_TOKENS_FILE = "KVTRACE_COLLECTOR_TOKENS_FILE"


class AuthConfigError(ValueError):
    """A token file or variable that cannot be read; the message names the line, never the token."""


@dataclass(frozen=True, slots=True)
class Grant:
    """What one token may touch. `tenants` is empty for an operator token (all tenants)."""

    name: str  # a label for logs and metrics: the first tenant, or "operator"
    tenants: frozenset[str]
    operator: bool = False

    def allows(self, tenant: str) -> bool:
        return self.operator or tenant in self.tenants

    @property
    def home(self) -> str:
        """The namespace an event without a tenant is written into: the token's tenant when it
        has one. An operator's token, or an engine's token of several tenants, leaves such an
        event without one: it is then the engine's own fact (its attach and the restart it
        implies, an eviction, a usage sample), which the analysis of each of its tenants needs,
        not a fact of the first tenant alone."""
        return next(iter(self.tenants)) if len(self.tenants) == 1 and not self.operator else ""


OPEN = Grant(name="open", tenants=frozenset(), operator=True)
"""The grant every request gets when no tokens are configured (local use, tests, the demo)."""


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _grant(tenants: Iterable[str], where: str) -> Grant:
    names = [t.strip() for t in tenants if t.strip()]
    if not names:
        raise AuthConfigError(f"{where}: a token needs at least one tenant (or {ANY_TENANT} for all)")
    if ANY_TENANT in names:
        return Grant(name="operator", tenants=frozenset(), operator=True)
    return Grant(name=min(names), tenants=frozenset(names))


class TokenTable:
    """Token digests -> grants. Empty means authentication is off (every request is OPEN)."""

    def __init__(self, grants: Mapping[str, Grant] | None = None) -> None:
        self._entries = [(_digest(token), grant) for token, grant in (grants or {}).items()]

    @property
    def enabled(self) -> bool:
        return bool(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def check(self, token: str) -> Grant | None:
        """The grant for a token, or None. Every entry is compared, so timing says nothing."""
        presented = _digest(token)
        found: Grant | None = None
        for digest, grant in self._entries:
            if hmac.compare_digest(presented, digest):
                found = grant
        return found

    def from_header(self, authorization: str | None) -> Grant | None:
        """The grant for an `Authorization: Bearer <token>` header (OPEN when auth is off)."""
        if not self.enabled:
            return OPEN
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return self.check(token.strip())

    @classmethod
    def parse_file(cls, path: str | os.PathLike[str]) -> TokenTable:
        grants: dict[str, Grant] = {}
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as exc:
            raise AuthConfigError(f"cannot read token file {path}: {exc.strerror}") from None
        for number, line in enumerate(lines, start=1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            token, _, tenants = line.partition(" ")
            where = f"{path}:{number}"
            if token in grants:
                raise AuthConfigError(f"{where}: the same token is listed twice")
            grants[token] = _grant(tenants.replace(" ", "").split(","), where)
        return cls(grants)

    @classmethod
    def parse_env(cls, value: str) -> TokenTable:
        grants: dict[str, Grant] = {}
        for number, item in enumerate(filter(None, (i.strip() for i in value.split(";"))), start=1):
            token, sep, tenants = item.partition("=")
            where = f"{ENV_TOKENS} entry {number}"
            if not sep or not token.strip():
                raise AuthConfigError(f"{where}: expected token=tenant[,tenant]")
            if token.strip() in grants:
                raise AuthConfigError(f"{where}: the same token is listed twice")
            grants[token.strip()] = _grant(tenants.split(","), where)
        return cls(grants)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, path: str | None = None) -> TokenTable:
        """From an explicit file, else the file or inline variable; both may be combined."""
        env = os.environ if env is None else env
        table = cls()
        path = path or env.get(ENV_TOKENS_FILE, "")
        if path:
            table._entries += cls.parse_file(path)._entries
        if env.get(ENV_TOKENS, ""):
            table._entries += cls.parse_env(env[ENV_TOKENS])._entries
        return table
