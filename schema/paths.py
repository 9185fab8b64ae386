"""Where kvtrace keeps its files on this machine when nothing else is said.

The engine side (the spool sink's default directory) and the store side (the embedded
ClickHouse, the collector's spool) must agree on these without importing each other, so the
convention lives here, beside the spool's file format in `kvtrace.schema.wire`.
"""

from __future__ import annotations

import os
from pathlib import Path


def data_dir() -> Path:
    """$KVTRACE_HOME, else kvtrace's folder in the XDG data directory."""
    if home := os.environ.get("KVTRACE_HOME"):
        return Path(home).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "kvtrace"
