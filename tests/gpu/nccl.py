"""Run a job on N GPUs, one spawned process per GPU over NCCL, and bring back what each rank returned.

    results = run_ranks(job, world_size=2, args=(samples,))   # job(ctx: RankContext, *args) -> picklable (CPU)

The job builds megatron's parallel state itself (`ctx.init_parallel(tp, cp)`, any number of times: each call tears
the previous state down), so one spawn can hold a reference phase at CP=1 and the phase under test. A rank's
exception comes back as `RankError` with its type, message and traceback.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tests.dist import rank_main, spawn_ranks

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
    device = torch.device("cuda", rank)
    rank_main(
        rank,
        world_size,
        init_file,
        out_dir,
        backend="nccl",
        timeout_s=timeout_s,
        setup=lambda: torch.cuda.set_device(device),
        body=lambda _: job(RankContext(rank, world_size, device), *args),
        device_id=device,
    )


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
