"""The adapter of SGLang 0.5.16: its tokenizer, receiver, vision and marker hooks (one module each)."""

from miles_vl.sglang_plugin.adapter import Adapter
from miles_vl.sglang_plugin.v0_5_16 import marker, receiver, tokenizer, vision

ADAPTER = Adapter("0.5.16", "v0_5_16", (tokenizer.HOOK, receiver.HOOK, vision.HOOK, marker.HOOK))

__all__ = ["ADAPTER"]
