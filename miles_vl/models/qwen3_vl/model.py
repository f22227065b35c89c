"""Build the Qwen3-VL that both embedded backends use: a local HF checkpoint, or a random-init tiny one.

The tiny model keeps the real architecture (vision tower with deepstack, MRoPE, the same special-token ids as
the processor) with small widths, so that the whole RL loop runs on a CPU. Its vocabulary is the processor's.
Nothing is downloaded: a pretrained path must be a local directory (or a hub id already in the local cache).
"""

from __future__ import annotations

import torch
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from miles_vl.models import SpecialTokens


def tiny_config(
    tokens: SpecialTokens,
    *,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    vision_depth: int = 2,
    vision_hidden_size: int = 32,
    vision_num_heads: int = 2,
    vision_intermediate_size: int = 64,
    deepstack_visual_indexes: list[int] | None = None,
    initializer_range: float = 0.02,
) -> Qwen3VLConfig:
    """A small Qwen3-VL config with the real structure (patch 16, merge 2, temporal patch 2, interleaved MRoPE)."""
    if head_dim % 8:
        raise ValueError(f"head_dim must be a multiple of 8 for the MRoPE sections, found {head_dim}")
    half = head_dim // 2  # rotary frequencies per head, split over (t, h, w)
    section = [half - 2 * (half // 4), half // 4, half // 4]
    deepstack = [0] if deepstack_visual_indexes is None else list(deepstack_visual_indexes)
    if any(not 0 <= i < vision_depth for i in deepstack):
        raise ValueError(f"deepstack_visual_indexes {deepstack} must be vision layers in [0, {vision_depth})")
    return Qwen3VLConfig(
        text_config=dict(
            vocab_size=tokens.vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            head_dim=head_dim,
            max_position_embeddings=32768,
            initializer_range=initializer_range,
            rope_parameters=dict(
                rope_type="default", rope_theta=10000.0, mrope_section=section, mrope_interleaved=True
            ),
            pad_token_id=tokens.pad_token_id,
        ),
        vision_config=dict(
            depth=vision_depth,
            hidden_size=vision_hidden_size,
            intermediate_size=vision_intermediate_size,
            num_heads=vision_num_heads,
            out_hidden_size=hidden_size,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            num_position_embeddings=256,
            deepstack_visual_indexes=deepstack,
            initializer_range=initializer_range,
        ),
        image_token_id=tokens.image_token_id,
        video_token_id=tokens.video_token_id,
        vision_start_token_id=tokens.vision_start_token_id,
        vision_end_token_id=tokens.vision_end_token_id,
        tie_word_embeddings=False,
    )


def build_model(
    tokens: SpecialTokens,
    *,
    path: str | None = None,
    tiny: dict | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Qwen3VLForConditionalGeneration:
    """Load `path` (local files only) or, with `path=None`, build a random tiny model seeded by `seed`.

    Raises:
        ValueError: the checkpoint's special-token ids differ from the processor's.
    """
    if path is not None:
        model = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=dtype, local_files_only=True)
        cfg = model.config
        found = (cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id)
        want = (tokens.image_token_id, tokens.video_token_id, tokens.vision_start_token_id)
        if found != want:
            raise ValueError(
                f"{path}: the model's (image, video, vision_start) token ids {found} differ from the processor's "
                f"{want}; load the processor that belongs to this checkpoint (model.processor)"
            )
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen3VLForConditionalGeneration(tiny_config(tokens, **(tiny or {})))
        model = model.to(dtype)
    model.config._attn_implementation = "sdpa"
    return model.to(device)
