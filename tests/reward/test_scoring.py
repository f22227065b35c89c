"""Contract: rewards are scored in worker processes, in sample order; a reward that raises, returns junk (NaN, a
string, a value beyond +-1e6) or runs past its time limit scores 0 for that sample, is counted in `RewardStats` and
logged, and the batch goes on. The time limit is hard: the worker running a call past it is killed (its whole
process group), for any reward, built-in or custom, sync or async, CPU-bound or not (issue 15.7)."""

import logging
import os
import time

import pytest

from miles_vl.reward import (
    RewardPool,
    RewardSample,
    RewardWorkerError,
    resolve_reward,
    score_batch,
    score_batch_async,
)
from tests.procs import gone_within
from tests.reward.helpers import async_misbehave, misbehave

SAMPLES = [RewardSample(str(i), str(i if i % 2 == 0 else -1), {"index": i}) for i in range(6)]  # even ones correct


def doing(*behaviours: str, **metadata) -> list[RewardSample]:
    return [RewardSample("r", "l", {"do": b, "index": i, **metadata}) for i, b in enumerate(behaviours)]


@pytest.fixture(scope="module")
def pool():
    """One pool of the misbehaving reward for the module (workers start once; killed ones are replaced)."""
    with RewardPool(misbehave, timeout_s=1.0, num_workers=2) as p:
        yield p


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


def test_failures_score_zero_and_are_counted(pool, caplog):
    """Raising, a NaN, a string, 1e39 (issue 15.8: finite in float64, inf in the float32 advantages) and a sleeper
    each score 0 with a reason; the others are scored."""
    samples = doing("ok", "raise", "sleep", "nan", "junk", "huge", "own_timeout", "ok")
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="miles_vl.reward.scoring"):
        results, stats = pool.score(samples)
    assert time.monotonic() - start < 8  # the sleeper was cut at 1 s, not waited for (60 s)
    assert [r.overall for r in results] == [1.0, 0, 0, 0, 0, 0, 0, 1.0]
    assert results[1].error == "ValueError: cannot parse"
    assert results[2].error == "timeout after 1s"
    assert "not finite" in results[3].error and "must return a RewardResult" in results[4].error
    assert "reward overall=1e+39 is outside [-1e+06, 1e+06]; rescale the reward" in results[5].error
    assert results[6].error == "TimeoutError: upstream service"  # the reward's own TimeoutError is not our limit
    assert (stats.n_samples, stats.n_errors, stats.n_timeouts, stats.n_workers_killed) == (8, 5, 1, 1)
    assert stats.overall_mean == pytest.approx(2 / 8)
    assert "failed on sample 2, scored 0: timeout after 1s" in caplog.text
    assert "6 of 8 samples scored 0 (5 errors, 1 timeouts)" in caplog.text


def test_a_cpu_bound_reward_is_killed_with_the_processes_it_started(pool, tmp_path):
    """A spinning call and a call whose reward started a process of its own: both stop at the limit; the worker
    and the reward's child are gone (the process group is killed), and the pool goes on with new workers."""
    pid_file = tmp_path / "child.pid"
    pids_before = {r.overall for r in pool.score(doing("pid", "pid", "pid", "pid"))[0]}
    results, stats = pool.score(doing("spin", "spawn", pid_file=str(pid_file)))
    assert [r.error for r in results] == ["timeout after 1s", "timeout after 1s"]
    assert stats.n_workers_killed == 2
    child = int(pid_file.read_text())
    assert gone_within(child, 5)
    for pid in pids_before:  # the pool reaps the workers it kills at once: not even a zombie is left
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid), 0)
    after, stats = pool.score(doing("ok", "ok", "ok"))
    assert [r.overall for r in after] == [1.0, 1.0, 1.0] and stats.n_workers_killed == 0


def test_geo3k_on_a_tower_of_powers_stops_at_the_limit():
    """Issue 15.7: geo3k (math-verify, sympy) on `\\boxed{9^{9^{9}}}` had not returned after 90 s with a 2 s limit."""
    samples = [
        RewardSample("<think>x</think> \\boxed{9^{9^{9}}}", "3"),
        RewardSample("<think>a</think> \\boxed{30^\\circ}", "30"),
    ]
    with RewardPool(resolve_reward("geo3k"), timeout_s=2.0, num_workers=2) as p:
        start = time.monotonic()
        results, stats = p.score(samples)
        elapsed = time.monotonic() - start
    assert elapsed < 6
    assert results[0].error == "timeout after 2s" and results[0].overall == 0.0
    assert results[1].overall == 1.0
    assert (stats.n_timeouts, stats.n_workers_killed) == (1, 1)


def test_a_worker_that_dies_fails_only_its_call(pool):
    results, stats = pool.score(doing("ok", "exit", "ok", "ok"))
    assert [r.overall for r in results] == [1.0, 0.0, 1.0, 1.0]
    assert results[1].error == "the reward worker process died (exit code 3)"
    assert (stats.n_errors, stats.n_timeouts) == (1, 0)


def test_time_limit_counts_from_call_start_not_queue():
    # One worker: the batch takes ~2.4 s, longer than the limit, yet no single call exceeds it (1.6 s to spare each).
    samples = doing(*["sleep"] * 6, seconds=0.4)
    results, stats = score_batch(misbehave, samples, timeout_s=2.0, num_workers=1)
    assert stats.n_timeouts == 0 and all(r.overall == 1.0 for r in results)


def test_async_rewards_run_concurrently_and_time_out():
    """Five 0.6 s calls run at once in one worker; a 30 s one is cut at its limit by the worker itself (the pool's
    kill, the backstop, is set far off here so that a late answer on a busy machine is not taken for a hung worker)."""
    samples = doing("ok", "ok", "ok", "ok", "ok", seconds=0.6) + [RewardSample("r", "l", {"seconds": 30})]
    with RewardPool(async_misbehave, timeout_s=1.0, num_workers=1) as p:
        p.hard_limit_s = 10.0
        start = time.monotonic()
        results, stats = p.score(samples)
        elapsed = time.monotonic() - start
    assert elapsed < 3.0  # concurrent ~1 s; 5 x 0.6 s in sequence plus the 1 s limit would be 4 s
    assert [r.overall for r in results] == [1.0] * 5 + [0.0]
    assert (stats.n_timeouts, stats.n_errors, stats.n_workers_killed) == (1, 0, 0)  # cooperative: no kill needed


def test_an_async_reward_that_blocks_its_loop_is_killed_and_its_neighbours_retried():
    """A call that blocks the worker's event loop (CPU work in an `async def`) holds the other calls of its worker
    too: the worker is killed, each of its calls runs again alone, and only the blocking one scores 0."""
    samples = doing("ok", "block", "ok", seconds=0.2)
    with RewardPool(async_misbehave, timeout_s=1.0, num_workers=1) as p:
        results, stats = p.score(samples)
    assert [r.overall for r in results] == [1.0, 0.0, 1.0]
    assert results[1].error == "timeout after 1s"
    assert (stats.n_timeouts, stats.n_workers_killed) == (1, 2)  # killed with all three, then alone


def test_the_async_form_from_inside_an_event_loop():
    import asyncio

    results, stats = asyncio.run(score_batch_async(misbehave, doing("ok", "raise"), 5.0))
    assert [r.overall for r in results] == [1.0, 0.0] and stats.n_errors == 1


def test_a_reward_that_cannot_reach_a_worker_is_refused_at_start(tmp_path, monkeypatch):
    import threading

    lock = threading.Lock()

    def holds_a_lock(sample):
        with lock:
            return 1.0

    with pytest.raises(TypeError, match="cannot be sent to a worker process.*define it at module level"):
        RewardPool(holds_a_lock, timeout_s=1.0)
    # importable here, not in the worker (its folder is not on the path the workers get): the pool says why
    (tmp_path / "only_here.py").write_text("def score(sample):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from only_here import score

    monkeypatch.syspath_prepend("/nonexistent")  # keep sys.path's length; drop tmp_path from it
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p != str(tmp_path)])
    with pytest.raises(
        RewardWorkerError, match="could not load score: ModuleNotFoundError: No module named 'only_here'"
    ):
        RewardPool(score, timeout_s=1.0, num_workers=1)


def test_bad_arguments():
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        score_batch(misbehave, SAMPLES, 0.0)
    with pytest.raises(ValueError, match="num_workers and async_concurrency must be >= 1"):
        score_batch(misbehave, SAMPLES, 1.0, num_workers=0)
