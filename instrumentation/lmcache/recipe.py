"""The analysis recipe of an LMCache engine: one full-attention group of its chunk size.

LMCache stores a request's KV in whole chunks of `chunk_size` tokens, each keyed by the
prefix-chained hash of every token up to its end, and delivers a run of chunks from the first:
a boundary p is resumable from LMCache when every chunk before p is there, as full attention's
blocks are, whatever the model's own layers are (the serving engine in front of it publishes
those, in its own block units).
"""

from __future__ import annotations

from kvtrace.schema.kinds import ComponentKind
from kvtrace.schema.recipes import GroupSpec, Recipe


def recipe_from_chunk_size(chunk_size: int, name: str = "lmcache") -> Recipe:
    return Recipe(name=name, groups=(GroupSpec(group_id=0, component=ComponentKind.FULL_ATTENTION,
                                               block_size=int(chunk_size)),),
                  description=f"derived from LMCache's chunks: full_attention/{int(chunk_size)}")
