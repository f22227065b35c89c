"""One reward worker process: loads the reward function once, then scores the samples the pool sends it.

    python -P -m miles_vl.reward.worker FD   # started by `scoring.RewardPool`, never by hand

Protocol over the connected socket FD (`multiprocessing.connection.Connection` framing, pickled messages):
    pool -> worker   the pickled reward function (bytes), once
    worker -> pool   ("ready",) or ("init_error", message)
    pool -> worker   (task_id, RewardSample, timeout_s)                 any number, as the pool's capacity allows
    worker -> pool   (task_id, RewardResult, failure)                   failure: None | "error" | "timeout"
A batched reward (`types.reward_function(batched=True)`) gets one task per batch, with a list of samples, and
answers a list of results and a list of failures (or one result and failure when the whole call failed).

A sync reward runs one call at a time in this process's main thread; the pool kills the process when a call runs
past its time limit (so CPU-bound work, C extensions and sympy included, stops). An `async def` reward runs up to the
pool's capacity of calls concurrently on an event loop here, each under `asyncio.timeout`; the pool kills the
process if the loop itself stops answering (a coroutine that blocks it). The worker ignores SIGINT (it lives in its
own session; the pool stops it) and exits when the pool's end of the socket closes, or, should it be inside a call
that does not return, within a second of the pool's process dying.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import pickle
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from miles_vl.reward.types import (
    RewardResult,
    RewardSample,
    RewardTraits,
    batch_arguments,
    is_async_reward,
    reward_name,
    reward_traits,
    to_batch_results,
    to_reward_result,
)


def main(fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    conn = Connection(fd)
    try:
        fn = pickle.loads(conn.recv_bytes())
    except EOFError:
        return
    except BaseException as err:  # an import error of the reward's module, typically: the pool raises it
        conn.send(("init_error", f"{type(err).__name__}: {err}"))
        return
    conn.send(("ready",))
    if is_async_reward(fn):
        asyncio.run(_serve_async(conn, fn))
    else:
        _serve_sync(conn, fn)


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _serve_sync(conn: Connection, fn: Any) -> None:
    while True:
        try:
            task_id, sample, _ = conn.recv()  # the pool enforces the time limit of a sync call by killing us
        except EOFError:
            return
        try:
            raw = _call(fn, sample)
            if inspect.isawaitable(raw):  # a sync callable that returned a coroutine
                raw = asyncio.run(_awaited(raw))
            conn.send((task_id, *_results(fn, sample, raw)))
        except Exception as err:  # any failure of user code scores 0; the batch goes on
            conn.send((task_id, _failed(err), "error"))


def _call(fn: Any, payload: RewardSample | list[RewardSample]) -> Any:
    traits: RewardTraits = reward_traits(fn)
    if traits.batched:
        return fn(**batch_arguments(payload, images=traits.images))
    return fn(payload)


def _results(fn: Any, payload: RewardSample | list[RewardSample], raw: Any) -> tuple[Any, Any]:
    """(result, failure) of one call: lists of them for a batched reward (types.to_batch_results checks the length)."""
    if not isinstance(payload, list):
        return to_reward_result(raw), None
    items = to_batch_results(reward_name(fn), raw, len(payload))
    results = [r if isinstance(r, RewardResult) else _failed(r) for r in items]
    return results, [None if isinstance(r, RewardResult) else "error" for r in items]


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


async def _serve_async(conn: Connection, fn: Any) -> None:
    loop = asyncio.get_running_loop()
    closed = asyncio.Event()
    tasks: set[asyncio.Task] = set()

    def on_readable() -> None:
        try:
            while conn.poll():
                task = loop.create_task(_one_async(conn, fn, *conn.recv()))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except (EOFError, OSError):
            loop.remove_reader(conn.fileno())
            closed.set()

    loop.add_reader(conn.fileno(), on_readable)
    await closed.wait()
    for task in tasks:
        task.cancel()


async def _one_async(
    conn: Connection, fn: Any, task_id: int, sample: RewardSample | list[RewardSample], timeout_s: float
) -> None:
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            raw = await _call(fn, sample)
        out = (task_id, *_results(fn, sample, raw))
    except TimeoutError as err:
        if deadline.expired():
            out = (task_id, RewardResult(overall=0.0, error=f"timeout after {timeout_s}s"), "timeout")
        else:  # the reward's own TimeoutError (e.g. from a service it calls) is an error, not our limit
            out = (task_id, _failed(err), "error")
    except Exception as err:
        out = (task_id, _failed(err), "error")
    conn.send(out)


def _failed(err: BaseException) -> RewardResult:
    return RewardResult(overall=0.0, error=f"{type(err).__name__}: {err}")


if __name__ == "__main__":
    main(int(sys.argv[1]))
