"""Rewards: the registry (`resolve_reward`), the geo3k and math rewards, and batch scoring with time limits.

    fn = resolve_reward("geo3k", format_weight=0.1)            # or "my_pkg.rewards:score"
    results, stats = score_batch(fn, [RewardSample(response, label)], timeout_s=10.0)
    with RewardPool(fn, timeout_s=10.0) as pool: ...           # worker processes kept for many batches

A reward function takes one `RewardSample` and returns a `RewardResult` or a float, sync or async (`types`); one
marked `@reward_function(batched=True)` takes the batch as lists (TRL's shape). It runs in worker processes that are
killed when a call passes its time limit (`scoring`); several weighted functions are a `WeightedRewards`.
"""

from miles_vl.reward.geo3k import DEFAULT_FORMAT_PATTERN, format_score, geo3k_reward
from miles_vl.reward.math_answer import answers_match, extract_last_boxed, math_reward
from miles_vl.reward.registry import (
    REWARD_CONFIG_KEYS,
    REWARD_REGISTRY,
    RewardResolutionError,
    check_reward,
    resolve_reward,
)
from miles_vl.reward.scoring import (
    RewardPool,
    RewardStats,
    RewardWorkerError,
    WeightedReward,
    WeightedRewards,
    score_batch,
    score_batch_async,
)
from miles_vl.reward.types import RewardResult, RewardSample, RewardTraits, reward_function, reward_traits

__all__ = [
    "DEFAULT_FORMAT_PATTERN",
    "REWARD_CONFIG_KEYS",
    "REWARD_REGISTRY",
    "RewardPool",
    "RewardResolutionError",
    "RewardResult",
    "RewardSample",
    "RewardStats",
    "RewardTraits",
    "RewardWorkerError",
    "WeightedReward",
    "WeightedRewards",
    "answers_match",
    "check_reward",
    "extract_last_boxed",
    "format_score",
    "geo3k_reward",
    "math_reward",
    "resolve_reward",
    "reward_function",
    "reward_traits",
    "score_batch",
    "score_batch_async",
]
