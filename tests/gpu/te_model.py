"""The tiny Qwen3-VL of the CPU harness, built with Transformer Engine layer specs on a GPU (bf16), and its forwards.

Used inside ranks spawned by `tests.gpu.nccl.run_ranks`; imports megatron only when called.
"""

from __future__ import annotations

import torch

from tests.patches.harness.runner import thd_params
from tests.patches.harness.tiny import TinySample, build_tiny_qwen3vl, reference_positions


def build_te_model(*, cp: int, tp: int = 1, sp: bool = False, seed: int = 0, device: torch.device):
    """The harness's tiny `Qwen3VLModel` (deepstack, GQA, interleaved MRoPE) with TE specs, bf16, on `device`.

    Logits come back gathered over TP (`parallel_output=False`). Deterministic in (seed, tp rank).
    """
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl import model as module
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
    model = build_tiny_qwen3vl(
        module,
        cp_size=cp,
        tp_size=tp,
        sequence_parallel=sp,
        layer_spec=spec,
        dtype=torch.bfloat16,
        parallel_output=False,
        seed=seed,
    )
    # The vision tower's HF-style parts keep fp32 parameters unless the whole model is cast.
    return model.to(device=device, dtype=torch.bfloat16).eval()


def _vision_inputs(sample_or_batch_pixels, grids, videos, video_grids, device) -> dict:
    out = {}
    if sample_or_batch_pixels is not None:
        out["pixel_values"] = sample_or_batch_pixels.to(device, torch.bfloat16)
        out["image_grid_thw"] = grids.to(device)
    if videos is not None:
        out["pixel_values_videos"] = videos.to(device, torch.bfloat16)
        out["video_grid_thw"] = video_grids.to(device)
    return out


def _logits(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


@torch.no_grad()
def unpacked_logits(model, samples: list[TinySample], device) -> list[torch.Tensor]:
    """Each sample alone (BSHD, batch 1) with transformers' reference positions: list of [L_i, V] fp32 on CPU."""
    outs = []
    for s in samples:
        out = model(
            input_ids=s.input_ids[None].to(device),
            position_ids=reference_positions(s)[:, None, :].to(device),  # [3, 1, L]
            **_vision_inputs(
                s.pixel_values, s.image_grid_thw, getattr(s, "pixel_values_videos", None), s.video_grid_thw, device
            ),
        )
        outs.append(_logits(out)[0].float().cpu())
    return outs


@torch.no_grad()
def packed_shard_logits(model, batch, samples, cp_rank: int, position_ids, device) -> torch.Tensor:
    """This CP rank's pre-sharded THD row of `batch` through the model: [T/C, V] fp32 on CPU."""
    shard = batch.shard(cp_rank)
    pixels = [s.pixel_values for s in samples if s.pixel_values is not None]
    videos = [v for s in samples if (v := getattr(s, "pixel_values_videos", None)) is not None]
    out = model(
        input_ids=shard.input_ids.to(device),  # [1, T/C]
        position_ids=None if position_ids is None else position_ids.to(device),  # [3, 1, T/C]
        packed_seq_params=thd_params(shard.cu_seqlens.to(device)),  # the full row's segments
        **_vision_inputs(
            torch.cat(pixels) if pixels else None,
            batch.image_grid_thw,
            torch.cat(videos) if videos else None,
            batch.video_grid_thw,
            device,
        ),
    )
    return _logits(out)[0].float().cpu()


def weights_checksum(model) -> float:
    return float(sum(p.detach().double().abs().sum() for p in model.parameters()))
