"""SGLang 0.5.17's multimodal feature transport under the plugin: "cpu", pinned in the launching process.

0.5.17 resolves an unset `--mm-feature-transport` to "cuda_ipc" on one node with CUDA
(`ServerArgs._handle_multimodal_feature_transport`, `srt/server_args.py:7564`), where 0.5.16 resolved it to "cpu".
Under cuda_ipc the tokenizer hands the scheduler proxies into a GPU pool instead of pixel tensors: the plugin's pixel
files, shared-memory moves and links, dropped copy pixels and pixel memory (`pixels`, `grouping`) are written for
plain tensors, and with `SGLANG_MM_PRECOMPUTE_HASH=1` (the host's default, miles_vl/rollout/sglang/server.py) SGLang's
own tokenizer hashes each image after wrapping it, opening the pool's IPC handle in the process that made it: every
server died in its warmup request ("CUDA error: invalid device context", `mm_utils.hash_feature` ->
`reconstruct_on_target_device`, GPU run of 2026-11-26).

So, in the launching process (where ServerArgs is built, after `load_plugins`), an unset transport becomes "cpu"
before SGLang resolves it; a transport that resolves to anything else (`--mm-feature-transport cuda_ipc`, the
deprecated `--keep-mm-feature-on-device` or `SGLANG_USE_CUDA_IPC_TRANSPORT=1`) is refused with the fix. The
schedulers get the resolved arguments from the launcher (pickled, not resolved again) and inherit
`SGLANG_USE_CUDA_IPC_TRANSPORT=0`, which SGLang sets from the resolved value. The marker reports the transport
(`mm_feature_transport`).

The host also passes `--mm-feature-transport cpu` to every server it starts (miles_vl/rollout/sglang/server.py,
`MM_TRANSPORT_FLAG`: SGLang's own server dies the same way under cuda_ipc). The plugin does not rely on that: it is
what needs cpu, so every server that runs it gets it (one started by hand with the settings variable too), and it reads
the user's arguments as SGLang parsed them, so a cuda_ipc however given (`extra_args`, the deprecated flag or
variable) is refused rather than overridden.
"""

from __future__ import annotations

import os

from miles_vl.sglang_plugin.adapter import FIX, Context, PluginRefused, Target

SERVER_ARGS_MODULE = "sglang.srt.server_args"
ENVIRON_MODULE = "sglang.srt.environ"
TRANSPORT = "cpu"  # what the plugin's mechanisms are written for
LEGACY_ENV = "SGLANG_USE_CUDA_IPC_TRANSPORT"  # 0.5.17's deprecated switch (`srt/environ.py`)

TARGETS = (
    Target(SERVER_ARGS_MODULE, "ServerArgs.__post_init__", ("self",)),
    Target(SERVER_ARGS_MODULE, "ServerArgs.mm_feature_transport"),
    Target(SERVER_ARGS_MODULE, "ServerArgs.keep_mm_feature_on_device"),
    Target(ENVIRON_MODULE, f"Envs.{LEGACY_ENV}"),
)


def _asked(server_args, legacy) -> tuple[str, str] | None:
    """What the user asked for the transport, in their words, and how to take it back; None when they left it to
    SGLang."""
    if server_args.mm_feature_transport is not None:
        return f"--mm-feature-transport {server_args.mm_feature_transport}", "drop --mm-feature-transport"
    if server_args.keep_mm_feature_on_device:
        return "--keep-mm-feature-on-device", "drop --keep-mm-feature-on-device"
    if legacy.is_set():
        return f"{LEGACY_ENV}={os.environ.get(LEGACY_ENV)}", f"unset {LEGACY_ENV}"
    return None


def pin_cpu_transport(server_args_cls, envs, context: Context) -> None:
    """Wrap `server_args_cls.__post_init__` (0.5.17's `ServerArgs`) so that an unset transport resolves to "cpu" and
    any other resolution is refused (module docstring); the marker gets the resolved transport. `envs`: 0.5.17's
    `srt/environ.envs` (the deprecated switch is read through it)."""
    post_init = server_args_cls.__post_init__

    def __post_init__(self):
        asked = _asked(self, getattr(envs, LEGACY_ENV))
        if asked is None:
            self.mm_feature_transport = (
                TRANSPORT  # before resolution the fields are plain attributes (not yet read-only)
            )
        post_init(self)
        if self.mm_feature_transport != TRANSPORT:  # `asked` is set: an unset transport was pinned above
            given, undo = asked
            raise PluginRefused(
                f"SGLang 0.5.17 with {given} resolves the multimodal feature transport to "
                f"{self.mm_feature_transport!r}; the plugin's pixel handling needs --mm-feature-transport cpu (what it "
                f"sets when the flag is left out): {undo}, or {FIX}"
            )
        context.marker["mm_feature_transport"] = self.mm_feature_transport

    server_args_cls.__post_init__ = __post_init__


def apply(modules: dict, context: Context) -> None:
    """In the launching process only: the schedulers never build their ServerArgs (module docstring)."""
    if context.launching:
        pin_cpu_transport(modules[SERVER_ARGS_MODULE].ServerArgs, modules[ENVIRON_MODULE].envs, context)
