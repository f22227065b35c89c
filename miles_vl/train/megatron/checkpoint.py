"""Distributed checkpoints of the megatron backend (megatron-core `dist_checkpointing`, torch_dist format).

    save_checkpoint(directory, model, optimizer, {"optimizer_steps": 3})   # collective: every rank calls it
    write = start_save(directory, model, optimizer, {"optimizer_steps": 3}) # collective; returns once staged
    ...                                                                    # training goes on
    write.done(); write.wait()                                             # collective; wait raises a failed write
    state = load_checkpoint(directory, model, optimizer)                   # -> {"optimizer_steps": 3}
    save_checkpoint(directory, model, None, {"optimizer_steps": 3})        # the model only (no optimizer state)

Each rank writes its shards of the model (`sharded_state_dict` of the unwrapped chunks) and of the distributed
optimizer (fp32 main weights and Adam moments, "dp_reshardable": a checkpoint resumes on another DP size but the
same TP/PP/CP/EP sizes). Plain values in `trainer_state` (counters) go to the common part that rank 0 writes.
RNG states are not saved: the RL step uses no dropout. A save without the optimizer (checkpoint.optimizer_state=
false: the model's shards only, 1/7 of the bytes with bf16 weights and fp32 optimizer state) says so in its content
metadata (`"optimizer_state": false`); its load leaves the optimizer's moments as built and refreshes its fp32 main
weights from the loaded model (megatron's `reload_model_params`).

Background writes (`start_save`, checkpoint.async_save) are megatron-core 0.19's own: `dist_checkpointing.save(...,
async_sharded_save=True, async_strategy="mcore")` plans the save (collective) and returns an `AsyncRequest`, which an
`AsyncCallsQueue` schedules: its `preload_fn` copies every shard to host memory in this process (so the next
optimizer step does not change what is written; on the CPU, where that copies nothing, the forked child's
copy-on-write memory holds the state of the call), then a forked process (`TemporalAsyncCaller`: fork, no CUDA in the
child) writes the `.distcp` files. A rank that holds only replicas (CP or DP ranks > 0) has nothing to write and forks
nothing. `maybe_finalize_async_calls` all-reduces "is any rank still writing"; once none is, every rank gathers the
write results, rank 0 writes `.metadata` and `metadata.json` (only when every rank's write succeeded), and a rank's
failed write is raised on every rank (`CheckpointException`, a BaseException; the writer's own error is only logged
by the writer, its class name kept). So the checkpoint is complete when `done()` or `wait()` returns on every rank;
the driver publishes it only then (orchestration/checkpoint.py). "mcore" rather than megatron's default "nvrx":
nvidia-resiliency-ext is not part of the GPU stack. On CPU the megatron-core code needs two CUDA calls stood in
(`torch.cuda.current_device`, `torch.cuda.synchronize`: the tests' shims, tests/patches/harness/shims.py); nothing
else in it needs a GPU, and gloo carries its collectives. Nothing ties the writer process to its train actor's life:
if the actor is killed (a second signal, a stalled sync's `ray.kill`) the writer may go on until its write ends or
fails, into a temporary directory that no resume reads and that the next save removes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch.distributed as dist

_MODEL_KEY = "model{}"
_STATE_KEY = "trainer_state"
_OPTIMIZER_STATE = "optimizer_state"  # in the content metadata: whether the optimizer's shards were saved


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
        optimizer: megatron optimizer (None: model only; `load_checkpoint` then starts the optimizer afresh).
        trainer_state: picklable counters (same on every rank).
        dp_cp_group: the DP x CP group (megatron's default when None).
    """
    from megatron.core import dist_checkpointing

    state, content = _state_to_save(Path(directory), model, optimizer, trainer_state, dp_cp_group)
    dist_checkpointing.save(state, str(directory), content_metadata=content)
    dist.barrier()


def _state_to_save(directory: Path, model: list, optimizer, trainer_state: dict[str, Any], dp_cp_group) -> tuple:
    """(sharded state, content metadata) of a save into `directory`, which rank 0 has made (collective)."""
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    metadata = _metadata(dp_cp_group)
    state = _sharded_state(model, optimizer, metadata, is_loading=False)
    state[_STATE_KEY] = dict(trainer_state)
    return state, _content(metadata) | {_OPTIMIZER_STATE: optimizer is not None}


def start_save(
    directory: Path, model: list, optimizer, trainer_state: dict[str, Any], *, dp_cp_group=None
) -> SaveInFlight:
    """Begin writing what `save_checkpoint` writes into `directory`, in the background (module docstring): returns
    once every shard is staged in host memory and the writer process has started. Collective.

    Args:
        as `save_checkpoint`.

    Returns:
        The write in flight: `done()` / `wait()` finish it (collective, on every rank in the same order).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    directory = Path(directory)
    state, content = _state_to_save(directory, model, optimizer, trainer_state, dp_cp_group)
    request = dist_checkpointing.save(
        state, str(directory), content_metadata=content, async_sharded_save=True, async_strategy="mcore"
    )
    queue = AsyncCallsQueue(persistent=False)  # a fresh forked writer per save: one save is in flight at a time
    queue.schedule_async_request(request)
    return SaveInFlight(directory, queue)


class CheckpointWriteError(RuntimeError):
    """A background checkpoint write that failed on some train rank (raised on every rank by `SaveInFlight.wait`).
    megatron-core reports the write's own error (a full disk, ...) only as text, without its errno: the driver finds
    a full disk by a probe write (orchestration/checkpoint.py, `out_of_space`)."""


class SaveInFlight:
    """A `start_save` write: `done()` finishes it if every rank's write has ended, `wait()` waits for that. Both are
    collective (megatron-core all-reduces the writers' state), so every rank calls them in the same order."""

    def __init__(self, directory: Path, queue) -> None:
        self.directory = directory
        self.queue = queue
        self.finished = False
        self.error: BaseException | None = None

    def done(self) -> bool:
        """Whether the write has ended on every rank (then it is finalized here); never raises a write's error, which
        `wait` raises, so that a poll does not leave the checkpoint half handled."""
        if not self.finished:
            self._finalize(blocking=False)
        return self.finished

    def wait(self) -> None:
        """Wait for every rank's write and finalize the checkpoint.

        Raises:
            CheckpointWriteError: a rank's write failed (no `metadata.json` is written then).
        """
        if not self.finished:
            self._finalize(blocking=True)
        if self.error is not None:
            raise CheckpointWriteError(
                f"writing the megatron checkpoint {self.directory} failed: {_summary(self.error)} (the train ranks' "
                "log has the writer's own error)"
            ) from self.error

    def _finalize(self, blocking: bool) -> None:
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            self.finished = bool(self.queue.maybe_finalize_async_calls(blocking=blocking))
        except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException; raised on every rank
            self.error, self.finished = err, True


def _summary(err: BaseException) -> str:
    """The lines of megatron's/torch's `CheckpointException` that say what failed, without the tracebacks."""
    lines = [ln for ln in str(err).splitlines() if ln and not ln[0].isspace() and not ln.startswith("Traceback")]
    return re.sub(r"\s+", " ", "; ".join(lines)) or type(err).__name__


def load_checkpoint(directory: Path, model: list, optimizer, *, dp_cp_group=None) -> dict[str, Any]:
    """Load what `save_checkpoint` wrote into `model` (and `optimizer`); returns the trainer state.

    A checkpoint saved without the optimizer (`saved_optimizer_state` False) loads the model only: the optimizer's
    moments stay as they were built (zero until its first step) and its fp32 main weights, copied from the model when
    it was built, are copied again from the loaded model (`reload_model_params`), or the next step would write
    the built weights plus one update back into the model.

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
    with_optimizer = saved_optimizer_state(directory)
    metadata = _metadata(dp_cp_group)
    state = _sharded_state(model, optimizer if with_optimizer else None, metadata, is_loading=True)
    loaded = dist_checkpointing.load(state, str(directory))
    for i, chunk in enumerate(model):
        unwrap_model(chunk).load_state_dict(loaded[_MODEL_KEY.format(i)])
    if optimizer is not None and with_optimizer:
        optimizer.load_state_dict(loaded["optimizer"])
        sync_offloaded_optimizer(optimizer)
    elif optimizer is not None:
        # a ChainedOptimizer reloads each of its optimizers; an offloaded one (HybridDeviceOptimizer) copies the model
        # into its fp32 copies on both devices (`update_fp32_param_by_new_param`). No `sync_offloaded_optimizer`:
        # there is no loaded state to hand to its sub-optimizers (a fresh one has none: the sync would fail on it)
        optimizer.reload_model_params()
    return dict(loaded.get(_STATE_KEY, {}))


def saved_optimizer_state(directory: Path) -> bool:
    """Whether the checkpoint in `directory` holds the optimizer's shards: its content metadata says so
    (`save_checkpoint` with an optimizer: True, without: False); a checkpoint written before it said so holds them."""
    from megatron.core import dist_checkpointing

    content = dist_checkpointing.load_content_metadata(str(directory)) or {}
    return bool(content.get(_OPTIMIZER_STATE, True))


_HDO_SYNC = "_sync_hdo_state_to_sub_optimizers"  # private to megatron-core; checked by require_offload_support


def require_offload_support() -> None:
    """Raise unless the installed megatron-core has what `sync_offloaded_optimizer` calls: checked when an offloaded
    optimizer is built (train.optimizer.cpu_offload > 0), not first at a resume.

    Raises:
        RuntimeError: naming the installed megatron-core, the missing method and the fix.
    """
    import importlib.metadata

    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    if not callable(getattr(HybridDeviceOptimizer, _HDO_SYNC, None)):
        raise RuntimeError(
            f"train.optimizer.cpu_offload needs megatron-core's HybridDeviceOptimizer.{_HDO_SYNC} (megatron-core "
            f"0.19.2) to resume an offloaded optimizer, and megatron-core {importlib.metadata.version('megatron-core')}"
            " has none: install megatron-core 0.19.2 (scripts/setup_megatron.sh) or set train.optimizer.cpu_offload=0"
        )


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
            getattr(inner, _HDO_SYNC)()
            synced += 1
    return synced  # the common (non-sharded) part comes back with the shards


def _content(metadata: dict) -> dict:
    """The JSON-able part of the metadata (the process group stays out of the file)."""
    return {k: v for k, v in metadata.items() if k != "dp_cp_group"}
