"""Run a function on N gloo processes (CPU) and collect what each rank returns.

results = run_gloo(worker, 4, arg)   # worker(rank, world_size, arg) -> picklable; must be module-level

For runs that report a rank's error instead of hanging the others: `spawn_ranks(child, ...)` starts the processes
and `rank_main(...)`, called by each child, joins the group, runs the work and saves its result or its error.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, init_file: str, out_dir: str, fn: Callable, args: tuple) -> None:
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_gloo(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_entry, args=(world_size, init_file, tmp, fn, args), nprocs=world_size, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def spawn_ranks(child: Callable, world_size: int, args: tuple = (), timeout_s: float = 300.0) -> list[dict]:
    """Start `child(rank, world_size, init_file, out_dir, *args)` in `world_size` spawned processes and return what
    each saved to `out_dir/rank{rank}.pt` (rank order). The child owns its process group and error reporting.

    Raises:
        TimeoutError: a rank was still running after `timeout_s` (all ranks are killed).
        RuntimeError: a rank exited without saving a result (its exit code is named).
    """
    import torch

    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [context.Process(target=child, args=(r, world_size, init_file, tmp, *args)) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        if any(p.is_alive() for p in procs):
            for p in procs:
                p.kill()
                p.join()
            raise TimeoutError(f"{world_size}-rank run did not finish in {timeout_s} s")
        results = []
        for r, p in enumerate(procs):
            path = os.path.join(tmp, f"rank{r}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} exited with code {p.exitcode} without a result")
            results.append(torch.load(path, weights_only=False))
    return results


def rank_main(
    rank: int,
    world_size: int,
    init_file: str,
    out_dir: str,
    *,
    backend: str,
    timeout_s: float,
    body: Callable[[Any], Any],
    setup: Callable[[], Any] | None = None,
    device_id=None,
) -> None:
    """One rank of a `spawn_ranks` run: `setup()` (before the group exists, e.g. imports that must come first), join
    the `backend` group at `file://init_file`, `body(what setup returned)`; saves {"ok": result} or {"error":
    (exception type, message, traceback)} to `out_dir/rank{rank}.pt`, then tears down megatron's parallel state (when
    megatron was imported and initialized it) and the group."""
    import datetime
    import sys
    import traceback

    import torch

    out = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        prepared = setup() if setup is not None else None
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device_id,
        )
        torch.save({"ok": body(prepared)}, out)
    except BaseException as exc:  # noqa: BLE001  (reported to the parent)
        torch.save({"error": (type(exc).__name__, str(exc), traceback.format_exc())}, out)
    finally:
        if dist.is_initialized():
            if "megatron.core" in sys.modules:
                from megatron.core import parallel_state

                if parallel_state.model_parallel_is_initialized():
                    parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
