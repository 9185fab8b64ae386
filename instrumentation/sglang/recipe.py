"""The analysis recipe of an SGLang radix cache, read off the cache itself, and its components
as kvtrace's (which the shim and the capture name groups by).

One recipe group per tree component, in the cache's own order (`tree_components`), so group
ids in events and recipe agree. Every component shares full attention's page grid: a sliding
window group keeps the window the cache was built with, and a Mamba group holds one state per
page boundary it checkpointed. The older trees have one group: `RadixCache` full attention,
`PureSWARadixCache` a sliding window.
"""

from __future__ import annotations

from typing import Any

from kvtrace.schema.kinds import ComponentKind
from kvtrace.schema.recipes import GroupSpec, Recipe

COMPONENT_OF = {"FULL": ComponentKind.FULL_ATTENTION, "SWA": ComponentKind.SLIDING_WINDOW,
                "MAMBA": ComponentKind.MAMBA}
"""SGLang's component types (by name) as kvtrace components."""


def component_name(component_type: Any) -> str:
    """SGLang's name of a component type (FULL, SWA, MAMBA); a name given as text is itself."""
    return getattr(component_type, "name", str(component_type))


def component_of(component_type: Any) -> ComponentKind:
    return COMPONENT_OF.get(component_name(component_type), ComponentKind.OTHER)


def component_types(cache: Any) -> list[Any]:
    """The cache's components in its own order. SGLang's older single-component trees have no
    `tree_components`: `PureSWARadixCache` (all-SWA models) holds window state, `RadixCache`
    full attention."""
    types = list(getattr(cache, "tree_components", ()) or ())
    if types:
        return types
    name = "SWA" if any(c.__name__ == "PureSWARadixCache" for c in type(cache).__mro__) else "FULL"
    try:
        from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

        return [ComponentType[name]]
    except (ImportError, KeyError):
        return [name]


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
