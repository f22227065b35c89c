"""Shared by every adapter: the marker a server with the plugin reports in `/server_info` and `/get_server_info`.

`MARKER_KEY` holds {"release", "adapter", "patches": {name: "live" | "off: why"}, "settings"}; the host checks it
once the server is healthy (miles_vl/rollout/sglang/host.py, `check_marker`). It is added to the `scheduler_info`
dict that SGLang's HTTP server spreads into its server-info answer (`http_server.set_global_state`, called once in
the launching process, where the tokenizer runs). The patches of the scheduler processes are listed live because a
scheduler whose patches did not take ends at start (`adapter.PluginRefused`), and so does the whole server.

Never imports SGLang (the host reads `MARKER_KEY`).
"""

from __future__ import annotations

MARKER_KEY = "miles_vl_plugin"


def patch_marker(http_server, marker: dict) -> None:
    """Wrap `http_server.set_global_state(global_state)` (a release's `srt/entrypoints/http_server.py`) so that the
    server-info answer carries `marker` under `MARKER_KEY`."""
    stock = http_server.set_global_state

    def set_global_state(global_state):
        global_state.scheduler_info = {**global_state.scheduler_info, MARKER_KEY: marker}
        return stock(global_state)

    http_server.set_global_state = set_global_state


def new_marker(release: str, adapter: str, patches: dict[str, str], settings: dict) -> dict:
    """The marker of a server (module docstring): `patches` maps each patch to "live" or "off: why"."""
    return {"release": release, "adapter": adapter, "patches": patches, "settings": settings}


def marker_problem(server_info: dict, asked: tuple[str, ...], sglang_plugins: str | None) -> str | None:
    """Host side: why a server that should run the plugin does not, from its `/server_info` answer, or None.

    Args:
        server_info: the server's `/server_info` (or `/get_server_info`) answer.
        asked: the patches the host's settings ask for (`PluginSettings.patches()`).
        sglang_plugins: `SGLANG_PLUGINS` in the server's environment (SGLang loads only the plugins it names).
    """
    marker = server_info.get(MARKER_KEY)
    release = server_info.get("version", "?")
    if not isinstance(marker, dict):
        causes = [
            f"SGLANG_PLUGINS={sglang_plugins!r} in its environment does not name miles_vl"
            if sglang_plugins and "miles_vl" not in sglang_plugins.split(",")
            else None,
            "this machine's miles_vl install predates the plugin's entry point (group sglang.srt.plugins): reinstall "
            "miles_vl (make setup)",
            "the plugin failed to load: look for 'Failed to load plugin miles_vl' in the server's log",
        ]
        return (
            f"the SGLang server ({release}) runs without miles_vl's plugin: its /server_info has no {MARKER_KEY!r}. "
            f"Likely: {'; or '.join(c for c in causes if c)}. Fix that, or set rollout.sglang.launcher: sglang"
        )
    patches = marker.get("patches") or {}
    missing = [name for name in asked if name not in patches]
    if missing:
        return (
            f"the SGLang server ({release}, adapter {marker.get('adapter')}) lacks the plugin patches {missing} that "
            f"this run asked for (live: {patches}): the server's miles_vl differs from the host's; reinstall miles_vl "
            "on that machine, or set rollout.sglang.launcher: sglang"
        )
    return None
