"""SGLang 0.5.17's marker hook: 0.5.16's (`v0_5_16.marker`); 0.5.17 kept `set_global_state` and the
`scheduler_info` that `/server_info` spreads into its answer (`srt/entrypoints/http_server.py:207`, `:743`)."""

from miles_vl.sglang_plugin.v0_5_16.marker import HOOK

__all__ = ["HOOK"]
