"""Model-side reconstruction for callers that hold only their CP rank's zigzag shard.

The data side (`PackedBatch.shard`) computes positions and the vision index from the full row with no
collective; that is the default. A model that receives only its local row (and the full row's `cu_seqlens`)
can rebuild the same values:

- `gather_full_row`: all-gather the local rows over the CP group and invert the zigzag;
- `model_side_position_ids`: recompute per-segment MRoPE positions on the rebuilt row, re-slice this rank's part;
- `count_based_vision_index`: all-gather per-chunk vision-token counts and prefix-sum them (megatron-bridge 0.6's
  method), giving each local vision token its index in the natural order of the row's vision tokens.

Both must equal the data-side results (tests/packing/test_distributed.py checks it over gloo).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import LongTensor, Tensor

from miles_vl.models.qwen3_vl.rope import MediaTokens, packed_position_ids
from miles_vl.packing.zigzag import segment_lengths, unzigzag, zigzag_index


def gather_full_row(local: Tensor, cu_seqlens: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """All-gather `local` ([T/C] or [..., T/C], sequence last) over the CP group and undo the zigzag -> [..., T]."""
    cp_size = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(cp_size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return unzigzag(parts, cu_seqlens, cp_size, dim=-1)


def model_side_position_ids(
    local_input_ids: LongTensor,
    cu_seqlens: Tensor,
    image_grid_thw: LongTensor | None,
    video_grid_thw: LongTensor | None,
    media: MediaTokens,
    *,
    media_ends: list[int] | None = None,
    group: dist.ProcessGroup | None = None,
) -> LongTensor:
    """Rank-local MRoPE positions `[3, T/C]` rebuilt from the local row alone (one all-gather).

    Args:
        local_input_ids: LongTensor[T/C], this rank's zigzag shard.
        cu_seqlens: [n_seg + 1] of the full row.
        image_grid_thw, video_grid_thw: the grids of the whole micro-batch, in row order.
        media: the media token ids and the spatial merge.
        media_ends: per segment, where its prompt ends (media tokens after it are text); None: no limit.
        group: the CP process group.
    """
    cp_size = dist.get_world_size(group)
    cp_rank = dist.get_rank(group)
    full_ids = gather_full_row(local_input_ids, cu_seqlens, group)
    positions = packed_position_ids(full_ids, cu_seqlens, image_grid_thw, video_grid_thw, media, media_ends=media_ends)
    return positions[:, zigzag_index(cu_seqlens, cp_size, cp_rank).to(positions.device)]


def count_based_vision_index(
    local_vision_mask: Tensor, cu_seqlens: Tensor, group: dist.ProcessGroup | None = None
) -> LongTensor:
    """Index of every local vision token in the natural order of all vision tokens of the full row.

    Each rank counts its vision tokens per owned chunk (chunks r and 2C-1-r of every segment), the counts are
    all-gathered into the full row's chunk order, and an exclusive prefix sum gives each chunk's first index.

    Args:
        local_vision_mask: BoolTensor[T/C], this rank's shard of the vision mask.
        cu_seqlens: [n_seg + 1] of the full row.
        group: the CP process group.

    Returns:
        LongTensor[n_local_vision].
    """
    cp_size = dist.get_world_size(group)
    cp_rank = dist.get_rank(group)
    lens = segment_lengths(cu_seqlens, cp_size).to(local_vision_mask.device)
    chunk = lens // (2 * cp_size)  # [n_seg]
    n_seg = lens.numel()
    mask = local_vision_mask.reshape(-1).long()
    # Local chunk k (0..2*n_seg-1) is (segment k // 2, first or second half of the segment's local part).
    local_chunk_len = chunk.repeat_interleave(2)  # [2 n_seg]
    local_chunk_id = torch.repeat_interleave(torch.arange(2 * n_seg, device=mask.device), local_chunk_len)
    counts = torch.zeros(2 * n_seg, dtype=torch.long, device=mask.device)
    counts.index_add_(0, local_chunk_id, mask)
    gathered = [torch.empty_like(counts) for _ in range(cp_size)]
    dist.all_gather(gathered, counts, group=group)

    # Full-row chunk order per segment: chunk j in 0..2C-1 belongs to rank j (first half) or 2C-1-j (second half).
    by_rank = torch.stack(gathered).view(cp_size, n_seg, 2)  # [C, n_seg, 2]
    full_order = torch.cat([by_rank[:, :, 0], by_rank[:, :, 1].flip(0)], dim=0)  # [2C, n_seg]: row j = chunk j
    per_chunk = full_order.t().reshape(-1)  # [n_seg * 2C] in row order
    chunk_start = torch.cumsum(per_chunk, 0) - per_chunk  # exclusive prefix sum
    starts = chunk_start.view(n_seg, 2 * cp_size)
    mine = torch.stack([starts[:, cp_rank], starts[:, 2 * cp_size - 1 - cp_rank]], dim=1).reshape(-1)  # [2 n_seg]

    within = torch.cumsum(mask, 0) - mask  # exclusive count of vision tokens before each local token
    chunk_first = torch.cumsum(local_chunk_len, 0) - local_chunk_len  # local offset of each local chunk
    within_chunk = within - (within[chunk_first.clamp(max=max(mask.numel() - 1, 0))])[local_chunk_id]
    index = mine[local_chunk_id] + within_chunk
    return index[mask.bool()]
