"""megatron-bridge >= 0.6: positions for pre-sharded THD calls that pass none; images and videos in one micro-batch.

What upstream does: 0.6 supports pre-sharded THD input under CP natively (`_is_packed_input_pre_sharded`,
CP-local vision rows via `_get_cp_local_vision_embed_indices`) but raises
`ValueError("Pre-sharded packed CP inputs require explicit rank-local 3D MRoPE position_ids.")` when the caller
passes no 3-D `position_ids`.

Detection: the model module has `_is_packed_input_pre_sharded` (0.6 capability); 0.5.x has not, and its own
patches (bridge_v05) cover positions there.

What replaces it: `Qwen3VLModel.forward` is wrapped. When the input is pre-sharded and `position_ids` is not an
MRoPE tensor, the wrapper rebuilds rank-local per-segment positions from the local row (model-side reconstruction:
one all-gather of the local ids over the CP group, `miles_vl.packing.distributed.model_side_position_ids`) and
calls the original forward with them. Calls that pass positions, and every other layout, are untouched. The
model side cannot know where each prompt ends, so every media token counts as media; pass data-side positions
(`PackedBatch.shard`) when responses may contain vision tokens.

Images AND videos in one pre-sharded micro-batch (`v06_mixed_media_row_order`): with both `pixel_values` and
`pixel_values_videos`, upstream's `reorganize_inputs` (utils.py `find_vision_id_index`, called at model.py:601 on
the input row) orders the vision blocks by scanning the row it is given. On a rank-local zigzag row the blocks are
cut into pieces or absent, so its `assert len_split == len(vision_indexs)` fails (AssertionError), or, if the counts
happen to agree, the blocks are ordered wrongly. One modality alone takes the early return and is right. Detection:
the module has `_is_packed_input_pre_sharded` and `reorganize_inputs` (0.6.2, the release checked, does not order
mixed media on a local row; tests/patches/test_harness_qwen3vl.py pins that and would notice a release that does).
What replaces it: a forward wrapper that, for a pre-sharded call with both modalities only, all-gathers the local
ids over the CP group and rebuilds the full row (`miles_vl.packing.distributed.gather_full_row`), and a rebound
`reorganize_inputs` that, inside such a call, orders the pixels and grids by scanning that full row (natural order,
as the vision tower must see them, DESIGN §4) and returns the rank-local vision mask. Every other call is untouched.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable
from types import ModuleType

import torch

from miles_vl.packing import MediaTokens
from miles_vl.packing.distributed import gather_full_row, model_side_position_ids
from miles_vl.patches.core import Patch, require, wrap_forward


def _detect(module: ModuleType) -> str:
    if not hasattr(module, "_is_packed_input_pre_sharded"):
        return "native"  # not a 0.6-style release: nothing raises here (bridge_v05 handles 0.5.x)
    require(module, "Qwen3VLModel.forward", "_is_mrope_position_ids", "get_packed_seq_q_cu_seqlens")
    return "needed"


def _apply(module: ModuleType) -> None:
    original = module.Qwen3VLModel.forward

    @functools.wraps(original)
    def forward(self, input_ids, position_ids=None, *args, packed_seq_params=None, **kwargs):
        cp_group = self.pg_collection.cp
        if not module._is_mrope_position_ids(position_ids) and module._is_packed_input_pre_sharded(
            input_ids, packed_seq_params, cp_size=cp_group.size()
        ):
            _, cu_seqlens = module.get_packed_seq_q_cu_seqlens(packed_seq_params)
            merge = int(round(self.square_merge_size**0.5))
            local = model_side_position_ids(
                input_ids[0],
                cu_seqlens,
                kwargs.get("image_grid_thw"),
                kwargs.get("video_grid_thw"),
                MediaTokens(merge, self.image_token_id, self.video_token_id),
                group=cp_group,
            )
            position_ids = local.unsqueeze(1)  # [3, 1, T/C]
        return original(self, input_ids, position_ids, *args, packed_seq_params=packed_seq_params, **kwargs)

    forward.__miles_vl_original__ = original
    module.Qwen3VLModel.forward = forward


# ---------------------------------------------------------------------------------------------------------------
# v06_mixed_media_row_order

_FULL_ROW: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("miles_vl_v06_row", default=None)


def reorganize_in_row_order(original: Callable, full_input_ids: torch.Tensor, *args, **kwargs):
    """Upstream's `reorganize_inputs(*args, **kwargs)` for a rank-local row, with the vision blocks ordered by the
    full row `full_input_ids` ([T]) instead of the local one. Returns (pixel rows [N, D] in natural order, grid rows
    [n, 3] in natural order, the rank-local vision mask [1, T/C]), as upstream returns for a full row."""
    bound = inspect.signature(original).bind(*args, **kwargs)
    bound.apply_defaults()
    arg = bound.arguments
    local_ids = arg["input_ids"]
    full = dict(arg, input_ids=full_input_ids.view(1, -1), image_input_mask=None, video_input_mask=None)
    values, grid, _ = original(**full)
    image_mask = arg["image_input_mask"]
    video_mask = arg["video_input_mask"]
    image_mask = local_ids == arg["image_token_id"] if image_mask is None else image_mask.bool()
    video_mask = local_ids == arg["video_token_id"] if video_mask is None else video_mask.bool()
    return values, grid, image_mask | video_mask


def rebind_reorganize_inputs(module: ModuleType, full_row: Callable[[], torch.Tensor | None]) -> None:
    """Rebind `module.reorganize_inputs` so that, where `full_row()` gives the current call's full row ([T]), the
    vision blocks are ordered by it (`reorganize_in_row_order`); where it gives None, upstream's runs untouched."""
    original = module.reorganize_inputs

    @functools.wraps(original)
    def reorganize_inputs(*args, **kwargs):
        row = full_row()
        if row is None:
            return original(*args, **kwargs)
        return reorganize_in_row_order(original, row, *args, **kwargs)

    reorganize_inputs.__miles_vl_original__ = original
    module.reorganize_inputs = reorganize_inputs


def _detect_mixed(module: ModuleType) -> str:
    if not hasattr(module, "_is_packed_input_pre_sharded"):
        return "native"  # 0.5.x: bridge_v05 covers it
    require(module, "Qwen3VLModel.forward", "reorganize_inputs", "get_packed_seq_q_cu_seqlens")
    return "needed"


def _apply_mixed(module: ModuleType) -> None:
    def full_row(model, arg: dict) -> torch.Tensor | None:
        """The full row [T] of a pre-sharded call with both modalities; None for every other call."""
        input_ids, psp = arg.get("input_ids"), arg.get("packed_seq_params")
        cp_group = model.pg_collection.cp
        if (
            arg.get("pixel_values") is None
            or arg.get("pixel_values_videos") is None
            or not module._is_packed_input_pre_sharded(input_ids, psp, cp_size=cp_group.size())
        ):
            return None
        _, cu_seqlens = module.get_packed_seq_q_cu_seqlens(psp)
        return gather_full_row(input_ids[0], cu_seqlens, cp_group)

    wrap_forward(module.Qwen3VLModel, _FULL_ROW, full_row)
    rebind_reorganize_inputs(module, _FULL_ROW.get)


PATCHES = [
    Patch(
        name="v06_positions_when_missing",
        summary="pre-sharded THD call without position_ids: rebuild rank-local per-segment MRoPE positions "
        "(one all-gather) instead of raising",
        detect=_detect,
        apply=_apply,
    ),
    Patch(
        name="v06_mixed_media_row_order",
        summary="images and videos in one pre-sharded micro-batch: reorganize_inputs orders vision blocks by "
        "scanning the local zigzag row (AssertionError): order them by the full row (one all-gather of the ids)",
        detect=_detect_mixed,
        apply=_apply_mixed,
    ),
]
