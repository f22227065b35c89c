"""Scoring a batch of responses: sync and async reward functions, a time limit per sample, failures counted.

    results, stats = score_batch(fn, samples, timeout_s=10.0)          # from plain code
    results, stats = await score_batch_async(fn, samples, timeout_s=10.0)  # from inside an event loop

A reward that raises, returns something that is not a score, or runs past `timeout_s` scores 0 for that sample;
the sample's `RewardResult.error` says why, `RewardStats` counts errors and timeouts, each failure is logged (the
first few in full), and the run continues.

How functions run: `async def` rewards run concurrently on the event loop. Sync rewards each run in a daemon
thread, so a hung reward cannot block the batch or the process exit; at most `max_concurrency` calls of either
kind run at once. The time limit counts from the start of each call, not from when it was queued. Python cannot
kill a thread: a sync reward that never returns is abandoned (it keeps a thread and, if CPU-bound, a share of the
GIL), so a reward that can hang for good should be `async` or run its work in a subprocess.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from miles_vl.reward.types import RewardFn, RewardResult, RewardSample, to_reward_result

logger = logging.getLogger(__name__)

_LOGGED_FAILURES = 5  # per batch; the rest only count


@dataclass(frozen=True)
class RewardStats:
    """Counts and means over one scored batch (failed samples count in `overall_mean` with their 0)."""

    n_samples: int
    n_errors: int  # raised, or returned something that is not a finite score
    n_timeouts: int
    overall_mean: float
    accuracy_mean: float | None  # over samples that reported accuracy; None if none did
    format_mean: float | None  # over samples that reported format; None if none did

    def as_dict(self) -> dict[str, float]:
        """Flat metrics for logging (`reward_*`); means that are None are left out."""
        out = {
            "reward_overall": self.overall_mean,
            "reward_errors": float(self.n_errors),
            "reward_timeouts": float(self.n_timeouts),
        }
        if self.accuracy_mean is not None:
            out["reward_accuracy"] = self.accuracy_mean
        if self.format_mean is not None:
            out["reward_format"] = self.format_mean
        return out


def score_batch(
    fn: RewardFn, samples: Sequence[RewardSample], timeout_s: float, *, max_concurrency: int = 64
) -> tuple[list[RewardResult], RewardStats]:
    """Score every sample with `fn` (sync or async) from synchronous code.

    Args:
        fn: a reward function (see `miles_vl.reward.types`), e.g. from `resolve_reward`.
        samples: the responses to score.
        timeout_s: time limit per sample in seconds; a call that runs longer scores 0.
        max_concurrency: calls running at once.

    Returns:
        (results in sample order, stats).

    Raises:
        RuntimeError: called while an event loop is running in this thread; use `await score_batch_async(...)`.
        ValueError: timeout_s <= 0 or max_concurrency < 1.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(score_batch_async(fn, samples, timeout_s, max_concurrency=max_concurrency))
    raise RuntimeError(
        "score_batch was called from inside a running event loop; use `await score_batch_async(...)` there"
    )


async def score_batch_async(
    fn: RewardFn, samples: Sequence[RewardSample], timeout_s: float, *, max_concurrency: int = 64
) -> tuple[list[RewardResult], RewardStats]:
    """Score every sample with `fn` (sync or async) inside a running event loop. Arguments as `score_batch`.

    Raises:
        ValueError: timeout_s <= 0 or max_concurrency < 1.
    """
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, found {timeout_s}; fix reward.timeout_s")
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, found {max_concurrency}")
    slots = asyncio.Semaphore(max_concurrency)
    is_async = _is_async(fn)
    name = getattr(fn, "__qualname__", None) or getattr(getattr(fn, "func", None), "__qualname__", repr(fn))

    async def one(sample: RewardSample) -> tuple[RewardResult, str | None]:
        async with slots:
            deadline = asyncio.timeout(timeout_s)
            try:
                async with deadline:
                    raw = await fn(sample) if is_async else await _in_daemon_thread(fn, sample)
                    if inspect.isawaitable(raw):  # a sync callable that returned a coroutine
                        raw = await raw
                return to_reward_result(raw), None
            except TimeoutError as err:
                if deadline.expired():
                    return RewardResult(overall=0.0, error=f"timeout after {timeout_s}s"), "timeout"
                return RewardResult(overall=0.0, error=f"{type(err).__name__}: {err}"), "error"
            except Exception as err:  # any failure of user code scores 0; the run goes on
                return RewardResult(overall=0.0, error=f"{type(err).__name__}: {err}"), "error"

    scored = await asyncio.gather(*(one(s) for s in samples))
    results = [result for result, _ in scored]
    stats = _stats(results, [failure for _, failure in scored])
    _log_failures(name, results, stats)
    return results, stats


def _is_async(fn: Any) -> bool:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004


def _in_daemon_thread(fn: RewardFn, sample: RewardSample) -> asyncio.Future:
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if future.done():  # cancelled by the time limit
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def target() -> None:
        try:
            out, ok = fn(sample), True
        except BaseException as err:  # handed to the awaiting task, which turns it into a 0 score
            out, ok = err, False
        try:
            loop.call_soon_threadsafe(settle, ok, out)
        except RuntimeError:  # the loop finished while this call was abandoned after its time limit
            pass

    threading.Thread(target=target, name="miles-vl-reward", daemon=True).start()
    return future


def _stats(results: list[RewardResult], failures: list[str | None]) -> RewardStats:
    n = len(results)
    acc = [r.accuracy for r in results if r.accuracy is not None]
    fmt = [r.format for r in results if r.format is not None]
    return RewardStats(
        n_samples=n,
        n_errors=failures.count("error"),
        n_timeouts=failures.count("timeout"),
        overall_mean=sum(r.overall for r in results) / n if n else 0.0,
        accuracy_mean=sum(acc) / len(acc) if acc else None,
        format_mean=sum(fmt) / len(fmt) if fmt else None,
    )


def _log_failures(name: str, results: list[RewardResult], stats: RewardStats) -> None:
    failed = [(i, r.error) for i, r in enumerate(results) if r.error is not None]
    for i, error in failed[:_LOGGED_FAILURES]:
        logger.warning("reward %s failed on sample %d, scored 0: %s", name, i, error)
    if failed:
        logger.warning(
            "reward %s: %d of %d samples scored 0 (%d errors, %d timeouts)",
            name,
            len(failed),
            stats.n_samples,
            stats.n_errors,
            stats.n_timeouts,
        )
