"""Scoring a batch of responses in worker processes: sync and async rewards, a hard time limit per sample, failures
counted.

    with RewardPool(fn, timeout_s=10.0, num_workers=2) as pool:       # the driver keeps one for the whole job
        results, stats = pool.score(samples)
    results, stats = score_batch(fn, samples, timeout_s=10.0)          # one-off: a pool for this batch
    results, stats = await score_batch_async(fn, samples, timeout_s=10.0)  # the same, from inside an event loop

A reward that raises, returns something that is not a score (`types.to_reward_result`), or runs past `timeout_s`
scores 0 for that sample; the sample's `RewardResult.error` says why, `RewardStats` counts errors and timeouts,
each failure is logged (the first few in full), and the run continues.

The time limit is hard. Every call runs in a worker process (`worker.py`: `python -P -m miles_vl.reward.worker`, its
own session, started once per pool, importing from the driver's `sys.path` in its order); a sync reward runs one
call at a time per worker, and when a call passes its limit the pool kills the worker's whole process group
(SIGKILL: sympy, C extensions and subprocesses the reward started stop too) and starts a new one. `async def`
rewards run `async_concurrency` calls at once per worker under `asyncio.timeout`; a worker whose event loop is
blocked past the limit (plus a small grace) is killed the same way. Which of its calls blocked it cannot be told
from outside, so each call it held runs again alone on a fresh worker (once): the blocking one then times out, the
others are scored. The time limit counts from the start of each call, not from when it was queued. A worker that
dies on its own (a crash in the reward) fails the calls it held, as errors.

A batched reward (`types.reward_function(batched=True)`) is one call per `score`, with the whole batch, under the
same time limit (for the call, not per sample); a failure of the call fails every sample of it, counted.

The reward function is sent to each worker when the pool starts: by reference when plain pickle can (a module-level
function, as a `module:function` path gives it, or a `functools.partial` of one: the worker imports its module),
else by value with Ray's cloudpickle (a lambda, a closure, a function defined in the `__main__` of a script or
notebook: what `run_job(cfg, reward_fn=...)` may get). A worker that cannot load it fails the pool's construction
with the reason.

Several weighted functions (`reward.functions`): `WeightedRewards`, one pool per function, scored side by side;
each sample's `overall` is the weighted sum, each function's own score is kept in `RewardResult.by_function`, and a
function that fails or times out on a sample adds 0 for that sample and counts in the errors or timeouts.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from miles_vl.reward.types import RewardFn, RewardResult, RewardSample, is_async_reward, reward_name, reward_traits

logger = logging.getLogger(__name__)

_LOGGED_FAILURES = 5  # per batch; the rest only count
START_TIMEOUT_S = 120.0  # a worker that has not loaded the reward function by then fails the pool


class RewardWorkerError(RuntimeError):
    """A reward worker process could not start or load the reward function (the message has its reason)."""


@dataclass(frozen=True)
class RewardStats:
    """Counts and means over one scored batch (failed samples count in `overall_mean` with their 0)."""

    n_samples: int
    n_errors: int  # raised, or returned something that is not a finite score within +-MAX_ABS_REWARD
    n_timeouts: int
    overall_mean: float
    accuracy_mean: float | None  # over samples that reported accuracy; None if none did
    format_mean: float | None  # over samples that reported format; None if none did
    n_workers_killed: int = 0  # workers stopped by the time limit (and replaced) while scoring this batch

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


# ---------------------------------------------------------------------------------------------------------------------
# the pool


@dataclass
class _Batch:
    """The state of one `score` call."""

    samples: Sequence[RewardSample]
    results: list[RewardResult | None]
    failures: list[str | None]
    queue: collections.deque  # task ids (sample indices) not yet sent
    alone: set[int] = field(default_factory=set)  # tasks to run with no other call in their worker


@dataclass
class _Worker:
    proc: subprocess.Popen
    conn: Connection
    ready: bool = False
    started: float = field(default_factory=time.monotonic)
    inflight: dict[int, float] = field(default_factory=dict)  # task id -> deadline (time.monotonic)


class RewardPool:
    """`num_workers` processes that score samples with `fn` under a hard time limit (module docstring).

    Args:
        fn: a reward function (`miles_vl.reward.types`), picklable.
        timeout_s: time limit per sample in seconds.
        num_workers: worker processes.
        async_concurrency: calls at once per worker for an `async def` reward (a sync one runs one at a time).

    Raises:
        ValueError: timeout_s <= 0, num_workers < 1 or async_concurrency < 1.
        TypeError: `fn` cannot be pickled (a lambda or a function defined inside another).
        RewardWorkerError: a worker could not load `fn`.
    """

    def __init__(self, fn: RewardFn, *, timeout_s: float, num_workers: int = 2, async_concurrency: int = 32):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, found {timeout_s}; fix reward.timeout_s")
        if num_workers < 1 or async_concurrency < 1:
            raise ValueError(
                f"num_workers and async_concurrency must be >= 1, found {num_workers} and {async_concurrency}; fix "
                "reward.num_workers / reward.async_concurrency"
            )
        self.name = reward_name(fn)
        self.payload = to_payload(fn)
        self.timeout_s = float(timeout_s)
        self.traits = reward_traits(fn)
        self.images = self.traits.images  # whether the samples must carry the prompt's images
        self.is_async = is_async_reward(fn)
        self.capacity = async_concurrency if self.is_async else 1
        # async calls time out inside the worker; the kill is the backstop for a blocked event loop
        self.hard_limit_s = self.timeout_s * 1.1 + 0.5 if self.is_async else self.timeout_s
        self.workers: list[_Worker] = []
        self.killed = 0  # workers killed by the time limit, over the pool's life
        try:
            self.workers = [self._start() for _ in range(num_workers)]
            for w in self.workers:
                self._wait_ready(w)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def score(self, samples: Sequence[RewardSample]) -> tuple[list[RewardResult], RewardStats]:
        """Score every sample.

        Returns:
            (results in sample order, stats).

        Raises:
            RewardWorkerError: a replacement worker could not start.
        """
        n = len(samples)
        if self.traits.batched and n:  # one task: the whole batch (its answer is expanded below)
            batch = _Batch([list(samples)], [None], [None], collections.deque([0]))
        else:
            batch = _Batch(samples, [None] * n, [None] * n, collections.deque(range(n)))
        killed_before = self.killed
        while batch.queue or any(w.inflight for w in self.workers):
            self._dispatch(batch)
            busy = [w for w in self.workers if w.inflight or not w.ready]
            deadlines = [d for w in busy for d in w.inflight.values()]
            deadlines += [w.started + START_TIMEOUT_S for w in busy if not w.ready]
            wait([w.conn for w in busy], timeout=max(0.0, min(deadlines) - time.monotonic()))
            for i, w in enumerate(self.workers):
                self.workers[i] = self._collect(w, batch)
        if self.traits.batched and n:
            batch.results, batch.failures = _expand(batch.results[0], batch.failures[0], n)
        done = [r if r is not None else RewardResult(overall=0.0, error="not scored") for r in batch.results]
        stats = _stats(done, batch.failures, self.killed - killed_before)
        _log_failures(self.name, done, stats)
        return done, stats

    def close(self) -> None:
        """Stop every worker (closing the socket ends a worker; a hung one is killed)."""
        for w in self.workers:
            w.conn.close()
        for w in self.workers:
            try:
                w.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                _kill(w)
        self.workers = []

    # -- internals ---------------------------------------------------------------------------------------------------

    def _start(self) -> _Worker:
        parent, child = socket.socketpair()
        # The driver's sys.path in its order (the working directory after the installed packages: import_path), and
        # -P: no working directory put before it, as `python -m` would
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p or os.getcwd() for p in sys.path))
        try:
            proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "miles_vl.reward.worker", str(child.fileno())],
                pass_fds=(child.fileno(),),
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C at the terminal reaches the driver, which stops the workers
            )
        finally:
            child.close()
        conn = Connection(parent.detach())
        conn.send_bytes(self.payload)
        return _Worker(proc, conn)

    def _wait_ready(self, w: _Worker) -> None:
        if not w.conn.poll(START_TIMEOUT_S):
            raise RewardWorkerError(f"a reward worker did not load {self.name} in {START_TIMEOUT_S:.0f} s")
        self._on_ready(w, w.conn.recv())

    def _on_ready(self, w: _Worker, msg: tuple) -> None:
        if msg[0] != "ready":
            raise RewardWorkerError(f"a reward worker could not load {self.name}: {msg[1]}")
        w.ready = True

    def _dispatch(self, batch: _Batch) -> None:
        for w in self.workers:
            while w.ready and batch.queue and len(w.inflight) < self.capacity:
                if batch.alone & w.inflight.keys() or (batch.queue[0] in batch.alone and w.inflight):
                    break
                task = batch.queue.popleft()
                w.conn.send((task, batch.samples[task], self.timeout_s))
                w.inflight[task] = time.monotonic() + self.hard_limit_s

    def _collect(self, w: _Worker, batch: _Batch) -> _Worker:
        """Take what worker `w` answered; kill it if a call passed its limit; returns `w` or its replacement."""
        try:
            while w.conn.poll():
                msg = w.conn.recv()
                if not w.ready:
                    self._on_ready(w, msg)
                    continue
                task, result, failure = msg
                if w.inflight.pop(task, None) is not None:
                    batch.results[task], batch.failures[task] = result, failure
        except (EOFError, OSError):
            code = w.proc.wait()
            for task in w.inflight:
                error = f"the reward worker process died (exit code {code})"
                batch.results[task], batch.failures[task] = RewardResult(overall=0.0, error=error), "error"
            logger.warning("reward worker %d died (exit code %s); starting another", w.proc.pid, code)
            _kill(w)
            return self._start()
        if not w.ready and time.monotonic() > w.started + START_TIMEOUT_S:
            raise RewardWorkerError(f"a reward worker did not load {self.name} in {START_TIMEOUT_S:.0f} s")
        now = time.monotonic()
        overdue = [task for task, deadline in w.inflight.items() if deadline <= now]
        if not overdue:
            return w
        if len(w.inflight) == 1 or overdue[0] in batch.alone:  # this call alone held the worker past its limit
            for task in overdue:
                batch.results[task] = RewardResult(overall=0.0, error=f"timeout after {self.timeout_s:g}s")
                batch.failures[task] = "timeout"
                del w.inflight[task]
        else:  # an async worker's loop was blocked by one of its calls: each runs again alone
            batch.alone |= w.inflight.keys()
        batch.queue.extendleft(sorted(w.inflight, reverse=True))
        _kill(w)
        self.killed += 1
        return self._start()


def to_payload(fn: RewardFn) -> bytes:
    """`fn` pickled for the workers: by reference when pickle can, else by value with Ray's cloudpickle.

    Raises:
        TypeError: neither can pickle it (it holds a lock, a socket, an open file...).
    """
    try:
        payload = pickle.dumps(fn)
    except Exception:  # a lambda or a closure
        payload = b"__main__"
    if b"__main__" not in payload:  # a reference to __main__ would not load: the workers' __main__ is worker.py
        return payload
    from ray import cloudpickle  # imported only here: Ray ships it; most rewards never need it

    try:
        return cloudpickle.dumps(fn)
    except Exception as err:
        raise TypeError(
            f"reward {reward_name(fn)} cannot be sent to a worker process ({type(err).__name__}: {err}); define it at "
            "module level and give it as 'package.module:function', or keep unpicklable state (locks, clients) out "
            "of it and create that inside the function"
        ) from err


def _expand(result: Any, failure: Any, n: int) -> tuple[list, list]:
    """A batched call's answer as one result and failure per sample (a failed call fails all `n`)."""
    if isinstance(result, list):
        return result, failure
    return [result] * n, [failure] * n


def _kill(w: _Worker) -> None:
    """SIGKILL the worker's process group (the reward may have started processes of its own)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(w.proc.pid, signal.SIGKILL)
    w.proc.wait()
    w.conn.close()


# ---------------------------------------------------------------------------------------------------------------------
# several weighted functions


@dataclass(frozen=True)
class WeightedReward:
    """One term of a weighted sum of rewards: `label` names its metrics (`reward/<label>/mean`)."""

    label: str
    weight: float
    fn: RewardFn


class WeightedRewards:
    """Several reward functions, each in its own `RewardPool`; a sample's `overall` is the weighted sum of theirs.

    `score` returns what `RewardPool.score` does: results carry `by_function` (each function's own `overall`, and
    its `accuracy`/`format` as `<label>/accuracy`, `<label>/format` when it reports them); `accuracy` and `format`
    themselves are kept only with one function. Errors and timeouts are counted per function and sample; a failed
    term adds 0, and the sample's `error` names the function.

    Args:
        rewards: the terms, with distinct labels.
        timeout_s, num_workers, async_concurrency: for each function's pool (`RewardPool`).

    Raises:
        ValueError: no term, or two with one label; and as `RewardPool`.
    """

    def __init__(
        self, rewards: Sequence[WeightedReward], *, timeout_s: float, num_workers: int = 2, async_concurrency: int = 32
    ):
        labels = [r.label for r in rewards]
        if not rewards or len(set(labels)) != len(labels):
            raise ValueError(f"reward functions need distinct labels and at least one function, found {labels}")
        self.rewards = list(rewards)
        self.pools: list[RewardPool] = []
        try:
            for r in self.rewards:
                self.pools.append(
                    RewardPool(r.fn, timeout_s=timeout_s, num_workers=num_workers, async_concurrency=async_concurrency)
                )
        except BaseException:
            self.close()
            raise
        self.images = any(p.images for p in self.pools)

    def __enter__(self) -> WeightedRewards:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for pool in self.pools:
            pool.close()

    def score(self, samples: Sequence[RewardSample]) -> tuple[list[RewardResult], RewardStats]:
        """Score every sample with every function (the pools side by side); see the class docstring."""
        if len(self.pools) == 1:
            scored = [self.pools[0].score(samples)]
        else:
            with ThreadPoolExecutor(len(self.pools)) as ex:
                scored = list(ex.map(lambda pool: pool.score(samples), self.pools))
        results = [self._combine([rs[i] for rs, _ in scored]) for i in range(len(samples))]
        each = [stats for _, stats in scored]
        stats = _stats(results, [], sum(s.n_workers_killed for s in each))
        stats = dataclasses.replace(
            stats, n_errors=sum(s.n_errors for s in each), n_timeouts=sum(s.n_timeouts for s in each)
        )
        return results, stats

    def _combine(self, parts: list[RewardResult]) -> RewardResult:
        by_function: dict[str, float] = {}
        for r, part in zip(self.rewards, parts, strict=True):
            by_function[r.label] = part.overall
            for key in ("accuracy", "format"):
                if getattr(part, key) is not None:
                    by_function[f"{r.label}/{key}"] = getattr(part, key)
        errors = [f"{r.label}: {part.error}" for r, part in zip(self.rewards, parts, strict=True) if part.error]
        one = parts[0] if len(parts) == 1 else None
        return RewardResult(
            overall=sum(r.weight * part.overall for r, part in zip(self.rewards, parts, strict=True)),
            accuracy=one.accuracy if one else None,
            format=one.format if one else None,
            error="; ".join(errors) or None,
            by_function=by_function,
        )


# ---------------------------------------------------------------------------------------------------------------------
# one-off batches


def score_batch(
    fn: RewardFn,
    samples: Sequence[RewardSample],
    timeout_s: float,
    *,
    num_workers: int = 2,
    async_concurrency: int = 32,
) -> tuple[list[RewardResult], RewardStats]:
    """Score every sample with `fn` (sync or async) in a pool made for this batch (see `RewardPool`).

    Args:
        fn: a reward function (see `miles_vl.reward.types`), e.g. from `resolve_reward`; picklable.
        samples: the responses to score.
        timeout_s: time limit per sample in seconds; a call that runs longer is killed and scores 0.
        num_workers: worker processes.
        async_concurrency: calls at once per worker for an `async def` reward.

    Returns:
        (results in sample order, stats).

    Raises:
        ValueError: timeout_s <= 0, num_workers < 1 or async_concurrency < 1.
        TypeError: `fn` is not picklable.
        RewardWorkerError: a worker could not load `fn`.
    """
    with RewardPool(fn, timeout_s=timeout_s, num_workers=num_workers, async_concurrency=async_concurrency) as pool:
        return pool.score(samples)


def _in_a_thread[**P, R](fn: Callable[P, R], name: str, doc: str) -> Callable[P, Coroutine[Any, Any, R]]:
    """`fn` as an `async def` named `name` that runs it in a thread (`asyncio.to_thread`), so the caller's event loop
    stays free; it takes `fn`'s parameters (`functools.wraps`: `inspect.signature` shows them, type checkers see them
    through `P`)."""

    @functools.wraps(fn)
    async def in_a_thread(*args: P.args, **kwargs: P.kwargs) -> R:
        return await asyncio.to_thread(fn, *args, **kwargs)

    in_a_thread.__name__ = in_a_thread.__qualname__ = name
    in_a_thread.__doc__ = doc
    return in_a_thread


score_batch_async = _in_a_thread(
    score_batch,
    "score_batch_async",
    "`score_batch` from inside a running event loop (the pool runs in a thread; the loop stays free).",
)


# ---------------------------------------------------------------------------------------------------------------------


def _stats(results: list[RewardResult], failures: list[str | None], killed: int) -> RewardStats:
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
        n_workers_killed=killed,
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
