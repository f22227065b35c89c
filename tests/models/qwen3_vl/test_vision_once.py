"""Contract: `distinct_images` keeps exactly one copy of every repeated image or video row (bit-equal patches, equal
grid) and `expand` gives every use its rows back, in the call's order, with the gradient summed over the uses."""

import pytest
import torch

from miles_vl.models.qwen3_vl.vision_once import distinct_images


def rows(grid, seed):
    t, h, w = grid
    return torch.randn(t * h * w, 6, generator=torch.Generator().manual_seed(seed))


def test_repeats_are_run_once_and_read_back_at_every_use():
    a, b, video = rows((1, 4, 4), 0), rows((1, 4, 4), 1), rows((2, 2, 4), 2)  # a and b: same grid, other pixels
    grids = [(1, 4, 4), (2, 2, 4), (1, 4, 4), (1, 4, 4), (2, 2, 4)]
    pixels = torch.cat([a, video, b, a.clone(), video.clone()])
    d = distinct_images(pixels, torch.tensor(grids), merge_size=2)
    assert d.uses == [0, 1, 2, 0, 1]
    assert torch.equal(d.pixel_values, torch.cat([a, video, b])) and d.grid_thw.tolist() == [list(g) for g in grids[:3]]
    assert d.output_rows == [4, 4, 4]  # t*h*w / merge^2

    def tower(x):  # a stand-in per-row tower: 4 patches -> 1 output row
        return x.reshape(-1, 4, 6).sum(1) * 2.0

    x = d.pixel_values.clone().requires_grad_(True)
    out = d.expand(tower(x))
    assert torch.equal(out, tower(pixels))  # every use gets its own image's rows, in order
    out.sum().backward()
    uses = torch.tensor([2.0] * 16 + [2.0] * 16 + [1.0] * 16)  # a and the video used twice, b once
    assert torch.equal(x.grad, 2.0 * uses[:, None].expand(-1, 6))


def test_nothing_repeats_or_one_image():
    assert (
        distinct_images(torch.cat([rows((1, 2, 2), 0), rows((1, 2, 2), 1)]), torch.tensor([[1, 2, 2]] * 2), 2) is None
    )
    assert distinct_images(rows((1, 2, 2), 0), torch.tensor([[1, 2, 2]]), 2) is None


def test_grids_that_do_not_cover_the_patches_are_refused():
    with pytest.raises(ValueError, match=r"hold 8 patches, but pixel_values has 4"):
        distinct_images(rows((1, 2, 2), 0), torch.tensor([[1, 2, 2], [1, 2, 2]]), 2)
