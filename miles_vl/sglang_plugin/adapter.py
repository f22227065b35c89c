"""What an adapter of one SGLang release is, how its targets are checked before anything is patched, and how a
refusal stops the server.

An `Adapter` lists every `Target` its hooks patch or read (module, dotted attribute, and the parameters where a hook
depends on a signature) and its `Hook`s, one per patch (tokenizer, receiver, vision, marker). `check_targets` imports
each module and resolves each attribute: the first miss is a `PluginRefused` naming the release, the symbol and the
fix, before any hook runs. After the hooks ran, `verify_applied` looks at every patched attribute again (the house
discipline of miles_vl/patches/core.py: loud drift, nothing half-patched unseen).

`PluginRefused` is a `SystemExit`: SGLang's `load_plugins` catches `Exception` around a plugin (logs it and starts the
server unpatched, `srt/plugins/__init__.py`), but not `SystemExit`, which ends the process with the message on stderr
(exit status 1). In the launching process that is before any server child starts, so the server's log ends with the
message and the host reports its tail (`SGLangServerDiedError`).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from miles_vl.sglang_plugin.settings import PluginSettings

FIX = (
    "set rollout.sglang.launcher: sglang to run SGLang's own server without miles_vl's patches (slower, and no pixel "
    "values from the engine), or install a supported SGLang release (docs/sglang.md, 'The plugin')"
)


class PluginRefused(SystemExit):
    """The plugin cannot run in this SGLang (unknown release, a missing symbol, bad settings, a patch that did not
    take): ends the server process at start with `message` (module docstring)."""

    def __init__(self, message: str):
        super().__init__(f"miles_vl SGLang plugin refused to start: {message}")


@dataclass(frozen=True)
class Target:
    """One symbol a hook patches or reads: `attribute` (dotted, e.g. "TokenizerManager._send_one_request") of
    `module`; `params`: the leading parameter names the hook relies on, where it relies on a signature."""

    module: str
    attribute: str
    params: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.module}.{self.attribute}"


@dataclass
class Context:
    """What a hook's `apply` is given besides the modules: the host's `settings`; `launching`: this is the process
    SGLang's launcher runs in (the tokenizer's and the HTTP server's), not a child it started (a scheduler); `marker`:
    what the server reports (`marker.MARKER_KEY`), whose "patches" (the state of each patch by name: "live", or
    "off: why") a hook may set."""

    settings: PluginSettings
    launching: bool
    marker: dict

    @property
    def patches(self) -> dict[str, str]:
        return self.marker["patches"]


@dataclass(frozen=True)
class Hook:
    """One patch: `name` (what the marker lists), the `targets` it patches or reads, `apply(modules, context)` (the
    imported modules by name) and `patched`: the (module, attribute) pairs `verify_applied` checks afterwards."""

    name: str
    targets: tuple[Target, ...]
    apply: Callable[[dict[str, ModuleType], Context], None]
    patched: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Adapter:
    """The hooks of one SGLang release (`release`: the version string `importlib.metadata` reports)."""

    release: str
    name: str  # the adapter's package, e.g. "v0_5_16"
    hooks: tuple[Hook, ...]


def resolve(module: ModuleType, attribute: str):
    """`module`'s dotted `attribute`; AttributeError naming the first missing part."""
    obj = module
    for part in attribute.split("."):
        obj = getattr(obj, part)
    return obj


def check_targets(release: str, hooks: tuple[Hook, ...]) -> dict[str, ModuleType]:
    """Import every target's module and resolve every target (and its parameters) of `hooks`; returns the modules.

    Raises:
        PluginRefused: a module that does not import, a missing attribute, or a signature without the parameters a
            hook relies on; the message names the release, the symbol and the fix.
    """
    modules: dict[str, ModuleType] = {}
    for hook in hooks:
        for target in hook.targets:
            try:
                module = modules.get(target.module) or importlib.import_module(target.module)
                modules[target.module] = module
                obj = resolve(module, target.attribute)
            except (ImportError, AttributeError) as e:
                raise PluginRefused(
                    f"SGLang {release}: the {hook.name} patch needs {target}, which this install lacks ({e}); {FIX}"
                ) from e
            if target.params:
                found = tuple(inspect.signature(obj).parameters)[: len(target.params)]
                if found != target.params:
                    raise PluginRefused(
                        f"SGLang {release}: the {hook.name} patch needs {target}{target.params}, found {found}; {FIX}"
                    )
    return modules


def verify_applied(release: str, hook: Hook, before: dict[tuple[str, str], object], modules) -> None:
    """Raise unless every attribute `hook` patches is no longer the object it was (`before`).

    Raises:
        PluginRefused: naming the attribute that the hook left as SGLang had it.
    """
    for module_name, attribute in hook.patched:
        if resolve(modules[module_name], attribute) is before[(module_name, attribute)]:
            raise PluginRefused(f"SGLang {release}: the {hook.name} patch left {module_name}.{attribute} unpatched")
