"""What every event of one engine process carries, whichever shim or bridge builds it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Identity:
    """What every event of this engine carries; per-request parts (LoRA, salt) are added."""

    instance: str = ""
    model: str = ""
    model_revision: str = ""
    kv_dtype: str = ""
    default_tenant: str = ""
