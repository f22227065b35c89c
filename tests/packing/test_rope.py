"""Contract: `get_rope_index` equals transformers' own `Qwen3VLModel.get_rope_index` on every sample, exactly:
text, images, videos (split into frame groups), any mix and order, and media tokens in the response as text."""

import pytest
import torch
from hypothesis import given, settings

from miles_vl.packing import get_rope_index
from tests.packing.samples import IMAGE, TOKENS, VEND, VIDEO, VSTART, Sample, reference_positions, samples


@settings(max_examples=150, deadline=None)
@given(samples())
def test_positions_equal_transformers(sample):
    ours = get_rope_index(
        sample.input_ids, sample.image_grid_thw, sample.video_grid_thw, media_end=sample.prompt_len, **TOKENS
    )
    assert torch.equal(ours, reference_positions(sample))


@settings(max_examples=30, deadline=None)
@given(samples(max_images=0, max_videos=0, media_in_response=False))
def test_text_only_is_arange(sample):
    ours = get_rope_index(sample.input_ids, **TOKENS)
    assert torch.equal(ours, torch.arange(sample.input_ids.numel()).expand(3, -1))


def test_hand_derived_image_block():
    # text(2) <vs> [image 1x4x6 -> 2x3 merged = 6 tokens] <ve> text(1)
    ids = torch.tensor([11, 12, VSTART] + [IMAGE] * 6 + [VEND, 13])
    pos = get_rope_index(ids, torch.tensor([[1, 4, 6]]), **TOKENS)
    s = 3  # the block starts after 3 text tokens
    expected = torch.tensor(
        [
            [0, 1, 2] + [s] * 6 + [s + 3, s + 4],  # next text starts at s + max(2, 3)
            [0, 1, 2] + [s, s, s, s + 1, s + 1, s + 1] + [s + 3, s + 4],
            [0, 1, 2] + [s, s + 1, s + 2, s, s + 1, s + 2] + [s + 3, s + 4],
        ]
    )
    assert torch.equal(pos, expected)


def test_media_after_media_end_is_text():
    ids = torch.tensor([11, VSTART] + [IMAGE] * 4 + [VEND, 12, IMAGE, IMAGE])
    with_end = get_rope_index(ids, torch.tensor([[1, 4, 4]]), media_end=8, **TOKENS)
    assert torch.equal(with_end[:, 7:], torch.tensor([[5, 6, 7]]).expand(3, -1))  # 12, then two text pads
    with pytest.raises(ValueError, match="image_grid_thw has 1 rows, but the ids contain 2 <|image_pad|> blocks"):
        get_rope_index(ids, torch.tensor([[1, 4, 4]]), **TOKENS)


def test_wrong_grid_size_names_the_block():
    ids = torch.tensor([VSTART] + [IMAGE] * 5 + [VEND])
    with pytest.raises(ValueError, match=r"vision block 0 \(image\) in segment 0 .* has 5 media tokens, .* = 4"):
        get_rope_index(ids, torch.tensor([[1, 4, 4]]), **TOKENS)


def test_missing_grid_rows():
    ids = torch.tensor([VSTART] + [VIDEO] * 4 + [VEND])
    with pytest.raises(ValueError, match="video_grid_thw has 0 rows .* but the ids contain 1"):
        get_rope_index(ids, **TOKENS)


def test_grid_not_divisible_by_merge():
    ids = torch.tensor([VSTART] + [IMAGE] * 3 + [VEND])
    with pytest.raises(ValueError, match="not divisible by spatial_merge_size=2"):
        get_rope_index(ids, torch.tensor([[1, 3, 4]]), **TOKENS)


def test_batched_input_rejected():
    with pytest.raises(ValueError, match=r"one unpacked sample, input_ids \[L\]"):
        get_rope_index(torch.zeros(2, 5, dtype=torch.long), **TOKENS)


def test_sample_type_is_plain():
    assert Sample(torch.tensor([1]), None, None, 1).prompt_len == 1
