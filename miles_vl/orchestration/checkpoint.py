"""Checkpoint directories: written atomically (temp dir + rename), never rewritten, verified before a resume.

    <checkpoint dir>/step_00000004/
        model.safetensors  trainer_state.pt  ...            (the train backend's save_checkpoint)
        driver.json                                         (step, data cursor, counters, config with secrets redacted)
        manifest.json                                       (every file above with its size; written last)

Invariants:
- A directory named `step_*` is complete by construction: it only appears through the final rename.
- A label is written once: saving a step whose directory exists raises `FileExistsError` before anything is
  written, so no label ever holds two different states (a resume that reaches the same step again must not save).
- A failed save (a full disk, an exception in the backend's writer) removes its temporary directory; temporary
  directories of earlier processes that died mid-save are removed by the next save.
- `resolve_resume` verifies the checkpoint it picks (driver.json, the manifest's file sizes, the safetensors
  headers, the torch zip archives) before anything starts. With `auto`, a broken newest checkpoint is set aside
  (renamed `<name>.broken-<time>`, kept for inspection) with a warning that names the bad file, and the previous
  one is used; an explicit path that is broken is an error naming the file and the checkpoints that verify.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d{8})$")
_TEMP_DIR = re.compile(r"^\.step_\d{8}\.tmp-(\d+)$")
DRIVER_STATE = "driver.json"
MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from (names the file, what is wrong and what to do instead)."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under root as (step, path), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found)


# ---------------------------------------------------------------------------------------------------------------------
# saving


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
        driver_state: JSON-serialisable driver state (data cursor, counters, config).
        write_backend: writes the trainer's files into the given (temporary) directory.
        keep_last: how many checkpoints to keep.

    Raises:
        FileExistsError: `step` already has a checkpoint (a label is never rewritten); nothing is written.
        OSError: writing failed (a full disk says where and what to free); the partial directory is removed.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    if final.exists():
        raise FileExistsError(
            f"checkpoint {final} already exists and a checkpoint label is never rewritten; the caller saves each "
            "completed step once (resume from it, or remove it by hand if it is not wanted)"
        )
    remove_stale_temp_dirs(root)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        write_backend(tmp)
        (tmp / DRIVER_STATE).write_text(json.dumps({"step": step, **driver_state}, indent=1))
        write_manifest(tmp)
        os.replace(tmp, final)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            raise OSError(
                errno.ENOSPC,
                f"no space left on the device of {root} while writing checkpoint step {step}; the partial checkpoint "
                f"was removed; free space there or point checkpoint.dir elsewhere (checkpoint.keep_last keeps fewer)",
            ) from err
        raise
    for _, old in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    log.info("checkpoint saved: %s", final)
    return final


def remove_stale_temp_dirs(root: str | Path) -> list[Path]:
    """Remove the temporary directories of saves whose process is gone (a crash or a full disk mid-save).

    Returns:
        The directories removed.
    """
    removed = []
    for path in Path(root).iterdir() if Path(root).is_dir() else []:
        m = _TEMP_DIR.match(path.name)
        if m and path.is_dir() and not _alive(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            log.warning("removed %s, left by an interrupted save of process %s", path, m.group(1))
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own leftover: this process is not saving it any more
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def write_manifest(directory: Path) -> None:
    """`manifest.json`: every file under `directory` (relative path -> size in bytes)."""
    files = {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    (directory / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


# ---------------------------------------------------------------------------------------------------------------------
# resuming


@dataclass
class ResumePoint:
    """The checkpoint a run resumes from, and the broken newer ones `auto` skipped (set aside, with why)."""

    path: Path | None
    skipped: list[tuple[Path, list[str]]] = field(default_factory=list)

    @property
    def step(self) -> int:
        return read_driver_state(self.path)["step"] if self.path else 0


def resolve_resume(root: str | Path, resume: str) -> Path | None:
    """The checkpoint to resume from: `auto` -> the newest that verifies (or None), `never` -> None, else that path.

    With `auto`, broken newer checkpoints are set aside with a warning (see `find_resume_point`).

    Raises:
        CheckpointError: an explicit path that is not a complete checkpoint, or `auto` with only broken ones.
    """
    return find_resume_point(root, resume).path


def find_resume_point(root: str | Path, resume: str) -> ResumePoint:
    """`resolve_resume` with what `auto` skipped. Module docstring for the rules.

    Raises:
        CheckpointError: an explicit path that does not verify (names the file and the checkpoints that do), or
            `auto` when every checkpoint under root is broken.
    """
    if resume == "never":
        return ResumePoint(None)
    if resume == "auto":
        skipped = []
        for _, path in reversed(list_checkpoints(root)):
            problems = verify_checkpoint(path)
            if not problems:
                for bad, why in skipped:
                    _set_aside(bad, why, path)
                return ResumePoint(path, skipped)
            skipped.append((path, problems))
        if skipped:
            raise CheckpointError(
                f"no checkpoint under {root} can be resumed from: "
                + "; ".join(f"{p.name}: {', '.join(why)}" for p, why in skipped)
                + "; start a fresh run (checkpoint.resume=never with another logging.run_name)"
            )
        return ResumePoint(None)
    path = Path(resume)
    if not (path / DRIVER_STATE).is_file():
        raise CheckpointError(
            f"checkpoint.resume={resume!r} is not a checkpoint directory (no {DRIVER_STATE}); use 'auto', 'never' "
            f"or one of {[str(p) for _, p in list_checkpoints(root)][-3:]}"
        )
    problems = verify_checkpoint(path)
    if problems:
        good = [str(p) for _, p in list_checkpoints(path.parent) if p != path and not verify_checkpoint(p)]
        offer = f"resume from {good[-1]} instead (checkpoint.resume={good[-1]})" if good else "start a fresh run"
        raise CheckpointError(f"checkpoint {path} is broken: {'; '.join(problems)}; {offer}")
    return ResumePoint(path)


def _set_aside(path: Path, problems: list[str], used: Path) -> None:
    aside = path.with_name(f"{path.name}.broken-{datetime.now():%Y%m%d-%H%M%S}")
    os.replace(path, aside)
    log.warning(
        "checkpoint %s is broken (%s): resuming from %s instead; the broken one is kept as %s",
        path,
        "; ".join(problems),
        used.name,
        aside,
    )


def verify_checkpoint(path: str | Path) -> list[str]:
    """What is wrong with a checkpoint directory, one line per problem naming the file; empty when it is whole.

    Checks: driver.json parses and its step matches the directory name; every file of manifest.json exists with
    its recorded size (checkpoints written before manifests existed skip this); every `*.safetensors` has a header
    that parses and data that fills the file; every `*.pt` is a complete zip archive (torch.save's format).
    """
    path = Path(path)
    problems = []
    try:
        state = read_driver_state(path)
        m = _STEP_DIR.match(path.name)
        if m and state.get("step") != int(m.group(1)):
            problems.append(f"{path / DRIVER_STATE}: step {state.get('step')} does not match the directory name")
    except CheckpointError as err:
        problems.append(str(err))
    manifest = path / MANIFEST
    if manifest.is_file():
        try:
            files = json.loads(manifest.read_text())["files"]
        except (ValueError, KeyError, TypeError) as err:
            problems.append(f"{manifest}: unreadable ({err})")
            files = {}
        for name, size in files.items():
            f = path / name
            if not f.is_file():
                problems.append(f"{f}: missing")
            elif f.stat().st_size != size:
                problems.append(f"{f}: {f.stat().st_size} bytes, the manifest says {size} (truncated?)")
    for f in sorted(path.rglob("*.safetensors")):
        if (why := _safetensors_problem(f)) is not None:
            problems.append(f"{f}: {why}")
    for f in sorted(path.rglob("*.pt")):
        if f.is_file() and not _is_complete_zip(f):
            problems.append(f"{f}: not a complete torch archive (truncated or corrupt)")
    return problems


def _safetensors_problem(path: Path) -> str | None:
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                return f"header length {n} exceeds the file ({size} bytes)"
            header = json.loads(f.read(n))
    except (struct.error, ValueError) as err:
        return f"unreadable safetensors header ({err})"
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    if 8 + n + max(ends, default=0) != size:
        return f"{size} bytes, its header describes {8 + n + max(ends, default=0)} (truncated?)"
    return None


def _is_complete_zip(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as z:
            return all(info.header_offset + info.compress_size <= path.stat().st_size for info in z.infolist())
    except (zipfile.BadZipFile, OSError):
        return False


def read_driver_state(path: str | Path) -> dict[str, Any]:
    """The driver state of a checkpoint directory.

    Raises:
        CheckpointError: driver.json is missing or is not a JSON object with an integer `step` (names the file).
    """
    file = Path(path) / DRIVER_STATE
    try:
        state = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{file}: not valid JSON ({err})") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise CheckpointError(f"{file}: expected a JSON object with an integer 'step'")
    return state
