"""The vision tower run once per distinct image of a call, not once per use (`train.vision_once_per_image`).

    distinct = distinct_images(pixel_values, grid_thw, merge_size)   # None: no image repeats, nothing to save
    embeds = tower(distinct.pixel_values, distinct.grid_thw)          # [sum of distinct t*h*w / merge^2, H]
    embeds = distinct.expand(embeds)                                  # every use's rows, in the call's order

The n samples of one GRPO prompt carry the same images, so a micro-batch of them holds each image n times. The tower
treats the rows of `grid_thw` (images, or videos) independently (attention within a frame, position embeddings from
the row's own grid), so the output of a repeated row equals its first occurrence's: running it once and reading its
output at every use gives the same embeddings, and the gradient of a weight is the sum over the uses (what the
`index_select` in `expand` back-propagates), the same as n separate runs up to the order of the summation.

Rows are the same image when their grids are equal and their patches are bit-equal (`torch.equal`); a fingerprint of
each row (two sums, one device-to-host copy for the whole call) picks the candidate, so every row is compared with at
most one earlier row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class DistinctImages:
    """The distinct rows of a call's images and, for every row of the call, which distinct row it uses."""

    pixel_values: Tensor  # [sum of distinct t*h*w, C*T*P*P] the distinct rows' patches, first occurrence order
    grid_thw: Tensor  # [k, 3] their grids
    uses: list[int]  # [n] the distinct row (index into grid_thw) of each of the call's rows
    output_rows: list[int]  # [k] tower output rows of each distinct row (t*h*w / merge^2)

    def expand(self, embeds: Tensor) -> Tensor:
        """[rows of the distinct images, ...] -> the same for every row of the call, in its order (differentiable:
        the gradient of a distinct row is the sum over its uses)."""
        starts = [0]
        for n in self.output_rows:
            starts.append(starts[-1] + n)
        if embeds.shape[0] != starts[-1]:
            raise ValueError(f"the vision tower gave {embeds.shape[0]} rows for {starts[-1]} (distinct images)")
        index = torch.cat([torch.arange(starts[u], starts[u + 1]) for u in self.uses])
        return embeds.index_select(0, index.to(embeds.device))


def distinct_images(pixel_values: Tensor, grid_thw: Tensor, merge_size: int) -> DistinctImages | None:
    """The distinct rows (images or videos) of `pixel_values` ([sum of t*h*w, D], rows in `grid_thw` order), or None
    when no row repeats (the caller runs the tower as usual).

    Raises:
        ValueError: the grids do not account for every patch.
    """
    grids = [tuple(int(x) for x in g) for g in grid_thw.tolist()]
    sizes = [t * h * w for t, h, w in grids]
    if sum(sizes) != pixel_values.shape[0]:
        raise ValueError(f"image grids {grids} hold {sum(sizes)} patches, but pixel_values has {pixel_values.shape[0]}")
    if len(grids) < 2:
        return None
    blocks = pixel_values.split(sizes)
    flat = pixel_values.detach().reshape(pixel_values.shape[0], -1).float()
    weights = torch.arange(1, flat.shape[1] + 1, device=flat.device, dtype=flat.dtype)
    row = torch.repeat_interleave(torch.arange(len(grids), device=flat.device), torch.tensor(sizes, device=flat.device))
    sums = torch.zeros(len(grids), 2, dtype=torch.float64, device=flat.device)
    sums.index_add_(0, row, torch.stack([flat.sum(-1), flat @ weights / flat.shape[1]], dim=-1).double())
    fingerprints = [(g, *map(float, s)) for g, s in zip(grids, sums.cpu(), strict=True)]
    first: dict[tuple, int] = {}  # fingerprint -> distinct row
    reps: list[int] = []  # distinct row -> its first row in the call
    uses: list[int] = []
    for i, key in enumerate(fingerprints):
        j = first.get(key)
        if j is not None and torch.equal(blocks[reps[j]], blocks[i]):
            uses.append(j)
            continue
        uses.append(len(reps))
        first.setdefault(key, len(reps))  # a (never seen) fingerprint collision keeps the row distinct
        reps.append(i)
    if len(reps) == len(grids):
        return None
    return DistinctImages(
        pixel_values=torch.cat([blocks[i] for i in reps]),
        grid_thw=grid_thw[reps],
        uses=uses,
        output_rows=[sizes[i] // merge_size**2 for i in reps],
    )
