"""Checkpoint directories: written atomically (temp dir + rename), the last K kept, the newest found on resume.

    <checkpoint dir>/step_00000004/
        model.safetensors  optimizer.pt  trainer_rng.pt     (the train backend's save_checkpoint)
        driver.json                                         (step, data cursor, RNG seeds, config)

A directory named `step_*` is complete by construction: it only appears through the final rename.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d{8})$")
DRIVER_STATE = "driver.json"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under root as (step, path), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found)


def save_checkpoint(
    root: str | Path,
    step: int,
    driver_state: dict[str, Any],
    write_backend: Callable[[Path], None],
    keep_last: int,
) -> Path:
    """Write `step`'s checkpoint atomically and prune to the newest `keep_last`.

    Args:
        root: the checkpoint directory.
        step: number of completed RL steps.
        driver_state: JSON-serialisable driver state (data cursor, seeds, config).
        write_backend: writes the trainer's files into the given (temporary) directory.
        keep_last: how many checkpoints to keep.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    write_backend(tmp)
    (tmp / DRIVER_STATE).write_text(json.dumps({"step": step, **driver_state}, indent=1))
    if final.exists():  # re-saving the same step (e.g. Ctrl-C right after a periodic save)
        shutil.rmtree(final)
    os.replace(tmp, final)
    for _, old in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    log.info("checkpoint saved: %s", final)
    return final


def resolve_resume(root: str | Path, resume: str) -> Path | None:
    """The checkpoint to resume from: `auto` -> newest under root (or None), `never` -> None, else that path.

    Raises:
        FileNotFoundError: an explicit path that is not a complete checkpoint.
    """
    if resume == "never":
        return None
    if resume == "auto":
        found = list_checkpoints(root)
        return found[-1][1] if found else None
    path = Path(resume)
    if not (path / DRIVER_STATE).is_file():
        raise FileNotFoundError(
            f"checkpoint.resume={resume!r} is not a checkpoint directory (no {DRIVER_STATE}); use 'auto', 'never' "
            f"or one of {[str(p) for _, p in list_checkpoints(root)][-3:]}"
        )
    return path


def read_driver_state(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / DRIVER_STATE).read_text())
