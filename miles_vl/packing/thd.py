"""THD packing: several samples in one row, each padded to a multiple of 2*cp_size, with per-segment positions.

    batch = pack_thd(samples, cp_size=2, pad_token_id=pad, spatial_merge_size=2, image_token_id=...,
                     video_token_id=..., vision_start_token_id=...)
    shard = batch.shard(cp_rank)      # what one CP rank feeds the model: [1, T/C] ids, [3, 1, T/C] positions, ...

Layout (DESIGN §4): sample `i` of length `L_i` is right-padded with `pad_token_id` (loss 0) to
`P_i = ceil(L_i / 2C) * 2C`; with `tp_size > 1` (sequence parallelism) or `align > 1` one trailing pad segment,
itself a multiple of 2C, makes the local row length `T / C` a multiple of `lcm(tp_size, align)`.
`cu_seqlens` (int32) covers every segment, the trailing one included; `seq_lens` holds the unpadded lengths of the
samples only. Positions are each sample's own Qwen3-VL MRoPE positions (pads continue the text positions).
Only the prompt span (`prompt_len`) counts media: vision tokens a policy generated are text.

Next-token targets are laid out on the full row before sharding, because in a zigzag shard the next token of a
local position can live on another rank: `labels[j]` is the token that logits at `j` predict (the next token of
the same segment) and `label_mask[j]` is the loss mask of that next token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import BoolTensor, LongTensor, Tensor

from miles_vl.models.qwen3_vl.rope import MediaTokens, packed_position_ids
from miles_vl.packing.zigzag import zigzag_index


class PackableSample(Protocol):
    """What `pack_thd` reads from a sample (any object with these attributes)."""

    input_ids: LongTensor  # [L], prompt then response
    image_grid_thw: LongTensor | None  # [n_images, 3]
    video_grid_thw: LongTensor | None  # [n_videos, 3]
    prompt_len: int


@dataclass(frozen=True)
class LocalShard:
    """One CP rank's part of a packed row, shaped as megatron's Qwen3VLModel takes pre-sharded THD input."""

    cp_rank: int
    cp_size: int
    input_ids: LongTensor  # [1, T/C]
    position_ids: LongTensor  # [3, 1, T/C]
    loss_mask: LongTensor  # [1, T/C]
    vision_mask: BoolTensor  # [1, T/C]
    labels: LongTensor  # [1, T/C] next-token targets (from the full row)
    label_mask: LongTensor  # [1, T/C] loss mask of those targets
    sample_index: LongTensor  # [1, T/C] sample of each token; -1 on the trailing alignment segment
    vision_embed_index: LongTensor  # [n_local_vision] index of each local vision token among all vision tokens
    cu_seqlens: Tensor  # [n_seg + 1] int32, the FULL row's (as megatron/TE expect with CP)
    full_index: LongTensor  # [T/C] full-row position of each local token (the zigzag index)


@dataclass(frozen=True)
class PackedBatch:
    """A full THD row of packed samples (one micro-batch of one CP group)."""

    input_ids: LongTensor  # [T]
    position_ids: LongTensor  # [3, T]
    cu_seqlens: Tensor  # [n_seg + 1] int32; n_seg = n samples (+ 1 trailing alignment segment if any)
    seq_lens: LongTensor  # [n] unpadded sample lengths
    prompt_lens: LongTensor  # [n]
    loss_mask: LongTensor  # [T] 1 on response tokens (or the sample's own loss_mask), 0 on prompt and pads
    vision_mask: BoolTensor  # [T] media tokens inside prompt spans
    labels: LongTensor  # [T] next token of the same segment (pad_token_id at segment ends)
    label_mask: LongTensor  # [T] loss_mask of that next token (0 at segment ends)
    sample_index: LongTensor  # [T] sample of each token, -1 on the trailing alignment segment
    image_grid_thw: LongTensor | None  # [n_images, 3] in sample order
    video_grid_thw: LongTensor | None  # [n_videos, 3] in sample order
    images_per_sample: list[int]
    videos_per_sample: list[int]
    cp_size: int
    tp_size: int

    @property
    def num_samples(self) -> int:
        return self.seq_lens.numel()

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_padding(self) -> int:
        return self.num_tokens - int(self.seq_lens.sum())

    def shard(self, cp_rank: int) -> LocalShard:
        """This rank's zigzag part of every per-token tensor, plus its CP-local vision embedding index."""
        idx = zigzag_index(self.cu_seqlens, self.cp_size, cp_rank)  # [T/C]
        natural = torch.cumsum(self.vision_mask.long(), 0) - 1  # [T] index among all vision tokens of the row
        local_vision = self.vision_mask[idx]
        return LocalShard(
            cp_rank=cp_rank,
            cp_size=self.cp_size,
            input_ids=self.input_ids[idx].unsqueeze(0),
            position_ids=self.position_ids[:, idx].unsqueeze(1),
            loss_mask=self.loss_mask[idx].unsqueeze(0),
            vision_mask=local_vision.unsqueeze(0),
            labels=self.labels[idx].unsqueeze(0),
            label_mask=self.label_mask[idx].unsqueeze(0),
            sample_index=self.sample_index[idx].unsqueeze(0),
            vision_embed_index=natural[idx][local_vision],
            cu_seqlens=self.cu_seqlens,
            full_index=idx,
        )


def cat_present(parts: Sequence[Tensor | None]) -> Tensor | None:
    """The tensors that are present and not empty, concatenated along dim 0 (e.g. the pixel values of a micro-batch's
    samples, in row order as their grids); None when there are none."""
    present = [p for p in parts if p is not None and p.numel()]
    return torch.cat(present) if present else None


def padded_length(length: int, cp_size: int) -> int:
    """`ceil(length / 2C) * 2C`: the length a sample occupies in a THD row at context parallel size C."""
    unit = 2 * cp_size
    return -(-length // unit) * unit


def pack_thd(
    samples: Sequence[PackableSample],
    *,
    cp_size: int = 1,
    tp_size: int = 1,
    pad_token_id: int,
    spatial_merge_size: int,
    image_token_id: int,
    video_token_id: int,
    vision_start_token_id: int,
    align: int = 1,
) -> PackedBatch:
    """Pack `samples` into one THD row (DESIGN §4).

    Args:
        samples: objects with `input_ids` LongTensor[L], `image_grid_thw` LongTensor[n, 3] | None,
            `video_grid_thw` LongTensor[m, 3] | None, `prompt_len` int and optionally `loss_mask` LongTensor[L].
        cp_size: context-parallel size C; every segment becomes a multiple of 2C.
        tp_size: tensor-parallel size when sequence parallelism is on (else 1): the local row is padded to a
            multiple of it with one trailing pad segment.
        pad_token_id: id used for padding (must not be a media token).
        spatial_merge_size, image_token_id, video_token_id, vision_start_token_id: as in `get_rope_index`.
        align: extra alignment of the local row length (e.g. 8 for kernels that want it).

    Returns:
        PackedBatch with the full row; `.shard(r)` gives rank r's part.

    Raises:
        ValueError: no samples, a bad prompt_len or loss_mask, a pad id that is a media token, or grids that do not
            match a sample's media tokens (names the sample).
    """
    if not samples:
        raise ValueError("pack_thd needs at least one sample")
    if cp_size < 1 or tp_size < 1 or align < 1:
        raise ValueError(f"cp_size, tp_size and align must be >= 1; found {cp_size}, {tp_size}, {align}")
    if pad_token_id in (image_token_id, video_token_id):
        raise ValueError(f"pad_token_id={pad_token_id} is a media token id; use the tokenizer's pad or eos id")

    ids, loss, prompt_lens, seq_lens, padded = [], [], [], [], []
    images, videos, n_images, n_videos = [], [], [], []
    for i, s in enumerate(samples):
        x = torch.as_tensor(s.input_ids).to(torch.long).reshape(-1)
        length = x.numel()
        if length == 0:
            raise ValueError(f"sample {i} has no tokens")
        if not 0 <= s.prompt_len <= length:
            raise ValueError(f"sample {i}: prompt_len={s.prompt_len} is outside [0, {length}]")
        mask = getattr(s, "loss_mask", None)
        if mask is None:
            mask = (torch.arange(length) >= s.prompt_len).long()
        else:
            mask = torch.as_tensor(mask).to(torch.long).reshape(-1)
            if mask.numel() != length:
                raise ValueError(f"sample {i}: loss_mask has {mask.numel()} entries for {length} tokens")
        p = padded_length(length, cp_size)
        ids.append(torch.cat([x, x.new_full((p - length,), pad_token_id)]))
        loss.append(torch.cat([mask, mask.new_zeros(p - length)]))
        prompt_lens.append(s.prompt_len)
        seq_lens.append(length)
        padded.append(p)
        for grids, store, counts in ((s.image_grid_thw, images, n_images), (s.video_grid_thw, videos, n_videos)):
            grids = None if grids is None else torch.as_tensor(grids).to(torch.long).reshape(-1, 3)
            counts.append(0 if grids is None else grids.shape[0])
            if grids is not None and grids.numel():
                store.append(grids)

    trailing = _trailing_pad(sum(padded), cp_size, math.lcm(tp_size, align))
    media_ends = list(prompt_lens)
    if trailing:
        ids.append(torch.full((trailing,), pad_token_id, dtype=torch.long))
        loss.append(torch.zeros(trailing, dtype=torch.long))
        padded.append(trailing)
        media_ends.append(0)
        n_images.append(0)
        n_videos.append(0)

    input_ids = torch.cat(ids)
    loss_mask = torch.cat(loss)
    cu = torch.zeros(len(padded) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(padded), 0)
    image_grid_thw = torch.cat(images) if images else None
    video_grid_thw = torch.cat(videos) if videos else None
    position_ids, vision_mask = packed_position_ids(
        input_ids,
        cu,
        image_grid_thw,
        video_grid_thw,
        MediaTokens(spatial_merge_size, image_token_id, video_token_id),
        media_ends=media_ends,
        grid_rows_per_segment=(n_images, n_videos),
        return_media_mask=True,
        segment_label="sample",
    )

    seg_lens = cu[1:].long() - cu[:-1].long()
    seg_id = torch.repeat_interleave(torch.arange(len(padded)), seg_lens)  # [T]
    sample_index = seg_id.clone()
    if trailing:
        sample_index[seg_id == len(samples)] = -1

    last_of_segment = torch.zeros_like(input_ids, dtype=torch.bool)
    last_of_segment[cu[1:].long() - 1] = True
    labels = torch.cat([input_ids[1:], input_ids.new_full((1,), pad_token_id)])
    labels[last_of_segment] = pad_token_id
    label_mask = torch.cat([loss_mask[1:], loss_mask.new_zeros(1)])
    label_mask[last_of_segment] = 0

    return PackedBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        cu_seqlens=cu,
        seq_lens=torch.tensor(seq_lens),
        prompt_lens=torch.tensor(prompt_lens),
        loss_mask=loss_mask,
        vision_mask=vision_mask,
        labels=labels,
        label_mask=label_mask,
        sample_index=sample_index,
        image_grid_thw=image_grid_thw,
        video_grid_thw=video_grid_thw,
        images_per_sample=n_images[: len(samples)],
        videos_per_sample=n_videos[: len(samples)],
        cp_size=cp_size,
        tp_size=tp_size,
    )


def _trailing_pad(total: int, cp_size: int, multiple: int) -> int:
    """Smallest multiple of 2C to append so that the local row (total + pad) / C is a multiple of `multiple`."""
    for k in range(multiple):
        if ((total + 2 * cp_size * k) // cp_size) % multiple == 0:
            return 2 * cp_size * k
    raise AssertionError("unreachable: (total/C + 2k) mod m takes every residue reachable within m steps")
