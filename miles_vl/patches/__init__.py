"""Import-time patches that make megatron-bridge's Qwen3-VL correct for THD-packed batches under CP.

    import miles_vl.patches
    miles_vl.patches.install()          # idempotent; raises PatchTargetMissing on an unsupported release
    miles_vl.patches.status()           # {"versions": {...}, "patches": [PatchStatus, ...]}; `miles-vl doctor`

One module per release family, each explaining what upstream gets wrong and how it is detected:
`bridge_v06` (>= 0.6.0: positions when the caller passes none; images and videos in one pre-sharded micro-batch)
and `bridge_v05` (0.5.x: per-segment positions, no double split, CP-local vision rows, the AllGatherVisionEmbeddings
keyword shim, the empty-rank dtype, images and videos in one pre-sharded micro-batch); and, for every release,
`bridge_recompute` (the vision tower's deepstack features keep their gradients under full recompute). The same 0.5.1
fixes as a source patch: `patches/` at the repository root.
The megatron train backend calls `install()` when it is imported; users of other frameworks call it themselves.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from miles_vl.patches import bridge_recompute, bridge_v05, bridge_v06
from miles_vl.patches.core import (
    Patch,
    PatchStatus,
    PatchTargetMissing,
    install_patches,
    installed_versions,
    patch_status,
    target_module,
)
from miles_vl.patches.provider import configure_provider

PATCHES: list[Patch] = [*bridge_v06.PATCHES, *bridge_v05.PATCHES, *bridge_recompute.PATCHES]


def install(module: ModuleType | None = None) -> list[PatchStatus]:
    """Install every needed patch into megatron-bridge's Qwen3-VL model module (imported if not given)."""
    return install_patches(PATCHES, module or target_module())


def status(module: ModuleType | None = None) -> dict[str, Any]:
    """Versions and per-patch state: installed / not installed / not needed (native) / target missing."""
    versions = installed_versions()
    try:
        module = module or target_module()
    except PatchTargetMissing as e:
        return {"versions": versions, "patches": [], "error": str(e)}
    return {"versions": versions, "patches": patch_status(PATCHES, module)}


__all__ = ["PATCHES", "PatchTargetMissing", "configure_provider", "install", "status"]
