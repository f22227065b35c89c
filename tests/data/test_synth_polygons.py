"""Contract of the polygon tasks (`background_colour` is what the tiny CPU job, configs/vision_tiny_cpu.yaml, learns):
the answer is in the pixels and only there.

- Every problem of a task has the same text, so nothing but the image can tell the answers apart; the four answers
  are balanced (chance is 1/4).
- polygon_colour: the answer is the letter of the colour read here from the pixels (the median of the non-white
  pixels, matched to the colour names of the question text: red, green, blue, black).
- background_colour: the answer is the letter of the colour read here from the image's border pixels (the median of
  the outermost ring: the polygon never reaches it), and the polygon is white.
- polygon_sides: the answer equals the number of sides recovered here from the drawn pixels alone, by an independent
  rule: a regular n-gon with circumradius R covers n/2 * sin(2*pi/n) * R^2 of area, so (filled pixels) / (pi * R^2),
  with R the farthest filled pixel from the filled centroid, is 0.41, 0.64, 0.76 or 0.83 for n = 3, 4, 5, 6.
- `data.blank_images` really blanks: every pixel value the processor produces is the one of white, with the same
  prompt ids (same grid, same token count), while the real images vary; video frames too (the motion task).
"""

import math

import numpy as np
import pytest
import torch

from miles_vl.config.schema import DataConfig
from miles_vl.data import SIDES, build_datasets, generate_problems, load_processor, video_settings
from tests.data.helpers import MAX_PIXELS, MIN_PIXELS

N = 40


@pytest.fixture(scope="module")
def problems():
    return generate_problems(N, seed=5, task="polygon_sides")


def sides_from_pixels(image) -> int:
    """The n whose regular n-gon fill ratio is nearest to the drawn one (module docstring)."""
    filled = np.asarray(image.convert("L")) < 250  # anything not white
    ys, xs = np.nonzero(filled)
    cy, cx = ys.mean(), xs.mean()
    radius = np.sqrt((ys - cy) ** 2 + (xs - cx) ** 2).max() + 0.5  # to the pixel's far edge
    ratio = filled.sum() / (math.pi * radius**2)
    expected = {n: n / (2 * math.pi) * math.sin(2 * math.pi / n) for n in (3, 4, 5, 6, 7, 8)}
    return min(expected, key=lambda n: abs(expected[n] - ratio))


def test_answer_is_the_number_of_sides_drawn(problems):
    for p in problems:
        assert p.kind == "polygon_sides"
        assert sides_from_pixels(p.image) == int(p.answer), p.params


def colour_from_pixels(image) -> str:
    """The colour name of the drawn polygon: which channel dominates its pixels, or none (black)."""
    arr = np.asarray(image.convert("RGB")).reshape(-1, 3).astype(int)
    r, g, b = np.median(arr[arr.min(axis=1) < 250], axis=0)  # the non-white pixels
    if max(r, g, b) < 40:
        return "black"
    return {0: "red", 1: "green", 2: "blue"}[int(np.argmax([r, g, b]))]


def test_colour_answer_is_the_letter_of_the_colour_drawn():
    problems = generate_problems(N, seed=5, task="polygon_colour")
    text = "<image>What colour is the polygon? Choices: A. red, B. green, C. blue, D. black."
    assert {p.problem for p in problems} == {text}
    for p in problems:
        assert f"{p.answer}. {colour_from_pixels(p.image)}" in text, p.params
    assert {a: sum(p.answer == a for p in problems) for a in "ABCD"} == dict.fromkeys("ABCD", N // 4)
    assert {p.params["sides"] for p in problems} == set(SIDES)  # the side count varies and says nothing


def test_background_answer_is_the_letter_of_the_colour_around_a_white_polygon():
    problems = generate_problems(N, seed=5, task="background_colour")
    text = "<image>What colour is the background? Choices: A. red, B. green, C. blue, D. black."
    assert {p.problem for p in problems} == {text}
    for p in problems:
        arr = np.asarray(p.image.convert("RGB")).astype(int)
        border = np.concatenate([arr[0], arr[-1], arr[:, 0], arr[:, -1]])  # [4 * 256, 3]
        r, g, b = np.median(border, axis=0)
        name = "black" if max(r, g, b) < 40 else {0: "red", 1: "green", 2: "blue"}[int(np.argmax([r, g, b]))]
        assert f"{p.answer}. {name}" in text, p.params
        assert (arr.min(axis=2) == 255).mean() > 0.1  # a white polygon is drawn
    assert {a: sum(p.answer == a for p in problems) for a in "ABCD"} == dict.fromkeys("ABCD", N // 4)
    again = generate_problems(N, seed=5, task="background_colour")
    assert all(np.array_equal(np.asarray(a.image), np.asarray(b.image)) for a, b in zip(again, problems, strict=True))


def test_text_is_the_same_for_every_problem_and_answers_are_balanced(problems):
    assert {p.problem for p in problems} == {"<image>How many sides does the polygon have? Choices: 3, 4, 5, 6."}
    counts = {n: sum(p.answer == str(n) for p in problems) for n in SIDES}
    assert counts == {3: N // 4, 4: N // 4, 5: N // 4, 6: N // 4}


def test_deterministic_by_seed_and_task(problems):
    again = generate_problems(N, seed=5, task="polygon_sides")
    assert all(np.array_equal(np.asarray(a.image), np.asarray(b.image)) for a, b in zip(again, problems, strict=True))
    other = generate_problems(N, seed=6, task="polygon_sides")
    assert [p.params for p in other] != [p.params for p in problems]
    assert generate_problems(4, seed=5)[0].kind == "triangle_angle"  # the default task is unchanged
    with pytest.raises(ValueError, match="unknown synthetic task 'hexagons'"):
        generate_problems(1, task="hexagons")


def test_blank_images_really_blank(processor):
    def first_samples(blank: bool):
        cfg = DataConfig(
            synthetic_n=8,
            synthetic_task="polygon_colour",
            min_pixels=MIN_PIXELS,
            max_pixels=MAX_PIXELS,
            blank_images=blank,
        )
        ds = build_datasets(cfg, processor, seed=0).train
        return [ds[i] for i in range(4)]

    real, blank = first_samples(False), first_samples(True)
    for r, b in zip(real, blank, strict=True):
        assert torch.equal(r.prompt_ids, b.prompt_ids) and torch.equal(r.image_grid_thw, b.image_grid_thw)
        # Qwen3-VL normalises with mean = std = 0.5: white (1.0) becomes 1.0 in every channel of every patch
        assert torch.all(b.pixel_values == 1.0)
        assert b.pixel_values.shape == r.pixel_values.shape
        assert r.pixel_values.std() > 0.1  # the real image has content
        assert all(np.asarray(im).min() == 255 for im in b.images)  # the image the engines get is white too


def test_blank_images_blank_video_frames_too():
    """The control blanks every medium: the motion task's frames become white frames of the same size and count."""

    def first_sample(blank: bool):
        cfg = DataConfig(
            synthetic_n=4,
            synthetic_task="motion",
            video_min_pixels=32 * 32,
            video_max_pixels=4 * 64 * 64,
            blank_images=blank,
        )
        processor = load_processor("offline", MIN_PIXELS, MAX_PIXELS, video_settings(cfg))
        return build_datasets(cfg, processor, seed=0).train[0]

    real, blank = first_sample(False), first_sample(True)
    assert torch.equal(real.prompt_ids, blank.prompt_ids) and torch.equal(real.video_grid_thw, blank.video_grid_thw)
    assert blank.pixel_values_videos.shape == real.pixel_values_videos.shape
    assert torch.all(blank.pixel_values_videos == 1.0)  # white, normalised with mean = std = 0.5
    assert real.pixel_values_videos.min() < 0.5  # the real frames hold the (dark) polygon
