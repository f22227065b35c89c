"""Qwen3-VL: everything miles_vl knows that is specific to this model family (see miles_vl/models/__init__.py).

Modules: `tokens` (special ids from the processor, the vision tokens a policy must not generate), `rope` (per-segment
MRoPE), `model` (transformers Qwen3-VL: checkpoint or tiny random), `forward` (its forward over a packed THD row),
`processor` (the offline processor, patch 16, merge 2, temporal patch 2). The names below are how other stacks call
its parts; megatron-bridge's Qwen3-VL module is patched by `miles_vl.patches` (bridge_v05, bridge_v06).
"""

# megatron-bridge's Qwen3-VL model module, which `miles_vl.patches` patches (it imports its helpers into its own
# namespace, so patches rebind names there).
BRIDGE_MODULE = "megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model"
# megatron parameter names of the vision tower, its merger and deepstack mergers (frozen with train.freeze_vision).
MEGATRON_VISION_PREFIXES = ("vision_model.",)
# The HF name prefix of the vision tower.
HF_VISION_PREFIX = "model.visual."
# SGLang 0.5.16's plain renames of HF names in Qwen3-VL's `load_weights` (srt/models/qwen3_vl.py:1463 and :1515-1516),
# in its order.
SGLANG_RENAMES = (("model.language_model.", "model."), ("attn.qkv.", "attn.qkv_proj."), ("model.visual.", "visual."))

__all__ = ["BRIDGE_MODULE", "HF_VISION_PREFIX", "MEGATRON_VISION_PREFIXES", "SGLANG_RENAMES"]
