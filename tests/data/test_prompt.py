"""Contract: `<image>` placeholders become typed image parts in order; `PromptEncoder.encode` gives exactly the ids,
pixels and grids of the transformers processor's own `apply_chat_template(..., tokenize=True)` (the reference);
each image's `<|image_pad|>` run is prod(image_grid_thw)/4 long; `count_tokens` predicts the length exactly."""

import io

import pytest
import torch
from PIL import Image

from miles_vl.data import PromptEncoder, PromptRow, build_messages
from miles_vl.models.qwen3_vl.tokens import special_tokens
from tests.data.conftest import INSTRUCTION
from tests.data.helpers import png_bytes


def row(problem, images, index=0, encoder=None):
    sizes = [Image.open(io.BytesIO(b)).size for b in images]
    return PromptRow(index, problem, tuple(images), "1", encoder.count_tokens(problem, sizes) if encoder else 0)


def test_build_messages_splits_on_placeholders():
    msgs = build_messages("<image>Find x.", instruction="Box it.")
    assert msgs == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find x. Box it."}]}]
    msgs = build_messages("Compare <image> and <image>", system_prompt="You are a tutor.", instruction=None)
    assert msgs[0] == {"role": "system", "content": "You are a tutor."}
    assert msgs[1]["content"] == [
        {"type": "text", "text": "Compare "},
        {"type": "image"},
        {"type": "text", "text": " and "},
        {"type": "image"},
    ]
    # An image last: the instruction becomes its own text part after it.
    assert build_messages("What is this?<image>", instruction="Box it.")[0]["content"][-2:] == [
        {"type": "image"},
        {"type": "text", "text": "Box it."},
    ]
    assert build_messages("Just text.")[0]["content"] == [{"type": "text", "text": "Just text."}]


@pytest.mark.parametrize("system_prompt", [None, "You are a careful geometry tutor."])
def test_encode_equals_the_processor_reference(processor, system_prompt):
    images = [png_bytes(64, 48, seed=1), png_bytes(200, 90, seed=2)]
    problem = "<image>In the first figure, find x. Then use <image> to find y."
    enc = PromptEncoder(processor, system_prompt=system_prompt, instruction=INSTRUCTION)
    sample = enc.encode(row(problem, images, encoder=enc))

    # Reference: the processor's own chat template + processing, images passed inside the messages.
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    content = [
        {"type": "image", "image": pil[0]},
        {"type": "text", "text": "In the first figure, find x. Then use "},
        {"type": "image", "image": pil[1]},
        {"type": "text", "text": " to find y. " + INSTRUCTION},
    ]
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": content}
    ]
    ref = processor.apply_chat_template(
        messages, tokenize=True, return_dict=True, add_generation_prompt=True, return_tensors="pt"
    )
    assert torch.equal(sample.prompt_ids, ref["input_ids"][0])
    assert torch.equal(sample.image_grid_thw, ref["image_grid_thw"])
    assert torch.equal(sample.pixel_values, ref["pixel_values"])
    assert sample.prompt_ids.dtype == torch.long and sample.prompt_ids.dim() == 1
    assert sample.image_grid_thw.dtype == torch.long and sample.image_grid_thw.shape == (2, 3)
    assert sample.pixel_values.shape == (int(sample.image_grid_thw.prod(-1).sum()), 3 * 2 * 16 * 16)
    assert sample.prompt_text == processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert [im.size for im in sample.images] == [(64, 48), (200, 90)]


def test_image_pad_runs_match_the_grids(processor, encoder):
    """Each image: <|vision_start|>, then prod(grid)/merge^2 <|image_pad|>, then <|vision_end|>, in image order."""
    images = [png_bytes(40, 40), png_bytes(300, 120), png_bytes(90, 200)]
    sample = encoder.encode(row("<image><image>Find x.<image>", images, encoder=encoder))
    t = special_tokens(processor)
    ids = sample.prompt_ids.tolist()
    starts = [i for i, x in enumerate(ids) if x == t.vision_start_token_id]
    assert len(starts) == 3
    for start, grid in zip(starts, sample.image_grid_thw.tolist(), strict=True):
        n = grid[0] * grid[1] * grid[2] // 4
        assert ids[start + 1 : start + 1 + n] == [t.image_token_id] * n
        assert ids[start + 1 + n] == t.vision_end_token_id
    assert ids.count(t.image_token_id) == int(sample.image_grid_thw.prod(-1).sum()) // 4


@pytest.mark.parametrize("size", [(8, 8), (33, 17), (64, 48), (128, 128), (640, 480), (1000, 90)])
def test_count_tokens_is_exact(encoder, size):
    """Upscaled, unchanged and downscaled images: the load-time count equals the processor's length."""
    problem = "<image>Find the area of the shaded region. Round to the nearest tenth."
    r = row(problem, [png_bytes(*size)], encoder=encoder)
    assert encoder.encode(r).prompt_len == r.prompt_len


def test_text_only_prompt_has_no_vision_inputs(encoder):
    sample = encoder.encode(row("What is 2 + 3?", [], encoder=encoder))
    assert sample.pixel_values is None and sample.image_grid_thw is None and sample.images == []
    assert sample.prompt_len > 0


def test_stale_length_is_an_error(encoder):
    r = row("<image>Find x.", [png_bytes()], encoder=encoder)
    stale = PromptRow(r.index, r.problem, r.images, r.label, r.prompt_len + 3)
    with pytest.raises(ValueError, match="build the dataset with the processor you encode with"):
        encoder.encode(stale)
