"""miles_vl's plugin for SGLang's server: faster multimodal GRPO rollouts, loaded by SGLang itself.

How it is loaded: miles_vl's package declares the entry point `miles_vl = "miles_vl.sglang_plugin:register"` in
SGLang's general plugin group (`sglang.srt.plugins`, pyproject.toml). SGLang's `load_plugins()` calls `register()` in
the launching process (`python -m sglang.launch_server`, where the tokenizer and the HTTP server run) and at the start
of every scheduler process (0.5.16/0.5.17 `srt/managers/scheduler.py`, `run_scheduler_process`). `register()` does
nothing unless the host opted in: miles_vl's SGLang host sets `settings.SETTINGS_ENV` (a JSON of `PluginSettings`)
in the server's environment, which every server process inherits.

What it does then: reads the installed SGLang release, picks its adapter from `ADAPTERS` (one package per release,
`v0_5_16/`, `v0_5_17/`), checks every symbol the asked-for hooks patch or read before patching anything
(`adapter.check_targets`), applies the hooks, checks that each took (`adapter.verify_applied`), and reports a marker
in `/server_info` (`marker.MARKER_KEY`: the release, the adapter, the patches live) that the host checks. Anything
else, an unknown release, a missing symbol, bad settings, ends the server at start with one message naming the
release, the symbol and the fix (`adapter.PluginRefused`).

The hooks (docs/sglang.md, "The plugin"): the tokenizer's grouped sending of a batch's prefixes and copies
(`grouping`), the copies without pixel values and the pixel files (`pixels`, `wire`), the scheduler's pixel memory and
threaded receives (`pixels`), the vision tower's CUDA graphs (`vision`). The wire format the engine shares with the
server is `wire` (no SGLang import).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import logging
import multiprocessing
import os
from collections.abc import Mapping

from miles_vl.sglang_plugin.adapter import (
    FIX,
    Adapter,
    Context,
    PluginRefused,
    check_targets,
    resolve,
    verify_applied,
)
from miles_vl.sglang_plugin.marker import MARKER_KEY, new_marker
from miles_vl.sglang_plugin.settings import SETTINGS_ENV, PluginSettings, from_env
from miles_vl.sglang_plugin.vision import stock_graphs_off

log = logging.getLogger("miles_vl.sglang_plugin")

# the SGLang releases with an adapter: the version `importlib.metadata` reports -> the adapter's package
ADAPTERS: dict[str, str] = {
    "0.5.16": "miles_vl.sglang_plugin.v0_5_16",
    "0.5.17": "miles_vl.sglang_plugin.v0_5_17",
}

_installed: dict | None = None  # the marker of this process's install (register runs once per process)


def sglang_release() -> str:
    """The installed SGLang's version ("not installed" without one)."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def adapter_for(release: str) -> Adapter:
    """The adapter of `release`.

    Raises:
        PluginRefused: `release` has none; the message lists the supported releases and the fix.
    """
    package = ADAPTERS.get(release)
    if package is None:
        raise PluginRefused(
            f"SGLang {release} has no adapter in miles_vl.sglang_plugin (supported releases: "
            f"{', '.join(ADAPTERS)}); {FIX}"
        )
    return importlib.import_module(package).ADAPTER


def install(adapter: Adapter, settings: PluginSettings, *, launching: bool) -> dict:
    """Check every target of the hooks `settings` asks for, then apply them and check each took; returns the marker.

    Raises:
        PluginRefused: a target is missing, or a hook left its target as SGLang had it.
    """
    hooks = tuple(hook for hook in adapter.hooks if hook.name in settings.patches())
    modules = check_targets(adapter.release, hooks)  # every target of every hook, before any is patched
    stock_graphs_off()
    marker = new_marker(adapter.release, adapter.name, {h.name: "live" for h in hooks}, dataclasses.asdict(settings))
    context = Context(settings, launching, marker)
    for hook in hooks:
        before = {(m, a): resolve(modules[m], a) for m, a in hook.patched}
        hook.apply(modules, context)
        verify_applied(adapter.release, hook, before, modules)
    log.info("miles_vl SGLang plugin: %s", marker)
    return marker


def register(environ: Mapping[str, str] | None = None, release: str | None = None) -> dict | None:
    """SGLang's plugin entry point (module docstring): the marker of what was installed, or None when the host did not
    opt in (`SETTINGS_ENV` unset). `environ` (default `os.environ`) and `release` (default: the installed SGLang's)
    are for tests. Once per process: a second call returns the first one's marker.

    Raises:
        PluginRefused: bad settings, an unsupported release, a missing target, a hook that did not take (a
            `SystemExit`: SGLang's `load_plugins` does not swallow it; the server ends with the message).
    """
    global _installed
    try:
        settings = from_env(os.environ if environ is None else environ)
    except ValueError as e:
        raise PluginRefused(str(e)) from e
    if settings is None:
        return None
    if _installed is not None:
        return _installed
    adapter = adapter_for(sglang_release() if release is None else release)
    _installed = install(adapter, settings, launching=multiprocessing.parent_process() is None)
    return _installed


__all__ = [
    "ADAPTERS",
    "MARKER_KEY",
    "SETTINGS_ENV",
    "PluginRefused",
    "PluginSettings",
    "adapter_for",
    "install",
    "register",
    "sglang_release",
]
