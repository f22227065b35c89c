"""Run a function on N gloo processes (CPU) and collect what each rank returns.

results = run_gloo(worker, 4, arg)   # worker(rank, world_size, arg) -> picklable; must be module-level
"""

from __future__ import annotations

import os
import tempfile
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
    import datetime

    import torch

    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [context.Process(target=child, args=(r, world_size, init_file, tmp, *args)) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        for p in procs:
            p.join(max(0.0, (deadline - datetime.datetime.now()).total_seconds()))
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
