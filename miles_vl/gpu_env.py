"""The environment every GPU process of a job shares: the driver's Ray workers (orchestration/placement.py puts it in
the job's runtime env) and every SGLang server (rollout/sglang/server.py `build_server_env`). A leaf: imports nothing
of miles_vl, so placement and weight sync read it without importing an engine.

- NVLink multicast off in NCCL, PyTorch and NVSHMEM: on shared hosts a program that uses it can take the GPUs out of
  service.
- One `NCCL_CUMEM_ENABLE` for all NCCL peers. SGLang 0.5.16 sets it to 0 in its server unless the variable is already
  set (`_set_envs_and_config`, srt/entrypoints/engine.py). NCCL opens a peer's buffers the way its OWN setting says,
  so a trainer at NCCL's default (cuMem on) and a server at 0 fail at the first broadcast of the disaggregated weight
  sync with "Cuda failure 'invalid argument'" (issue 32). NCCL reads the variable once per process, so it must be in
  the environment from process start.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
CUMEM_ENV = "NCCL_CUMEM_ENABLE"

__all__ = ["CUMEM_ENV", "NO_MULTICAST_ENV", "nccl_peer_env"]


def nccl_peer_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """`{"NCCL_CUMEM_ENABLE": value}`: the value `environ` (default: ours) sets, else "0", SGLang's own choice."""
    environ = os.environ if environ is None else environ
    return {CUMEM_ENV: environ.get(CUMEM_ENV, "0")}
