"""Distributed checkpoints of the megatron backend (megatron-core `dist_checkpointing`, torch_dist format).

    save_checkpoint(directory, model, optimizer, {"optimizer_steps": 3})   # collective: every rank calls it
    state = load_checkpoint(directory, model, optimizer)                   # -> {"optimizer_steps": 3}

Each rank writes its shards of the model (`sharded_state_dict` of the unwrapped chunks) and of the distributed
optimizer (fp32 main weights and Adam moments, "dp_reshardable": a checkpoint resumes on another DP size but the
same TP/PP/CP/EP sizes). Plain values in `trainer_state` (counters) go to the common part that rank 0 writes.
RNG states are not saved: the RL step uses no dropout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

_MODEL_KEY = "model{}"
_STATE_KEY = "trainer_state"


def _metadata(groups_dp_cp) -> dict[str, Any]:
    return {
        "distrib_optim_sharding_type": "dp_reshardable",
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": groups_dp_cp,
    }


def _sharded_state(model: list, optimizer, metadata: dict, *, is_loading: bool) -> dict:
    from megatron.core.utils import unwrap_model

    state: dict[str, Any] = {}
    for i, chunk in enumerate(model):
        state[_MODEL_KEY.format(i)] = unwrap_model(chunk).sharded_state_dict(metadata=metadata)
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=metadata)
    return state


def save_checkpoint(
    directory: Path, model: list, optimizer, trainer_state: dict[str, Any], *, dp_cp_group=None
) -> None:
    """Write model and optimizer shards and `trainer_state` to `directory` (created; must be empty or new).

    Args:
        directory: the checkpoint folder, on storage every rank can reach.
        model: model chunks.
        optimizer: megatron optimizer (None: model only).
        trainer_state: picklable counters (same on every rank).
        dp_cp_group: the DP x CP group (megatron's default when None).
    """
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    metadata = _metadata(dp_cp_group)
    state = _sharded_state(model, optimizer, metadata, is_loading=False)
    state[_STATE_KEY] = dict(trainer_state)
    dist_checkpointing.save(state, str(directory), content_metadata=_content(metadata))
    dist.barrier()


def load_checkpoint(directory: Path, model: list, optimizer, *, dp_cp_group=None) -> dict[str, Any]:
    """Load what `save_checkpoint` wrote into `model` (and `optimizer`); returns the trainer state.

    Raises:
        FileNotFoundError: `directory` is not a megatron distributed checkpoint.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.utils import unwrap_model

    directory = Path(directory)
    if not (directory / "metadata.json").exists():
        raise FileNotFoundError(
            f"{directory} is not a megatron distributed checkpoint (no metadata.json); point train resume at a "
            "folder written by the megatron backend's save_checkpoint"
        )
    metadata = _metadata(dp_cp_group)
    state = _sharded_state(model, optimizer, metadata, is_loading=True)
    loaded = dist_checkpointing.load(state, str(directory))
    for i, chunk in enumerate(model):
        unwrap_model(chunk).load_state_dict(loaded[_MODEL_KEY.format(i)])
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
        sync_offloaded_optimizer(optimizer)
    return dict(loaded.get(_STATE_KEY, {}))


def sync_offloaded_optimizer(optimizer) -> int:
    """Hand a loaded optimizer state to the sub-optimizers of every HybridDeviceOptimizer (train.optimizer.cpu_offload);
    returns how many there were.

    megatron-core 0.19.2's "dp_reshardable" load writes the checkpoint's fp32 main weights and moments into the
    HybridDeviceOptimizer's `state` but, unlike its "fully_reshardable" and "fully_sharded_model_space" loads
    (distrib_optimizer.py), does not call `_sync_hdo_state_to_sub_optimizers()`: the CPU AdamW would go on stepping
    the fp32 main weights the load's placeholder left (`torch.empty`), and the first step after a resume would write
    those into the model. This is that call.
    """
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    synced = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, HybridDeviceOptimizer):
            inner._sync_hdo_state_to_sub_optimizers()
            synced += 1
    return synced  # the common (non-sharded) part comes back with the shards


def _content(metadata: dict) -> dict:
    """The JSON-able part of the metadata (the process group stays out of the file)."""
    return {k: v for k, v in metadata.items() if k != "dp_cp_group"}
