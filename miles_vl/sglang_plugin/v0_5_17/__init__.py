"""The adapter of SGLang 0.5.17: its tokenizer, receiver, vision and marker hooks (one module each; what 0.5.17 left
as 0.5.16 had it is taken from `v0_5_16`, not copied)."""

from miles_vl.sglang_plugin.adapter import Adapter
from miles_vl.sglang_plugin.v0_5_17 import marker, receiver, tokenizer, vision

ADAPTER = Adapter("0.5.17", "v0_5_17", (tokenizer.HOOK, receiver.HOOK, vision.HOOK, marker.HOOK))

__all__ = ["ADAPTER"]
