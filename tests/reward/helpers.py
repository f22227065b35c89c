"""Reward functions reached through `module:function` paths in the registry tests (`tests.reward.helpers:...`)."""

from miles_vl.reward import RewardSample

NOT_CALLABLE = 42


def exact_match(sample: RewardSample) -> float:
    return 1.0 if sample.response.strip() == sample.label else 0.0


async def async_exact_match(sample: RewardSample) -> dict[str, float]:
    score = 1.0 if sample.response.strip() == sample.label else 0.0
    return {"overall": score, "accuracy": score}


def two_samples(sample: RewardSample, other: RewardSample) -> float:
    return 0.0


def no_args() -> float:
    return 0.0


def with_bonus(sample: RewardSample, *, bonus: float = 0.0) -> float:
    return exact_match(sample) + bonus


class Graders:
    @staticmethod
    def strict(sample: RewardSample) -> float:
        return exact_match(sample)
