"""The analysis recipe of a vLLM engine, read off its own KV-cache config.

One recipe group per vLLM KV-cache group, in vLLM's order, so group ids in events and recipe
agree. vLLM may make several groups with the same spec (one per layer pattern); each caches its
own blocks under its own keys, so each is a group here too.
"""

from __future__ import annotations

from typing import Any

from kvtrace.schema.kinds import ComponentKind
from kvtrace.schema.recipes import GroupSpec, Recipe


def component_of(spec: Any) -> ComponentKind:
    """The kind of state a vLLM KV-cache spec holds, by its class (and a window it names)."""
    name = type(spec).__name__
    if "Mamba" in name:
        return ComponentKind.MAMBA
    if "SlidingWindow" in name or getattr(spec, "sliding_window", None):
        return ComponentKind.SLIDING_WINDOW
    if "CrossAttention" in name:
        return ComponentKind.CROSS_ATTENTION
    if "ChunkedLocal" in name:
        return ComponentKind.OTHER
    return ComponentKind.FULL_ATTENTION


def recipe_from_kv_cache_config(config: Any, name: str = "vllm") -> Recipe:
    groups = []
    for i, group in enumerate(config.kv_cache_groups):
        spec = group.kv_cache_spec
        component = component_of(spec)
        window = int(getattr(spec, "sliding_window", 0) or 0) if component is ComponentKind.SLIDING_WINDOW else 0
        groups.append(GroupSpec(group_id=i, component=component, block_size=int(spec.block_size), window=window))
    kinds = ", ".join(f"{g.component.value}/{g.block_size}" for g in groups)
    return Recipe(name=name, groups=tuple(groups), description=f"derived from vLLM's KV-cache config: {kinds}")
