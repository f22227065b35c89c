"""Contract of the long-context task `many_images` (data/synth.py, docs/long_context.md).

- Lengths in tokens as the transformers Qwen3-VL processor computes them at Qwen3-VL-2B's shapes (patch 16, merge 2,
  1024x1024 images = 1024 vision tokens): `many_images_count` picks 15, 31 and 62 images for 16K, 32K and 64K, and
  the prompts built through `build_datasets` are within 5 % under those lengths, leaving room for a 256-token
  response. The load-time count is what the processor produces (checked on a prompt of 4 full-size images: the
  64K one's pixel values would be 1.5 GB of float32).
- The answer is the number of the one image with a red background, read back here from the pixels (the border ring
  of each image); every number is the answer equally often, the text is the same for every problem of a size.
- The rewards on hand-made responses: `geo3k` (the default) scores the boxed number, `digit_fraction` (the GPU job's
  learnable reward) the share of digits.
"""

import numpy as np
import pytest

from benchmarks.learning_smoke import digit_fraction
from miles_vl.config.schema import DataConfig
from miles_vl.data import DataError, build_datasets, load_processor
from miles_vl.data.synth import (
    MANY_IMAGES_SIZE,
    generate_many_images_problem,
    many_images_count,
    many_images_problem_text,
    synth_records,
)
from miles_vl.reward.geo3k import geo3k_reward
from miles_vl.reward.types import RewardSample

FULL = MANY_IMAGES_SIZE * MANY_IMAGES_SIZE  # Qwen3-VL-2B's processor keeps a 1024x1024 image whole at this max


@pytest.fixture(scope="module")
def processor_2b():
    return load_processor("offline", FULL, FULL)


def red_images(images) -> list[int]:
    """1-based numbers of the images whose outermost pixel ring is red (the polygon never reaches it)."""
    red = []
    for k, image in enumerate(images, 1):
        a = np.asarray(image)
        ring = np.concatenate([a[0], a[-1], a[:, 0], a[:, -1]])
        r, g, b = np.median(ring, axis=0)
        if r > 150 and g < 100 and b < 100:
            red.append(k)
    return red


@pytest.mark.parametrize("target", [16384, 32768, 65536])
def test_prompt_lengths_reach_16k_32k_64k_with_the_2b_processor(processor_2b, target):
    images = many_images_count(target)
    assert images == {16384: 15, 32768: 31, 65536: 62}[target]
    cfg = DataConfig(
        synthetic_n=2,
        synthetic_task="many_images",
        synthetic_images=images,
        max_prompt_len=target,
        min_pixels=FULL,
        max_pixels=FULL,
    )
    splits = build_datasets(cfg, processor_2b, seed=0)
    assert splits.reports[0].n_dropped == 0
    lengths = [row.prompt_len for row in splits.train.rows]
    assert all(0.95 * target - 256 <= n <= target - 256 for n in lengths), lengths
    # every image is 1024 vision tokens: the image placeholders alone are images * 1024 of the prompt
    assert min(lengths) >= images * 1024


def test_load_time_count_is_what_the_processor_produces(processor_2b):
    cfg = DataConfig(
        synthetic_n=1, synthetic_task="many_images", synthetic_images=4, max_prompt_len=8192, min_pixels=FULL,
        max_pixels=FULL,
    )  # fmt: skip
    splits = build_datasets(cfg, processor_2b, seed=0)
    sample = splits.train[0]  # encode raises when the processor's length differs from the load-time count
    assert sample.prompt_len == splits.train.rows[0].prompt_len
    assert sample.image_grid_thw.tolist() == [[1, 64, 64]] * 4
    assert int((sample.prompt_ids == processor_2b.tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum()) == 4 * 1024


def test_prompts_over_max_prompt_len_are_dropped_and_counted(processor_2b):
    cfg = DataConfig(
        synthetic_n=2, synthetic_task="many_images", synthetic_images=15, max_prompt_len=15000, min_pixels=FULL,
        max_pixels=FULL,
    )  # fmt: skip
    with pytest.raises(DataError, match="dropped 2: prompt_too_long=2"):
        build_datasets(cfg, processor_2b, seed=0)


def test_answer_is_the_red_image_and_answers_are_balanced():
    n, images = 12, 6
    answers = []
    for i in range(n):
        p = generate_many_images_problem(i, seed=3, images=images)
        assert len(p.images) == images and p.problem == many_images_problem_text(images)
        assert p.problem.count("<image>") == images
        assert all(im.size == (MANY_IMAGES_SIZE, MANY_IMAGES_SIZE) for im in p.images)
        assert red_images(p.images) == [int(p.answer)]
        answers.append(int(p.answer))
    assert sorted(answers) == sorted(list(range(1, images + 1)) * (n // images))
    records = synth_records(2, seed=3, task="many_images", images=images)
    assert [int(r["answer"]) for r in records] == answers[:2] and len(records[0]["images"]) == images


def test_fewer_than_two_images_is_refused():
    with pytest.raises(ValueError, match="at least 2 images"):
        generate_many_images_problem(0, images=1)
    with pytest.raises(ValueError, match="needs >= 2"):
        many_images_count(1500)
    with pytest.raises(ValueError, match="synthetic_images"):
        DataConfig(synthetic_n=1, synthetic_task="many_images", synthetic_images=1)


@pytest.mark.parametrize(
    "response, geo3k, digits",
    [
        ("<think>image 7 is red</think> \\boxed{7}", 1.0, 2 / 39),
        ("<think>image 3 is red</think> \\boxed{3}", 0.1, 2 / 39),  # right format, wrong number
        ("7", 0.0, 1.0),  # the right number not boxed: geo3k reads only a boxed answer
        ("the red one", 0.0, 0.0),
    ],
)
def test_rewards_on_hand_made_responses(response, geo3k, digits):
    sample = RewardSample(response=response, label="7")
    assert geo3k_reward(sample).overall == pytest.approx(geo3k)
    assert digit_fraction(sample) == pytest.approx(digits)
