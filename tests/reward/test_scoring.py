"""Contract: `score_batch` scores sync and async rewards in sample order; a reward that raises, returns junk or
runs past its time limit scores 0 for that sample, is counted in `RewardStats` and logged, and the batch goes on."""

import asyncio
import logging
import threading
import time

import pytest

from miles_vl.reward import RewardResult, RewardSample, resolve_reward, score_batch, score_batch_async

SAMPLES = [RewardSample(str(i), str(i if i % 2 == 0 else -1), {"index": i}) for i in range(6)]  # even ones correct


def test_sync_and_async_rewards_agree():
    sync_results, sync_stats = score_batch(resolve_reward("tests.reward.helpers:exact_match"), SAMPLES, 5.0)
    async_results, async_stats = score_batch(resolve_reward("tests.reward.helpers:async_exact_match"), SAMPLES, 5.0)
    assert [r.overall for r in sync_results] == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert [r.overall for r in async_results] == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert [r.accuracy for r in async_results] == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert sync_stats.overall_mean == async_stats.overall_mean == 0.5
    assert (sync_stats.n_errors, sync_stats.n_timeouts, sync_stats.accuracy_mean) == (0, 0, None)
    assert async_stats.accuracy_mean == 0.5
    assert async_stats.as_dict() == {
        "reward_overall": 0.5,
        "reward_accuracy": 0.5,
        "reward_errors": 0.0,
        "reward_timeouts": 0.0,
    }


def test_raising_and_sleeping_rewards_score_zero_and_are_counted(caplog):
    def flaky(sample: RewardSample) -> float:
        i = sample.metadata["index"]
        if i == 1:
            raise ValueError("cannot parse")
        if i == 2:
            time.sleep(30)  # abandoned after the time limit; a daemon thread, so it does not hold up exit
        if i == 3:
            return float("nan")
        if i == 4:
            return "junk"  # type: ignore[return-value]
        return 1.0

    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="miles_vl.reward.scoring"):
        results, stats = score_batch(flaky, SAMPLES, timeout_s=0.3)
    assert time.monotonic() - start < 5  # the sleeper did not hold the batch
    assert [r.overall for r in results] == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert results[1].error == "ValueError: cannot parse"
    assert results[2].error == "timeout after 0.3s"
    assert "not finite" in results[3].error and "must return a RewardResult" in results[4].error
    assert (stats.n_samples, stats.n_errors, stats.n_timeouts) == (6, 3, 1)
    assert stats.overall_mean == pytest.approx(2 / 6)
    assert "failed on sample 2, scored 0: timeout after 0.3s" in caplog.text
    assert "4 of 6 samples scored 0 (3 errors, 1 timeouts)" in caplog.text


def test_async_timeout_and_concurrency():
    async def slow(sample: RewardSample) -> RewardResult:
        await asyncio.sleep(30 if sample.metadata["index"] == 0 else 0.1)
        return RewardResult(overall=1.0, accuracy=1.0, format=0.0)

    start = time.monotonic()
    results, stats = score_batch(slow, SAMPLES, timeout_s=0.5)
    assert time.monotonic() - start < 2  # the five 0.1 s calls ran concurrently, the 30 s one was cut at 0.5 s
    assert [r.overall for r in results] == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert (stats.n_timeouts, stats.n_errors, stats.format_mean) == (1, 0, 0.0)


def test_time_limit_counts_from_call_start_not_queue():
    def sleepy(sample: RewardSample) -> float:
        time.sleep(0.2)
        return 1.0

    # One call at a time: the batch takes ~1.2 s, longer than the limit, yet no single call exceeds it.
    results, stats = score_batch(sleepy, SAMPLES, timeout_s=0.6, max_concurrency=1)
    assert stats.n_timeouts == 0 and all(r.overall == 1.0 for r in results)


def test_a_users_own_timeout_error_is_an_error_not_a_timeout():
    def raises_timeout(sample: RewardSample) -> float:
        raise TimeoutError("upstream service")

    _, stats = score_batch(raises_timeout, SAMPLES[:2], timeout_s=5.0)
    assert (stats.n_errors, stats.n_timeouts) == (2, 0)


def test_sync_rewards_run_off_the_event_loop_thread():
    seen = set()

    def record(sample: RewardSample) -> float:
        seen.add(threading.current_thread().name)
        return 0.0

    score_batch(record, SAMPLES, 5.0)
    assert seen == {"miles-vl-reward"}


def test_geo3k_through_the_batch_scorer():
    fn = resolve_reward("geo3k")
    samples = [RewardSample("<think>a</think> \\boxed{30^\\circ}", "30"), RewardSample("\\boxed{31}", "30")]
    results, stats = score_batch(fn, samples, timeout_s=10.0)
    assert [r.overall for r in results] == [1.0, 0.0]
    assert (stats.accuracy_mean, stats.format_mean) == (0.5, 0.5)


def test_inside_a_running_loop_use_the_async_form():
    async def main():
        with pytest.raises(RuntimeError, match="use `await score_batch_async"):
            score_batch(lambda s: 1.0, SAMPLES, 1.0)
        return await score_batch_async(lambda s: 1.0, SAMPLES, 1.0)

    results, stats = asyncio.run(main())
    assert stats.overall_mean == 1.0 and len(results) == 6


def test_bad_arguments():
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        score_batch(lambda s: 1.0, SAMPLES, 0.0)
    with pytest.raises(ValueError, match="max_concurrency must be >= 1"):
        score_batch(lambda s: 1.0, SAMPLES, 1.0, max_concurrency=0)
