"""Model families: what is specific to one family of vision-language models sits in its folder, so that a second
family (Qwen2.5-VL, Qwen3.5-VL) is a sibling folder. Qwen3-VL (`qwen3_vl/`) is the one implemented.

A family folder provides (the modules of `qwen3_vl/`):
- `tokens`: `special_tokens(processor)` (its special ids as `SpecialTokens`), `vision_token_ids` (banned in responses);
- `rope`: the rope index of one sample and of a packed row (`miles_vl.packing` exports these as its public API);
- `model`: the transformers model, from a checkpoint or a random tiny config;
- `forward`: the transformers model's forward over a packed THD row (the embedded train backend's model call);
- `processor`: the processor built without a download (`model.processor: offline`) and its defaults;
- `__init__`: the names other stacks give the model (megatron-bridge's module that `miles_vl.patches` patches, the
  megatron and SGLang parameter prefixes).

`SpecialTokens` (here) is the record of token ids every part takes, whatever the family.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecialTokens:
    """Token ids the packing, the engines and the trainers need; read from the processor (`special_tokens`)."""

    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    pad_token_id: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int


__all__ = ["SpecialTokens"]
