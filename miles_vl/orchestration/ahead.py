"""Rollouts ahead of training (`rollout.max_staleness` > 0): the engines generate the batches of the next steps while
the trainer trains, never more than `max_staleness` steps ahead of the weights they sample with (docs/async.md).

    ahead = RolloutsAhead(produce, max_staleness=1, num_steps=20)   # produce(step, weight_version) -> a batch
    batch = ahead.take(step)        # the engines hold the weights after `step` steps; starts the next batches
    <train on batch>
    ahead.wait()                    # the rollout thread is idle: now the engines may take new weights
    <sync the weights after step + 1 steps>

Schedule. `take(step)` is called when the engines hold the weights after `step` RL steps (version `step`). It
returns step `step`'s batch (produced here if no batch is ready, e.g. the first step of a run) and starts the rollout
thread on the batches of steps `step + 1 .. step + max_staleness` that are not ready yet, each sampled with version
`step`. The driver calls `wait()` before every weight sync, so the engines never change weights under a batch: the
engine timeline is sync v, the batches of version v, sync v + 1, ..., and a batch of step t sampled with version v
is trained at step t with t - v <= max_staleness by construction (`take` checks it). The schedule depends on the step
numbers only, never on timing: a run is reproducible and a resumed run repeats the straight one.

Threads. Only the rollout thread produces while it runs (the data cursor, the engines, the reward pool are its); the
main thread trains. Everything that reads the data cursor (a commit) or uses the engines (a sync, eval) comes after
`wait()`. An error of the rollout thread is raised by the next `wait` or `take` in the main thread. With partial
rollouts (`rollout.partial_rollouts`) the driver pauses the engines before a sync instead of calling `wait()` (the
thread's requests are aborted, kept and continued after the sync: rollout/sglang/engine.py), and calls `wait()` after
the sync, before eval and the commit.

What a checkpoint holds. The batches ready at a commit (`pending()`) are written into the checkpoint
(`write_batches`, `rollouts_ahead.pt`, with the data cursor past them) and restored on resume (`restore`): the
resumed run trains on the batches the straight run would have trained on, sampled with the same weights, and no
prompt of an epoch is trained twice or skipped. Regenerating them on resume instead would sample them with the
checkpoint's (newer) weights: the run would differ from the straight one, and the rollouts/step_N.jsonl files
written ahead would be replaced with other samples.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

AHEAD_FILE = "rollouts_ahead.pt"
_POLL_S = 0.5  # a wait for the rollout thread looks at signals this often


class RolloutsAhead[Batch]:
    """The batches of the next steps, produced on a rollout thread (module docstring).

    Args:
        produce: `produce(step, weight_version)` -> step `step`'s batch, sampled with the weights after
            `weight_version` RL steps (what the engines hold while it runs).
        max_staleness: how many steps a batch may be trained after the weights it was sampled with (> 0).
        num_steps: the run's last step + 1 (no batch is produced past it).
    """

    def __init__(self, produce: Callable[[int, int], Batch], *, max_staleness: int, num_steps: int):
        if max_staleness < 1:
            raise ValueError(f"max_staleness must be >= 1 for rollouts ahead, found {max_staleness}")
        self.produce = produce
        self.max_staleness = max_staleness
        self.num_steps = num_steps
        self.ready: dict[int, tuple[int, Batch]] = {}  # step -> (weight version it was sampled with, batch)
        self.closed = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def take(self, step: int) -> tuple[int, Batch]:
        """(weight version, batch) of step `step`; the engines must hold the weights after `step` steps. Starts the
        rollout thread on the next steps' batches (at most `max_staleness` ahead).

        Raises:
            whatever the rollout thread raised while producing an earlier batch.
        """
        self.wait()
        if step not in self.ready:
            self.ready[step] = (step, self.produce(step, step))
        version, batch = self.ready.pop(step)
        assert step - version <= self.max_staleness, f"step {step} got a batch of weights {version}"
        last = min(step + self.max_staleness, self.num_steps - 1)
        todo = [t for t in range(step + 1, last + 1) if t not in self.ready]
        if todo:
            self._thread = threading.Thread(
                target=self._run, args=(todo, step), name=f"rollouts-ahead-{todo[0]}", daemon=True
            )
            self._thread.start()
        return version, batch

    def wait(self) -> None:
        """Return when the rollout thread is idle (at once if it is); raise its error if it failed."""
        thread = self._thread
        while thread is not None and thread.is_alive():
            thread.join(_POLL_S)  # in slices: SIGINT/SIGTERM handlers run in between
        self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def pending(self) -> list[tuple[int, int, Batch]]:
        """(step, weight version, batch) of every batch ready, by step; call after `wait()`."""
        return [(t, v, b) for t, (v, b) in sorted(self.ready.items())]

    def restore(self, batches: Sequence[tuple[int, int, Batch]]) -> None:
        """The batches a checkpoint held (`pending()` at its commit) are ready again."""
        self.ready = {t: (v, b) for t, v, b in batches}

    def close(self, timeout_s: float = 60.0) -> None:
        """No more batches; wait up to `timeout_s` for one in production (the engines are closed first, so its
        calls fail fast). Its error, if any, is only logged: the job is ending for another reason."""
        self.closed = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("the rollout thread did not end within %.0f s of closing the engines", timeout_s)
        if self._error is not None:
            log.info("the rollout thread ended with: %s", self._error)

    def _run(self, steps: list[int], version: int) -> None:
        try:
            for t in steps:
                if self.closed:
                    return
                self.ready[t] = (version, self.produce(t, version))
        except BaseException as err:  # raised in the main thread by the next wait() or take()
            self._error = err


def write_batches(directory: Path, batches: list[dict[str, Any]]) -> None:
    """The batches ahead of a checkpoint (plain dicts of tensors and numbers) as `<directory>/rollouts_ahead.pt`."""
    torch.save(batches, Path(directory) / AHEAD_FILE)


def read_batches(directory: Path) -> list[dict[str, Any]]:
    """What `write_batches` wrote (loaded with `weights_only=True`: a crafted file is refused, never run)."""
    return torch.load(Path(directory) / AHEAD_FILE, weights_only=True)
