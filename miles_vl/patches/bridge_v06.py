"""megatron-bridge >= 0.6: positions for pre-sharded THD calls that pass none.

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
"""

from __future__ import annotations

import functools
from types import ModuleType

from miles_vl.packing.distributed import model_side_position_ids
from miles_vl.patches.core import Patch, require


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
                spatial_merge_size=merge,
                image_token_id=self.image_token_id,
                video_token_id=self.video_token_id,
                group=cp_group,
            )
            position_ids = local.unsqueeze(1)  # [3, 1, T/C]
        return original(self, input_ids, position_ids, *args, packed_seq_params=packed_seq_params, **kwargs)

    forward.__miles_vl_original__ = original
    module.Qwen3VLModel.forward = forward


PATCHES = [
    Patch(
        name="v06_positions_when_missing",
        summary="pre-sharded THD call without position_ids: rebuild rank-local per-segment MRoPE positions "
        "(one all-gather) instead of raising",
        detect=_detect,
        apply=_apply,
    )
]
