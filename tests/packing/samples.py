"""Random Qwen3-VL-shaped samples for packing tests, and the transformers reference for their positions.

Token layout follows the Qwen3-VL processor: an image is `<|vision_start|> <|image_pad|> x t*h*w/4
<|vision_end|>`; a video is, per temporal step, timestamp text then `<|vision_start|> <|video_pad|> x h*w/4
<|vision_end|>`. Responses are random text that may contain `<|image_pad|>` tokens (which must count as text).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

# The real Qwen3-VL ids (Qwen3VLConfig defaults).
IMAGE, VIDEO, VSTART, VEND = 151655, 151656, 151652, 151653
PAD = 151643
MERGE = 2
TOKENS = dict(spatial_merge_size=MERGE, image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART)


@dataclass
class Sample:
    input_ids: torch.Tensor  # [L]
    image_grid_thw: torch.Tensor | None
    video_grid_thw: torch.Tensor | None
    prompt_len: int
    loss_mask: torch.Tensor | None = None


def text(draw, lo: int = 0, hi: int = 12) -> list[int]:
    return draw(st.lists(st.integers(10, 5000), min_size=lo, max_size=hi))


@st.composite
def samples(draw, max_images: int = 3, max_videos: int = 2, max_side: int = 8, media_in_response: bool = True):
    """One random sample: text, 0..max_images images and 0..max_videos videos in random order, then a response."""
    kinds = ["image"] * draw(st.integers(0, max_images)) + ["video"] * draw(st.integers(0, max_videos))
    kinds = draw(st.permutations(kinds))
    side = st.integers(1, max_side).map(lambda x: 2 * x)  # patch grid sides, divisible by the merge
    ids, images, videos = text(draw), [], []
    for kind in kinds:
        if kind == "image":
            h, w = draw(side), draw(side)
            images.append([1, h, w])
            ids += [VSTART] + [IMAGE] * (h * w // 4) + [VEND]
        else:
            t, h, w = draw(st.integers(1, 3)), draw(side), draw(side)
            videos.append([t, h, w])
            for step in range(t):
                ids += [1000 + step, 1001]  # "<0.5 seconds>"-like timestamp text
                ids += [VSTART] + [VIDEO] * (h * w // 4) + [VEND]
        ids += text(draw)
    prompt_len = len(ids)
    response = text(draw, 1, 16)
    if media_in_response and response and draw(st.booleans()):
        at = draw(st.integers(0, len(response) - 1))
        response[at : at + 1] = [IMAGE] * draw(st.integers(1, 5))
    ids += response
    return Sample(
        input_ids=torch.tensor(ids, dtype=torch.long),
        image_grid_thw=torch.tensor(images, dtype=torch.long) if images else None,
        video_grid_thw=torch.tensor(videos, dtype=torch.long) if videos else None,
        prompt_len=prompt_len,
    )


@functools.cache
def _hf_model():
    from transformers import Qwen3VLConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    cfg = Qwen3VLConfig(
        text_config=dict(
            vocab_size=16,
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1]),
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=16,
            num_heads=2,
            out_hidden_size=16,
            spatial_merge_size=MERGE,
            deepstack_visual_indexes=[],
        ),
    )
    assert (cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id) == (IMAGE, VIDEO, VSTART)
    return Qwen3VLModel(cfg).eval()


def reference_positions(sample: Sample) -> torch.Tensor:
    """[3, L] from transformers' own `Qwen3VLModel.get_rope_index`, on the sample alone.

    Media tokens after the prompt are marked as text in `mm_token_type_ids`, exactly as the processor marks
    only the media it inserted.
    """
    ids = sample.input_ids
    types = torch.zeros_like(ids)
    in_prompt = torch.arange(ids.numel()) < sample.prompt_len
    types[(ids == IMAGE) & in_prompt] = 1
    types[(ids == VIDEO) & in_prompt] = 2
    video = None if sample.video_grid_thw is None else sample.video_grid_thw.clone()  # it edits its input
    with torch.no_grad():
        pos, _ = _hf_model().get_rope_index(
            ids[None], mm_token_type_ids=types[None], image_grid_thw=sample.image_grid_thw, video_grid_thw=video
        )
    return pos[:, 0]
