"""Qwen3-VL multimodal RoPE (MRoPE) positions, per segment, vectorized.

Every segment (one sample of a packed THD row) gets the positions that transformers'
`Qwen3VLModel.get_rope_index` gives that sample alone, starting at 0:

- a text token advances the position by 1 (all three rows equal);
- a vision block of grid `(t, h, w)` with spatial merge `m` is `t * (h/m) * (w/m)` tokens whose rows are the
  temporal, height and width indices of the token in the merged grid, each offset by the position `s` of the block;
- the next token after the block starts at `s + max(h, w) / m` (transformers' rule; equal to the block's
  maximum + 1 for every grid Qwen3-VL produces, where `t = 1` per block);
- a video grid row `(t, h, w)` is `t` blocks of `(1, h, w)`: Qwen3-VL separates frame groups by timestamp text.

A vision block is a maximal run of image (or video) tokens inside one segment and before that segment's
`media_end`; tokens after `media_end` (e.g. `<|image_pad|>` sampled by the policy) are text. Runs take the grid
rows of their modality in order. Everything is computed with tensor ops over the whole row: no Python loop over
tokens or segments, only a few host reads of per-run aggregates for validation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import BoolTensor, LongTensor, Tensor

IMAGE, VIDEO = 1, 2


@dataclass(frozen=True)
class MediaTokens:
    """How a row's media tokens map onto its grid rows: which ids are media, and the vision tower's spatial merge `m`
    (a grid row `(t, h, w)` stands for `t * (h/m) * (w/m)` tokens)."""

    spatial_merge_size: int  # 2 for Qwen3-VL
    image_token_id: int  # `<|image_pad|>`
    video_token_id: int  # `<|video_pad|>`


def get_rope_index(
    input_ids: LongTensor,
    image_grid_thw: LongTensor | None = None,
    video_grid_thw: LongTensor | None = None,
    *,
    spatial_merge_size: int,
    image_token_id: int,
    video_token_id: int,
    vision_start_token_id: int,
    media_end: int | None = None,
) -> LongTensor:
    """MRoPE positions of one unpacked Qwen3-VL sample.

    Args:
        input_ids: LongTensor[L], image/video tokens already expanded (as the processor returns them).
        image_grid_thw: LongTensor[n_images, 3] of this sample, in order, or None.
        video_grid_thw: LongTensor[n_videos, 3] of this sample (unsplit; rows are expanded by `t` here), or None.
        spatial_merge_size: the vision tower's spatial merge (2 for Qwen3-VL).
        image_token_id, video_token_id: ids of `<|image_pad|>` and `<|video_pad|>`.
        vision_start_token_id: id of `<|vision_start|>`; accepted for signature parity with megatron-bridge.
            Blocks are found as runs of media tokens, as transformers does.
        media_end: media tokens at index >= media_end are text (the prompt ends there). None: the whole sample.

    Returns:
        LongTensor[3, L] (temporal, height, width rows), on `input_ids.device`.

    Raises:
        ValueError: the media runs do not match the grid rows (count or size), or a grid is not divisible by the merge.
    """
    del vision_start_token_id  # blocks are runs of media tokens; see the docstring
    length = input_ids.shape[-1]
    if input_ids.dim() != 1:
        raise ValueError(
            f"get_rope_index takes one unpacked sample, input_ids [L]; found shape {tuple(input_ids.shape)}"
        )
    cu_seqlens = torch.tensor([0, length], dtype=torch.int32, device=input_ids.device)
    ends = None if media_end is None else [media_end]
    media = MediaTokens(spatial_merge_size, image_token_id, video_token_id)
    return packed_position_ids(input_ids, cu_seqlens, image_grid_thw, video_grid_thw, media, media_ends=ends)


def packed_position_ids(
    input_ids: LongTensor,
    cu_seqlens: Tensor,
    image_grid_thw: LongTensor | None,
    video_grid_thw: LongTensor | None,
    media: MediaTokens,
    *,
    media_ends: list[int] | Tensor | None = None,
    grid_rows_per_segment: tuple[list[int], list[int]] | None = None,
    return_media_mask: bool = False,
    segment_label: str = "segment",
) -> LongTensor | tuple[LongTensor, BoolTensor]:
    """Per-segment MRoPE positions of a full THD row (each segment starts at 0).

    Args:
        input_ids: LongTensor[T], the full row.
        cu_seqlens: [n_seg + 1] segment boundaries of the row (`cu_seqlens[-1] == T`).
        image_grid_thw: LongTensor[n_images, 3], all segments' image grids in row order, or None.
        video_grid_thw: LongTensor[n_videos, 3], all segments' video grids in row order (unsplit), or None.
        media: the media token ids and the spatial merge.
        media_ends: per segment, the segment-relative index from which media tokens are text; None = no limit.
        grid_rows_per_segment: optional (images, videos) grid-row counts per segment (after video expansion is
            NOT applied: count original video rows). When given, each segment's runs are checked against its own
            rows, so that a mismatch is reported for the segment that has it.
        return_media_mask: also return the BoolTensor[T] of media tokens before their segment's media_end (the
            vision mask), computed on the way.
        segment_label: what errors call a segment (pack_thd says "sample": its segments are the samples).

    Returns:
        LongTensor[3, T], or (positions, media mask) with `return_media_mask`.

    Raises:
        ValueError: media runs and grid rows disagree, or grids are not divisible by the merge size.
    """
    device = input_ids.device
    total = input_ids.shape[0]
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    if int(cu[-1]) != total:
        raise ValueError(f"cu_seqlens[-1]={int(cu[-1])} does not match the row length {total}")
    seg_lens = cu[1:] - cu[:-1]
    n_seg = seg_lens.numel()
    pos_in_seg = torch.arange(total, device=device) - torch.repeat_interleave(cu[:-1], seg_lens, output_size=total)

    is_image, is_video = input_ids == media.image_token_id, input_ids == media.video_token_id
    if media_ends is not None:
        ends = torch.as_tensor(media_ends, dtype=torch.long, device=device)
        if ends.numel() != n_seg:
            raise ValueError(f"media_ends has {ends.numel()} entries for {n_seg} segments")
        in_prompt = pos_in_seg < torch.repeat_interleave(ends, seg_lens, output_size=total)
        is_image, is_video = is_image & in_prompt, is_video & in_prompt
    modality = is_image.long() + VIDEO * is_video.long()  # 0 text, 1 image, 2 video
    is_media = modality > 0

    # A run (vision block) starts where the modality changes to a media one, or at a segment start.
    prev_modality = torch.cat([modality.new_zeros(1), modality[:-1]])
    run_start = is_media & ((modality != prev_modality) | (pos_in_seg == 0))
    run_start_idx = run_start.nonzero().squeeze(1)  # [R]
    n_runs = run_start_idx.numel()
    run_modality = modality[run_start_idx]  # [R]
    if grid_rows_per_segment is not None:
        run_segment = torch.searchsorted(cu, run_start_idx, right=True) - 1
        _check_rows_per_segment(run_modality, run_segment, grid_rows_per_segment, video_grid_thw, n_seg, segment_label)
    grid = _grids_for_runs(run_modality, image_grid_thw, video_grid_thw, media.spatial_merge_size, device)  # [R, 3]

    positions = torch.empty(3, total, dtype=torch.long, device=device)
    if not n_runs:
        positions[:] = pos_in_seg
        return (positions, is_media) if return_media_mask else positions
    media_idx = is_media.nonzero().squeeze(1)  # [M]
    run_id = torch.cumsum(run_start.long(), 0)[media_idx] - 1  # [M] run of each media token
    run_len = torch.bincount(run_id, minlength=n_runs)  # [R]
    expected = grid.prod(dim=1)
    if not torch.equal(run_len, expected):
        bad = int((run_len != expected).nonzero()[0, 0])
        seg = int(torch.searchsorted(cu, run_start_idx[bad : bad + 1], right=True)[0]) - 1
        kind = "image" if int(run_modality[bad]) == IMAGE else "video frame"
        raise ValueError(
            f"vision block {bad} ({kind}) in {segment_label} {seg} at offset {int(run_start_idx[bad] - cu[seg])} has "
            f"{int(run_len[bad])} media tokens, but its grid row gives t*(h/m)*(w/m) = {int(expected[bad])}; the grid "
            "rows must be the ones the processor returned for these ids, in order"
        )

    # Position base of every token: text tokens before it in its segment + advances of the blocks that ended
    # before it. A block advances by max(h, w) / m, counted at its last token.
    step = (~is_media).long()
    step[run_start_idx + run_len - 1] = torch.maximum(grid[:, 1], grid[:, 2])
    exclusive = torch.cumsum(step, 0) - step
    starts = cu[:-1].clamp(max=total - 1)  # zero-length segments own no token; any index will do
    base = exclusive - torch.repeat_interleave(exclusive[starts], seg_lens, output_size=total)  # [T]

    positions[:] = base
    offset = media_idx - run_start_idx[run_id]  # [M] index inside the block
    hh, ww = grid[run_id, 1], grid[run_id, 2]
    hw_index = offset % (hh * ww)  # index inside one temporal slice
    positions[:, media_idx] = base[media_idx] + torch.stack([offset // (hh * ww), hw_index // ww, hw_index % ww])
    return (positions, is_media) if return_media_mask else positions


def _grids_for_runs(
    run_modality: Tensor,
    image_grid_thw: Tensor | None,
    video_grid_thw: Tensor | None,
    merge: int,
    device: torch.device,
) -> Tensor:
    """Merged grid `(t, h/m, w/m)` of every run, taking each modality's rows in order. Returns LongTensor[R, 3]."""
    n_image_runs = int((run_modality == IMAGE).sum())
    found = {IMAGE: n_image_runs, VIDEO: run_modality.numel() - n_image_runs}
    parts = {}
    for kind, name, rows in (
        (IMAGE, "image_grid_thw", image_grid_thw),
        (VIDEO, "video_grid_thw", _split_video_rows(video_grid_thw)),
    ):
        n_rows = 0 if rows is None else rows.shape[0]
        if rows is not None and (rows.dim() != 2 or rows.shape[1] != 3):
            raise ValueError(f"{name} must be [n, 3] (t, h, w); found shape {tuple(rows.shape)}")
        if found[kind] != n_rows:
            tokens = "<|image_pad|>" if kind == IMAGE else "<|video_pad|> frame"
            what = f"{name} has {n_rows} rows" + (" (after splitting videos into frames)" if kind == VIDEO else "")
            raise ValueError(
                f"{what}, but the ids contain {found[kind]} {tokens} blocks before media_end; pass the grids the "
                "processor returned with these ids (and media_end = prompt length if the response has media tokens)"
            )
        if n_rows:
            parts[kind] = rows.to(device=device, dtype=torch.long)
    if not parts:
        return torch.zeros(0, 3, dtype=torch.long, device=device)
    if len(parts) == 1:  # one modality: its rows are the runs' grids in order
        grid = next(iter(parts.values())).clone()
    else:
        grid = torch.empty(run_modality.numel(), 3, dtype=torch.long, device=device)
        for kind, rows in parts.items():
            grid[run_modality == kind] = rows
    if bool((grid[:, 1:] % merge != 0).any()):
        raise ValueError(
            f"grid rows {grid.tolist()} have h or w not divisible by spatial_merge_size={merge}; "
            "pass the processor's grids"
        )
    grid[:, 1:] //= merge
    return grid


def _split_video_rows(video_grid_thw: Tensor | None) -> Tensor | None:
    """Qwen3-VL: a video row (t, h, w) is t frame groups (1, h, w), separated by timestamp text."""
    if video_grid_thw is None or video_grid_thw.numel() == 0:
        return video_grid_thw
    rows = torch.repeat_interleave(video_grid_thw, video_grid_thw[:, 0], dim=0).clone()
    rows[:, 0] = 1
    return rows


def _check_rows_per_segment(
    run_modality: Tensor,
    run_segment: Tensor,
    rows_per_segment: tuple[list[int], list[int]],
    video_grid_thw: Tensor | None,
    n_seg: int,
    segment_label: str,
) -> None:
    images, videos = rows_per_segment
    found_images = torch.bincount(run_segment[run_modality == IMAGE], minlength=n_seg).tolist()
    found_frames = torch.bincount(run_segment[run_modality == VIDEO], minlength=n_seg).tolist()
    frames_per_video = [] if video_grid_thw is None else video_grid_thw[:, 0].tolist()
    start = 0
    for s in range(n_seg):
        want_frames = sum(frames_per_video[start : start + videos[s]])
        start += videos[s]
        if found_images[s] != images[s] or found_frames[s] != want_frames:
            raise ValueError(
                f"{segment_label} {s}: its ids contain {found_images[s]} image blocks and {found_frames[s]} video "
                f"frame blocks before media_end, but it has {images[s]} image grid rows and {want_frames} video frames "
                f"({videos[s]} video rows); each sample's grids must match its own media tokens"
            )
