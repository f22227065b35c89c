"""The zigzag context-parallel layout of a THD row, exactly as Transformer Engine partitions it.

Every segment `i` of the full row has a length `P_i` divisible by `2C` (C = cp_size) and is cut into `2C` chunks
of `c_i = P_i / (2C)` tokens. Rank `r` owns chunks `r` and `2C-1-r` of every segment, in that order, so that each
rank gets an equal share of early (cheap) and late (expensive) causal-attention work. Segment `i` starts at local
offset `cu_i / C`; the local row has `cu[-1] / C` tokens. `C = 1` is the identity.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import LongTensor, Tensor


def segment_lengths(cu_seqlens: Tensor, cp_size: int) -> LongTensor:
    """Segment lengths `[n_seg]` of a row, checked to be divisible by `2 * cp_size`.

    Raises:
        ValueError: cp_size < 1, cu_seqlens not increasing from 0, or a segment not divisible by 2*cp_size.
    """
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, found {cp_size}")
    cu = torch.as_tensor(cu_seqlens).to(torch.long)
    if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens must be a 1-D tensor starting at 0, found {cu.tolist()}")
    lens = cu[1:] - cu[:-1]
    if bool((lens < 0).any()):
        raise ValueError(f"cu_seqlens must be non-decreasing, found {cu.tolist()}")
    bad = (lens % (2 * cp_size)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(
            f"segment {i} has length {int(lens[i])}, not divisible by 2*cp_size = {2 * cp_size}: pad every segment "
            f"to a multiple of 2*cp_size (pack_thd does) before sharding (cu_seqlens={cu.tolist()})"
        )
    return lens


def zigzag_index(cu_seqlens: Tensor, cp_size: int, cp_rank: int) -> LongTensor:
    """Full-row positions owned by `cp_rank`, in local order.

    Args:
        cu_seqlens: [n_seg + 1] boundaries of the full row (int32 or int64); every segment divisible by 2*cp_size.
        cp_size: context-parallel size C.
        cp_rank: this rank, 0 <= cp_rank < C.

    Returns:
        LongTensor[cu_seqlens[-1] // cp_size]: for each local token, its index in the full row.

    Raises:
        ValueError: indivisible segment (names it), or cp_rank out of range.
    """
    lens = segment_lengths(cu_seqlens, cp_size)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), found {cp_rank}")
    cu = torch.as_tensor(cu_seqlens).to(torch.long)
    n_local = int(cu[-1]) // cp_size
    chunk = lens // (2 * cp_size)  # [n_seg]
    # Each local chunk k (two per segment) is a contiguous run of the full row: local position l maps to
    # l + shift[k]. The first chunk of segment i is full chunk r, the second full chunk 2C-1-r.
    local_start = cu[:-1] // cp_size
    first = cu[:-1] + cp_rank * chunk - local_start
    second = cu[:-1] + (2 * cp_size - 1 - cp_rank) * chunk - (local_start + chunk)
    shift = torch.stack([first, second], dim=1).reshape(-1)  # [2 n_seg]
    return torch.arange(n_local) + torch.repeat_interleave(shift, chunk.repeat_interleave(2), output_size=n_local)


def unzigzag(local_rows: Sequence[Tensor], cu_seqlens: Tensor, cp_size: int, dim: int = -1) -> Tensor:
    """Inverse of the zigzag split: `cp_size` local tensors (rank order) -> the full-row tensor.

    Args:
        local_rows: one tensor per rank, each with `cu_seqlens[-1] // cp_size` entries along `dim`.
        cu_seqlens: [n_seg + 1] of the full row.
        cp_size: C.
        dim: the sequence dimension.

    Raises:
        ValueError: wrong number of local tensors or a wrong local length.
    """
    if len(local_rows) != cp_size:
        raise ValueError(f"unzigzag needs one local tensor per CP rank: {cp_size} expected, {len(local_rows)} found")
    total = int(torch.as_tensor(cu_seqlens)[-1])
    for r, part in enumerate(local_rows):
        if part.shape[dim] != total // cp_size:
            raise ValueError(
                f"local tensor of rank {r} has {part.shape[dim]} entries along dim {dim}; the row of {total} tokens "
                f"split over cp_size={cp_size} gives {total // cp_size}"
            )
    first = local_rows[0]
    shape = list(first.shape)
    shape[dim] = total
    full = first.new_empty(shape)
    for r, part in enumerate(local_rows):
        full.index_copy_(dim % first.dim(), zigzag_index(cu_seqlens, cp_size, r).to(first.device), part)
    return full


def detect_layout(seq_len: int, cu_seqlens: Tensor, cp_size: int) -> Literal["full", "pre_sharded"]:
    """Whether a row of `seq_len` tokens is the full row of `cu_seqlens` or one rank's zigzag shard of it.

    With cp_size 1 both agree and the answer is "full".

    Raises:
        ValueError: the length fits neither layout.
    """
    total = int(torch.as_tensor(cu_seqlens)[-1])
    if seq_len == total:
        return "full"
    if cp_size > 1 and seq_len * cp_size == total:
        return "pre_sharded"
    raise ValueError(
        f"a THD row of {seq_len} tokens is neither the full row described by cu_seqlens ({total} tokens) nor a "
        f"pre-sharded CP rank's part of it ({total} / cp_size {cp_size} = {total / cp_size:g} tokens); pass the "
        "full row's cu_seqlens together with either the full row or this rank's zigzag shard"
    )
