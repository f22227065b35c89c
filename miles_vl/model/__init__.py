"""The Qwen3-VL model that the embedded rollout engine and train backend share (HF checkpoint or tiny random)."""

from miles_vl.model.qwen3_vl import SpecialTokens, build_model, tiny_config

__all__ = ["SpecialTokens", "build_model", "tiny_config"]
