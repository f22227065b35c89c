"""Rewards written as users write them: batched (TRL's shape), async, wanting images, failing in set ways."""

import asyncio

from miles_vl.reward import RewardSample, reward_function


def length(sample: RewardSample, *, scale: float = 1.0) -> float:
    return len(sample.response) * scale


def whole_sample(sample: RewardSample) -> dict:
    """1 when the prompt text, the label (as ground_truth) and the metadata all reached the reward."""
    ok = sample.prompt == "Q?" and sample.ground_truth == "4" and sample.metadata["index"] == 3
    return {"overall": float(ok), "accuracy": float(sample.response == sample.label)}


@reward_function(images=True)
def image_width(sample: RewardSample) -> float:
    return float(sample.images[0].width)


@reward_function(batched=True)
def batched_len(prompts, completions, label, metadata, *, bonus: float = 0.0, **kwargs) -> list[float]:
    return [len(c) + bonus for c in completions]


@reward_function(batched=True)
async def batched_async_match(prompts, completions, label, **kwargs) -> list[float]:
    await asyncio.sleep(0)
    return [float(c == a) for c, a in zip(completions, label, strict=True)]


@reward_function(batched=True)
def batched_one_short(prompts, completions, **kwargs) -> list[float]:
    return [1.0] * (len(completions) - 1)


@reward_function(batched=True)
def batched_one_nan(prompts, completions, **kwargs) -> list[float]:
    return [float("nan")] + [1.0] * (len(completions) - 1)


@reward_function(batched=True, images=True)
def batched_images(prompts, completions, images, **kwargs) -> list[float]:
    return [float(len(im)) for im in images]


@reward_function(batched=True)
def batched_wrong_signature(sample):
    return [1.0]


def raises_on_b(sample: RewardSample) -> float:
    if "b" in sample.response:
        raise RuntimeError("no b")
    return 1.0
