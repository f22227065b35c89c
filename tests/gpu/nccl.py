"""Run a job on N GPUs, one spawned process per GPU over NCCL, and bring back what each rank returned.

    results = run_ranks(job, world_size=2, args=(samples,))   # job(ctx: RankContext, *args) -> picklable (CPU)

The job builds megatron's parallel state itself (`ctx.init_parallel(tp, cp)`, any number of times: each call tears
the previous state down), so one spawn can hold a reference phase at CP=1 and the phase under test. A rank's
exception comes back as `RankError` with its type, message and traceback.
"""

from __future__ import annotations

import datetime
import os
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tests.dist import spawn_ranks

# NVLink multicast stays off on these machines (a program that uses it can take the host's GPUs out of service).
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass
class RankContext:
    rank: int
    world_size: int
    device: torch.device

    def init_parallel(self, tp: int = 1, cp: int = 1, seed: int = 0) -> None:
        """(Re)initialize megatron's parallel state with these sizes (DP = world / (tp * cp)) and its RNG."""
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


class RankError(RuntimeError):
    def __init__(self, rank: int, exc_type: str, message: str, tb: str) -> None:
        super().__init__(f"rank {rank} raised {exc_type}: {message}\n--- rank traceback ---\n{tb}")
        self.exc_type = exc_type


def _child(rank: int, world_size: int, init_file: str, out_dir: str, timeout_s: float, job, args) -> None:
    os.environ.update(SAFE_ENV)
    out = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=torch.device("cuda", rank),
        )
        result = job(RankContext(rank, world_size, torch.device("cuda", rank)), *args)
        torch.save({"ok": result}, out)
    except BaseException as exc:  # noqa: BLE001  (reported to the parent)
        torch.save({"error": (type(exc).__name__, str(exc), traceback.format_exc())}, out)
    finally:
        if dist.is_initialized():
            from megatron.core import parallel_state

            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


def run_ranks(job: Callable[..., Any], world_size: int, args: Sequence[Any] = (), timeout_s: float = 300.0) -> list:
    """`job(ctx, *args)` on GPUs 0..world_size-1; returns each rank's result (rank order)."""
    if torch.cuda.device_count() < world_size:
        raise RuntimeError(f"needs {world_size} GPUs, found {torch.cuda.device_count()}")
    os.environ.update(SAFE_ENV)
    results = spawn_ranks(_child, world_size, (timeout_s, job, tuple(args)), timeout_s)
    for r, res in enumerate(results):
        if "error" in res:
            raise RankError(r, *res["error"])
    return [res["ok"] for res in results]
