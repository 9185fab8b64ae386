"""Whose counters an emitter's stats may be: the tenants its events were written for.

An emitter's stats (its emitted and dropped counts, how it ended) are facts about the stream its
source id names. Were any token free to post stats under any source id, tenant A could post a
dropped count of 10^15 for tenant B's engine, which `kvtrace db status` would report as fleet
loss. So stats are accepted from a token only for a source whose events it writes (in the same
request, or before, as this process saw them or the stats rows in the store say), or for a
source no one has written events for yet (an idle emitter's first report); each stats row keeps
the writer it came from (`EmitterStats.writer`), so a view scoped to a tenant shows only its
own. An operator's token may report for any source.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from kvtrace.collector.auth import Grant
from kvtrace.schema.clickhouse import EMITTER_STATS
from kvtrace.store.client import Store

_TENANTS_KEPT = 64  # tenants remembered per source: enough to recognise an engine's own tokens


def writer_of(grant: Grant) -> str:
    """The name stats rows carry for a grant: its tenants, sorted and joined ('' for an operator)."""
    return "" if grant.operator else ",".join(sorted(grant.tenants))


class SourceWriters:
    """source id -> tenants whose events or stats were written under it."""

    def __init__(self, store: Store, capacity: int = 1 << 18) -> None:
        self.store = store
        self.capacity = capacity
        self._tenants: dict[int, set[str]] = {}
        self._lock = threading.Lock()

    def wrote(self, pairs: Iterable[tuple[int, str]]) -> None:
        """Events were accepted: (source id, tenant) of each ('' tenants, an engine's own rows, say nothing)."""
        with self._lock:
            for source, tenant in pairs:
                if not tenant:
                    continue
                known = self._tenants.get(source)
                if known is None:
                    if len(self._tenants) >= self.capacity:
                        self._tenants.clear()  # read again from the store as sources come back
                    known = self._tenants[source] = set()
                if len(known) < _TENANTS_KEPT:
                    known.add(tenant)

    def may_report(self, source: int, grant: Grant) -> bool:
        """Whether `grant` may post stats for `source` (see the module's rule)."""
        if grant.operator:
            return True
        with self._lock:
            known = set(self._tenants.get(source, ()))
        if not known:
            known = self._stored_tenants(source)
            if known:
                self.wrote((source, t) for t in known)
        return not known or bool(known & grant.tenants)

    def _stored_tenants(self, source: int) -> set[str]:
        """The tenants of the writers of a source's stored stats rows."""
        try:
            rows = self.store.query_arrow(
                f"SELECT DISTINCT writer FROM {self.store.db}.{EMITTER_STATS.name} "
                "WHERE source_id = {s:UInt64} AND writer != '' LIMIT 64", {"s": source}).to_pylist()
        except Exception:  # noqa: BLE001 - the store may be down; the spool still takes batches
            return set()
        return {t for r in rows for t in r["writer"].split(",") if t}
