"""The analysis recipe of an SGLang radix cache, read off the cache itself.

One recipe group per tree component, in the cache's own order (`tree_components`), so group
ids in events and recipe agree. Every component shares full attention's page grid: a sliding
window group keeps the window the cache was built with, and a Mamba group holds one state per
page boundary it checkpointed. The older trees have one group: `RadixCache` full attention,
`PureSWARadixCache` a sliding window.
"""

from __future__ import annotations

from typing import Any

from kvtrace.instrumentation.sglang.shim import component_of, component_types
from kvtrace.schema.kinds import ComponentKind
from kvtrace.schema.recipes import GroupSpec, Recipe


def recipe_from_cache(cache: Any, name: str = "sglang") -> Recipe:
    page = int(cache.page_size)
    window = int(getattr(cache, "sliding_window_size", 0) or 0)
    groups = []
    for i, ct in enumerate(component_types(cache)):
        component = component_of(ct)
        groups.append(GroupSpec(group_id=i, component=component, block_size=page,
                                window=window if component is ComponentKind.SLIDING_WINDOW else 0))
    kinds = ", ".join(f"{g.component.value}/{g.block_size}" for g in groups)
    return Recipe(name=name, groups=tuple(groups), description=f"derived from SGLang's radix cache: {kinds}")
