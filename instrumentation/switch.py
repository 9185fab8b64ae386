"""Whether tracing was asked for, read before anything else of kvtrace is imported.

Engines load kvtrace's plugins in every process whether tracing is on or not; with it off, a
plugin reads one environment variable and returns, so an engine that merely has kvtrace
installed pays neither the import of the emitter and its settings nor their memory. Any other
value of KVTRACE_ENABLED, a wrong one included, goes on to the full settings, which name a
wrong value loudly.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

OFF = frozenset({"", "0", "false", "no", "off"})


def tracing_requested(env: Mapping[str, str] | None = None) -> bool:
    value = (os.environ if env is None else env).get("KVTRACE_ENABLED", "")
    return value.strip().lower() not in OFF
