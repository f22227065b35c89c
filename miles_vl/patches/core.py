"""The patch machinery: what a patch is, how it is detected and installed, and what `status()` reports.

A `Patch` targets megatron-bridge's Qwen3-VL model module (`TARGET_MODULE`), which imports its helpers into its own
namespace, so patches rebind names there (patching `rope` or `utils` would have no effect). Each patch detects by
capability, not by version string: `detect(module)` returns "needed" or "native" (the release already does it
right) and raises `PatchTargetMissing` when the symbol it would patch is absent (an unsupported release: a loud
error at install time, never a silent skip). `install` applies each needed patch once per module object.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import importlib.metadata
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

from miles_vl.models.qwen3_vl import BRIDGE_MODULE

log = logging.getLogger(__name__)

TARGET_MODULE = BRIDGE_MODULE  # the model family's (miles_vl/models/qwen3_vl)
_APPLIED = "_miles_vl_patches"  # set of patch names applied to a module object


class PatchTargetMissing(RuntimeError):
    """The installed megatron-bridge lacks a symbol a patch needs; the message names the release and the symbol."""


@dataclass(frozen=True)
class Patch:
    name: str
    summary: str  # what upstream gets wrong, and what we do
    detect: Callable[[ModuleType], Literal["needed", "native"]]
    apply: Callable[[ModuleType], None]


@dataclass(frozen=True)
class PatchStatus:
    name: str
    state: Literal["installed", "not installed", "not needed (native)", "target missing"]
    summary: str
    detail: str = ""


def bridge_version() -> str:
    try:
        return importlib.metadata.version("megatron-bridge")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def installed_versions() -> dict[str, str]:
    """megatron-bridge / megatron-core / Transformer Engine versions as installed (or 'not installed')."""
    out = {}
    for dist in ("megatron-bridge", "megatron-core", "transformer-engine", "transformer-engine-torch"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def require(module: ModuleType, *symbols: str) -> None:
    """Raise `PatchTargetMissing` unless `module` has every dotted symbol (e.g. "Qwen3VLModel.forward")."""
    for symbol in symbols:
        obj = module
        for part in symbol.split("."):
            if not hasattr(obj, part):
                raise PatchTargetMissing(
                    f"megatron-bridge {bridge_version()}: {module.__name__} has no {symbol!r}; this release is not "
                    "supported by miles_vl.patches (supported: 0.5.x and >= 0.6.0)"
                )
            obj = getattr(obj, part)


def wrap_forward(cls: type, var: contextvars.ContextVar, prepare: Callable[[Any, dict[str, Any]], Any | None]) -> None:
    """Replace `cls.forward` by a wrapper that binds each call's arguments and asks `prepare(self, arguments)` for what
    the call needs; a value that is not None is held in `var` for the duration of the original forward, where the
    module functions patched beside it read it (None: the original runs untouched). The original stays reachable as
    `cls.forward.__miles_vl_original__`."""
    original = cls.forward
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        value = prepare(self, bound.arguments)
        if value is None:
            return original(*bound.args, **bound.kwargs)
        token = var.set(value)
        try:
            return original(*bound.args, **bound.kwargs)
        finally:
            var.reset(token)

    forward.__miles_vl_original__ = original
    cls.forward = forward


def target_module() -> ModuleType:
    """Import the model module of the installed megatron-bridge.

    Raises:
        PatchTargetMissing: megatron-bridge or its Qwen3-VL model module cannot be imported.
    """
    try:
        return importlib.import_module(TARGET_MODULE)
    except ImportError as e:
        raise PatchTargetMissing(
            f"cannot import {TARGET_MODULE} (megatron-bridge {bridge_version()}): {e}; the patches need "
            "megatron-bridge "
            "importable with its runtime dependencies (Transformer Engine on GPU machines; scripts/setup_megatron.sh "
            "for the CPU test setup)"
        ) from e


def install_patches(patches: list[Patch], module: ModuleType) -> list[PatchStatus]:
    """Detect and apply each patch once on `module`; returns the status of every patch.

    Raises:
        PatchTargetMissing: a patch's target is absent from this release.
    """
    applied: set[str] = module.__dict__.setdefault(_APPLIED, set())
    out = []
    for patch in patches:
        if patch.name in applied:
            out.append(PatchStatus(patch.name, "installed", patch.summary))
            continue
        if patch.detect(module) == "native":
            out.append(PatchStatus(patch.name, "not needed (native)", patch.summary))
            continue
        patch.apply(module)
        applied.add(patch.name)
        log.info("miles_vl patch installed: %s", patch.name)
        out.append(PatchStatus(patch.name, "installed", patch.summary))
    return out


def patch_status(patches: list[Patch], module: ModuleType) -> list[PatchStatus]:
    """Status of every patch on `module` without changing anything."""
    applied: set[str] = module.__dict__.get(_APPLIED, set())
    out = []
    for patch in patches:
        try:
            state = "installed" if patch.name in applied else patch.detect(module)
        except PatchTargetMissing as e:
            out.append(PatchStatus(patch.name, "target missing", patch.summary, str(e)))
            continue
        label = {"installed": "installed", "native": "not needed (native)", "needed": "not installed"}[state]
        out.append(PatchStatus(patch.name, label, patch.summary))
    return out
