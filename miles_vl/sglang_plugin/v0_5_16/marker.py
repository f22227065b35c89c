"""SGLang 0.5.16's marker hook: `marker.patch_marker` on 0.5.16's HTTP server (`set_global_state`, whose
`scheduler_info` `/server_info` spreads into its answer, `srt/entrypoints/http_server.py:743-760`)."""

from __future__ import annotations

from miles_vl.sglang_plugin.adapter import Context, Hook, Target
from miles_vl.sglang_plugin.marker import patch_marker

HTTP_SERVER_MODULE = "sglang.srt.entrypoints.http_server"

TARGETS = (
    Target(HTTP_SERVER_MODULE, "set_global_state", ("global_state",)),
    Target(HTTP_SERVER_MODULE, "_GlobalState"),
)
PATCHED = ((HTTP_SERVER_MODULE, "set_global_state"),)


def apply(modules: dict, context: Context) -> None:
    patch_marker(modules[HTTP_SERVER_MODULE], context.marker)


HOOK = Hook("marker", TARGETS, apply, PATCHED)
