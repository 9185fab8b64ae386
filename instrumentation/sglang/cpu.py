"""Running SGLang's cache classes on a CPU-only torch, for trace replay and tests.

SGLang's cache code (radix trees, token pools, HiCache's host and storage tiers) is plain torch
and runs on CPU, but a few things around it assume an accelerator. These stand-ins make the
replay path work without one; none of them is needed, or installed, inside a real engine:

- `torchvision`: SGLang's config package imports it for vision models at import time, and
  PyPI's build is a CUDA build that fails to import on a CPU-only torch. A permissive module
  stands in (text models never call it). Installed only when no torchvision is importable.
- HiCache's host tier registers its buffers with CUDA and pins them; on CPU both are skipped.
- HiCache's "direct" copy paths call kernels bound only on accelerators; torch indexing copies
  with the same meaning stand in, for the layer-first layout and for the page-first-direct one
  (the only layout Mamba's host pool takes).
"""

from __future__ import annotations

import enum
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

_VISION_MODULES = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional",
                   "torchvision.transforms.v2", "torchvision.transforms.v2.functional", "torchvision.io",
                   "torchvision.ops")


class InterpolationMode(enum.Enum):
    """The one torchvision name transformers inspects at import time."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _placeholder(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__path__ = []
    module.__version__ = "0.0+kvtrace-cpu-stand-in"

    def __getattr__(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return type(attr, (), {"__init__": lambda self, *a, **k: None, "__call__": lambda self, *a, **k: None})

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    return module


def install_vision_stand_in() -> None:
    """Before the first `import sglang`: a torchvision that imports, when none does."""
    if "torchvision" in sys.modules:
        return
    try:
        if importlib.util.find_spec("torchvision") is not None:
            import torchvision  # noqa: F401

            return
    except Exception:  # noqa: BLE001 - a broken CUDA build: replace it
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
    for name in _VISION_MODULES:
        sys.modules[name] = _placeholder(name)
    for name in ("torchvision.transforms", "torchvision.transforms.functional"):
        sys.modules[name].InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
    for name in _VISION_MODULES[1:]:
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent], child, sys.modules[name])


_hicache_patched = False


def _importable(*names: str) -> list[types.ModuleType]:
    """SGLang's host pool modules of these names that import here (each pulls its own kernels)."""
    out = []
    for name in names:
        try:
            out.append(importlib.import_module(f"sglang.srt.mem_cache.pool_host.{name}"))
        except Exception:  # noqa: BLE001 - a pool this build or platform lacks: nothing to stand in for
            continue
    return out


def patch_hicache_for_cpu() -> None:
    """Let HiCache's host tier (and storage behind it) run on CPU; idempotent."""
    global _hicache_patched
    if _hicache_patched:
        return
    import torch
    from sglang.srt.mem_cache.pool_host import base as host_base
    from sglang.srt.mem_cache.pool_host import common as host_common
    from sglang.srt.mem_cache.pool_host import mamba as host_mamba
    from sglang.srt.mem_cache.pool_host import mha as host_mha

    host_common._cuda_host_register = lambda *args, **kwargs: None

    def transfer_kv_direct(src_layers: Any, dst_layers: Any, src_indices: Any, dst_indices: Any,
                           page_size: int) -> None:
        src_indices = src_indices.to(torch.long)
        dst_indices = dst_indices.to(torch.long)
        for src, dst in zip(src_layers, dst_layers, strict=True):
            dst[dst_indices] = src[src_indices].to(dst.device)

    def page_starts(indices: Any, page_size: int) -> Any:
        return indices.to(torch.long).reshape(-1, page_size)[:, 0]

    def page_tokens(indices: Any, page_size: int) -> Any:
        """Every slot of the pages whose first slots `indices` give, page by page."""
        return (page_starts(indices, page_size)[:, None] + torch.arange(page_size)).reshape(-1)

    def lf_to_pf(src_ptrs: Any, dst_ptrs: Any, src_indices: Any, dst_indices: Any, page_size: int) -> None:
        """Layer-first device slots to page-first host pages, every layer: `src_ptrs` holds one
        tensor per layer (K layers then V layers, or one latent/state layer set), `dst_ptrs` one
        (pages, layers, page, ...) buffer per set."""
        tokens = page_tokens(src_indices, page_size)
        pages = page_starts(dst_indices, page_size) // page_size
        layers = len(src_ptrs) // len(dst_ptrs)
        for part, dst in enumerate(dst_ptrs):
            for layer in range(layers):
                moved = src_ptrs[part * layers + layer][tokens].to(dst.device)
                dst[pages, layer] = moved.view(len(pages), page_size, *moved.shape[1:])

    def pf_to_lf(src_ptrs: Any, dst_ptrs: Any, src_indices: Any, dst_indices: Any, layer_id: int,
                 page_size: int) -> None:
        """Page-first host pages to layer-first device slots, one layer (or `len(dst_ptrs) /
        len(src_ptrs)` consecutive ones from `layer_id`)."""
        pages = page_starts(src_indices, page_size) // page_size
        tokens = page_tokens(dst_indices, page_size)
        layers = len(dst_ptrs) // len(src_ptrs)
        for part, src in enumerate(src_ptrs):
            for layer in range(layers):
                dst = dst_ptrs[part * layers + layer]
                dst[tokens] = src[pages, layer_id + layer].reshape(len(tokens), *dst.shape[1:]).to(dst.device)

    for module in (host_mha, host_mamba, *_importable("mla", "dsa")):  # every pool with a direct path
        module.transfer_kv_direct = transfer_kv_direct
        module.transfer_kv_all_layer_direct_lf_pf = lf_to_pf
        module.transfer_kv_per_layer_direct_pf_lf = pf_to_lf
    allocate = host_base.HostKVCache._allocate_host_buffer

    def allocate_unpinned(self: Any) -> Any:
        self.pin_memory = False
        return allocate(self)

    host_base.HostKVCache._allocate_host_buffer = allocate_unpinned
    mamba_init = host_mamba.MambaPoolHost.__init__

    def mamba_unpinned(self: Any, *args: Any, **kwargs: Any) -> None:  # its own buffers, not the base's
        mamba_init(self, *args, **{**kwargs, "pin_memory": False})

    host_mamba.MambaPoolHost.__init__ = mamba_unpinned
    _hicache_patched = True
