"""THD packing, the zigzag CP layout, per-segment Qwen3-VL MRoPE and the CP-local vision index (pure torch).

Public API (DESIGN §4; outside checks call these names):
    get_rope_index(input_ids, image_grid_thw, video_grid_thw, *, spatial_merge_size, image_token_id,
                   video_token_id, vision_start_token_id, media_end=None) -> LongTensor[3, L]
    zigzag_index(cu_seqlens, cp_size, cp_rank) -> LongTensor[T / cp_size]
    unzigzag(local_rows, cu_seqlens, cp_size, dim=-1) -> Tensor
    pack_thd(samples, *, cp_size, tp_size, pad_token_id, ...) -> PackedBatch;  PackedBatch.shard(r) -> LocalShard
"""

from miles_vl.models.qwen3_vl.rope import MediaTokens, get_rope_index, packed_position_ids
from miles_vl.packing.plan import plan_micro_batches
from miles_vl.packing.thd import LocalShard, PackedBatch, cat_present, pack_thd, padded_length
from miles_vl.packing.zigzag import detect_layout, unzigzag, zigzag_index

__all__ = [
    "LocalShard",
    "MediaTokens",
    "PackedBatch",
    "cat_present",
    "detect_layout",
    "get_rope_index",
    "pack_thd",
    "packed_position_ids",
    "padded_length",
    "plan_micro_batches",
    "unzigzag",
    "zigzag_index",
]
