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


def hostile_reward(sample: RewardSample) -> float:
    """Per prompt index, from HOSTILE_REWARD (`index=huge,index=hang`): 1e39 (finite in float64, inf in float32),
    a call that never returns, or else `length_reward`."""
    import os
    import time

    behaviour = dict(item.split("=") for item in os.environ.get("HOSTILE_REWARD", "").split(",") if item)
    do = behaviour.get(str(sample.metadata["index"]))
    if do == "huge":
        return 1e39
    if do == "hang":
        while True:
            time.sleep(1)
    return length_reward(sample)


def constant_reward(sample: RewardSample) -> float:
    """1.0 for every response: every group has equal rewards, so dynamic sampling keeps none."""
    return 1.0
