"""Test rewards with enough spread for GRPO to train on a random tiny model."""

from miles_vl.reward import RewardSample


def length_reward(sample: RewardSample) -> float:
    """Longer decoded responses score higher: varies across a group, so advantages are non-zero."""
    return min(len(sample.response), 40) / 40


def half_constant_reward(sample: RewardSample) -> float:
    """Constant for even row indices (their groups carry no signal), length-based for odd ones."""
    if sample.metadata["index"] % 2 == 0:
        return 1.0
    return length_reward(sample)
