"""Rewards as users write them (issue 18 §4): the whole sample, batched (TRL's shape), async, in-memory callables
sent by value, and several weighted functions. Every failure is counted and named, never dropped."""

import pytest
from PIL import Image

from miles_vl.reward import (
    RewardResolutionError,
    RewardSample,
    WeightedReward,
    WeightedRewards,
    check_reward,
    resolve_reward,
    score_batch,
)
from tests.reward import user_rewards as ur

SAMPLES = [RewardSample("a", "a"), RewardSample("bb", "x"), RewardSample("ccc", "ccc")]


def test_a_reward_sees_the_whole_sample():
    """Prompt text, label (also as ground_truth), metadata reach a per-sample reward; images only when asked."""
    sample = RewardSample("4", "4", {"index": 3}, prompt="Q?", images=(Image.new("RGB", (7, 5)),))
    results, _ = score_batch(ur.whole_sample, [sample], 5.0, num_workers=1)
    assert (results[0].overall, results[0].accuracy) == (1.0, 1.0)
    results, _ = score_batch(ur.image_width, [sample], 5.0, num_workers=1)
    assert results[0].overall == 7.0


def test_batched_rewards_get_lists_and_bound_options():
    """One call with the batch; `kwargs` bound like any reward's: len + bonus."""
    fn = resolve_reward("tests.reward.user_rewards:batched_len", bonus=10.0)
    results, stats = score_batch(fn, SAMPLES, 5.0, num_workers=1)
    assert [r.overall for r in results] == [11.0, 12.0, 13.0] and stats.n_errors == 0
    results, _ = score_batch(ur.batched_async_match, SAMPLES, 5.0, num_workers=1)
    assert [r.overall for r in results] == [1.0, 0.0, 1.0]
    with_images = [RewardSample("a", "a", images=(Image.new("RGB", (2, 2)),) * k) for k in (1, 2)]
    results, _ = score_batch(ur.batched_images, with_images, 5.0, num_workers=1)
    assert [r.overall for r in results] == [1.0, 2.0]


def test_a_batched_reward_of_the_wrong_length_fails_every_sample_and_is_named():
    results, stats = score_batch(ur.batched_one_short, SAMPLES, 5.0, num_workers=1)
    assert stats.n_errors == 3 and all(r.overall == 0.0 for r in results)
    assert "batched reward batched_one_short returned 2 scores for 3 completions" in results[0].error
    results, stats = score_batch(ur.batched_one_nan, SAMPLES, 5.0, num_workers=1)  # one bad item fails alone
    assert [r.overall for r in results] == [0.0, 1.0, 1.0] and stats.n_errors == 1


def test_a_batched_reward_must_take_the_batch_keywords():
    with pytest.raises(RewardResolutionError, match="batched reward .* cannot take the keywords"):
        resolve_reward("tests.reward.user_rewards:batched_wrong_signature")


def test_closures_and_lambdas_are_sent_by_value():
    """Not importable in the worker (a closure over a local): cloudpickle sends it by value."""
    target = "bb"
    fn = check_reward(lambda s: float(s.response == target), "in-memory")
    results, _ = score_batch(fn, SAMPLES, 5.0, num_workers=1)
    assert [r.overall for r in results] == [0.0, 1.0, 0.0]


def test_weighted_rewards_sum_and_keep_each_function():
    """overall = 0.5 * len + 2 * (response == label); a function that raises adds 0 and counts as an error."""
    terms = [
        WeightedReward("length", 0.5, resolve_reward("tests.reward.user_rewards:length")),
        WeightedReward("match", 2.0, ur.batched_async_match),
        WeightedReward("no_b", 1.0, ur.raises_on_b),
    ]
    with WeightedRewards(terms, timeout_s=5.0, num_workers=1) as pool:
        results, stats = pool.score(SAMPLES)
    # a: 0.5*1 + 2*1 + 1 = 3.5; bb: 0.5*2 + 0 + 0 (raised) = 1.0; ccc: 0.5*3 + 2 + 1 = 4.5
    assert [r.overall for r in results] == [3.5, 1.0, 4.5]
    assert results[1].by_function == {"length": 2.0, "match": 0.0, "no_b": 0.0}
    assert results[1].error.startswith("no_b: RuntimeError: no b")
    assert (stats.n_errors, stats.n_timeouts) == (1, 0)


def test_weighted_rewards_refuse_duplicate_labels():
    with pytest.raises(ValueError, match="distinct labels"):
        WeightedRewards([WeightedReward("x", 1.0, ur.length)] * 2, timeout_s=1.0)
