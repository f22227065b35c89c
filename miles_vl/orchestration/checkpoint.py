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
  directories of earlier processes that died mid-save are removed by the next save (`remove_stale_temp_dirs`, which
  export.py uses for its own). A save that runs out of space raises `DiskFullError`, naming the place and the fix,
  whichever writer met the full disk: Python's (OSError), safetensors' or torch's (`out_of_space`).
- A save may be written in the background (`start_checkpoint`: the trainer snapshots its state, writes it while the
  next steps run: torch in a thread, megatron with megatron-core's async save on every rank; `PendingSave.finish`
  waits for every rank's write and publishes): until the rename the checkpoint is only a temporary directory, which
  no resume sees; a writer's error reaches `finish` and is handled as above.
- `resolve_resume` verifies the checkpoint it picks (driver.json, the manifest's file sizes, the safetensors
  headers, the torch zip archives) before anything starts. With `auto`, a broken newest checkpoint is set aside
  (renamed `<name>.broken-<time>`, kept for inspection) with a warning that names the bad file, and the previous
  one is used; an explicit path that is broken is an error naming the file and the checkpoints that verify.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import struct
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d{8})$")
_TEMP_DIR = re.compile(r"^\.step_\d{8}\.tmp-(?P<pid>\d+)$")
DRIVER_STATE = "driver.json"
MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from (names the file, what is wrong and what to do instead)."""


class DiskFullError(OSError):
    """A write that ran out of space (ENOSPC) or quota (EDQUOT); `errno` is which, the message names the place, that
    the partial output was removed, and what to free or change."""


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
        DiskFullError: the device ran out of space or quota (the message says where and what to free); the partial
            directory is removed.
        Exception: whatever else the writer raised; the partial directory is removed.
    """

    def start(tmp: Path) -> Callable[[], None]:
        write_backend(tmp)
        return lambda: None

    return start_checkpoint(root, step, driver_state, start, keep_last).finish()


def start_checkpoint(
    root: str | Path,
    step: int,
    driver_state: dict[str, Any],
    start_backend: Callable[[Path], Callable[[], None]],
    keep_last: int,
) -> PendingSave:
    """Begin `step`'s checkpoint: `start_backend(tmp)` starts the trainer's write into the temporary directory and
    returns what waits for that write to end (raising its error); `PendingSave.finish` waits, then publishes the
    checkpoint as `save_checkpoint` does. Until then it is a temporary directory only, which no resume sees.

    Raises:
        FileExistsError, DiskFullError, Exception: as `save_checkpoint`, for what happens before the write is under
            way (the partial directory is removed).
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
    pending = PendingSave(root, step, root / f".{final.name}.tmp-{os.getpid()}", dict(driver_state), keep_last)
    try:
        if pending.tmp.exists():
            shutil.rmtree(pending.tmp)
        pending.tmp.mkdir()
        pending.wait = start_backend(pending.tmp)
    except BaseException as err:
        pending.abandon(err)
    return pending


@dataclass
class PendingSave:
    """A checkpoint whose trainer files are being written into `tmp` (`start_checkpoint`); `finish` publishes it."""

    root: Path
    step: int
    tmp: Path
    driver_state: dict[str, Any]
    keep_last: int
    wait: Callable[[], None] = lambda: None  # returns when the trainer's write has ended; raises its error
    started: float = field(default_factory=time.monotonic)  # when the write began (the log's seconds)

    def finish(self) -> Path:
        """Wait for the trainer's write, add driver.json and the manifest, rename into place (the checkpoint appears
        complete or not at all) and prune to the newest `keep_last`.

        Raises:
            DiskFullError, Exception: as `save_checkpoint`; the partial directory is removed.
        """
        final = self.root / step_dir_name(self.step)
        try:
            self.wait()
            (self.tmp / DRIVER_STATE).write_text(json.dumps({"step": self.step, **self.driver_state}, indent=1))
            size = write_manifest(self.tmp)
            os.replace(self.tmp, final)
        except BaseException as err:
            self.abandon(err)
        for _, old in list_checkpoints(self.root)[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        log.info(
            "checkpoint saved: %s (%.4g GB, %.1f s after its write began)",
            final,
            size / 1e9,
            time.monotonic() - self.started,
        )
        return final

    def abandon(self, err: BaseException) -> NoReturn:
        """Remove the partial directory and raise `err`, as a `DiskFullError` when it is a full disk."""
        full = out_of_space(err, self.tmp)  # before the partial files go: a probe must meet the disk as the writer did
        shutil.rmtree(self.tmp, ignore_errors=True)
        if full:
            raise DiskFullError(
                full,
                f"{space_words(full)} on the device of {self.root} while writing checkpoint step {self.step}; the "
                "partial checkpoint was removed; free space there or point checkpoint.dir elsewhere "
                "(checkpoint.keep_last keeps fewer)",
            ) from err
        raise err


def remove_stale_temp_dirs(
    root: str | Path, pattern: re.Pattern[str] = _TEMP_DIR, owned: Callable[[Path], bool] | None = None
) -> list[Path]:
    """Remove the temporary directories of writes whose process is gone (a crash, a SIGKILL or a full disk mid-write).
    A directory of a process that is alive is kept: it may be writing right now.

    Args:
        root: the directory that holds them.
        pattern: their names, with the writer's process id as group `pid` (default: a checkpoint save's
            `.step_N.tmp-<pid>`).
        owned: a further test a directory must pass (export.py: its own name or its marker file inside).

    Returns:
        The directories removed.
    """
    removed = []
    for path in Path(root).iterdir() if Path(root).is_dir() else []:
        m = pattern.match(path.name)
        if not m or path.is_symlink() or not path.is_dir() or (owned is not None and not owned(path)):
            continue
        if not _alive(int(m.group("pid"))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            log.warning("removed %s, left by an interrupted write of process %s", path, m.group("pid"))
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


# Torch's zip writer (caffe2's PyTorchStreamWriter) reports a failed write as a RuntimeError that carries no errno, in
# one of three forms depending on where the write stopped (torch 2.11: its stream check, the position check after a
# short write, the iostream exception); safetensors' (Rust) writer as "... (os error 28)".
_TORCH_WRITE_FAILED = re.compile(
    r"PytorchStreamWriter failed writing file .*: file write failed"
    r"|\[enforce fail at inline_container\.cc:\d+\] \. unexpected pos \d+ vs \d+"
    r"|^basic_ios::clear: iostream error$"
)
# megatron's background write (train/megatron/checkpoint.py) fails on some rank as megatron-core's CheckpointException,
# which keeps the writer's error only as text: it carries no errno either.
_MEGATRON_WRITE_FAILED = "CheckpointWriteError"
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
_OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)
_PROBE_BYTES = 1 << 20


def out_of_space(err: BaseException, directory: str | Path) -> int | None:
    """`errno.ENOSPC` or `errno.EDQUOT` when `err` is a write into `directory` that ran out of space or quota, else
    None.

    Looked for along the chain of `err` (`__cause__`, `__context__`, and the `cause` of a Ray task error, as the
    trainer actor's errors reach the driver): an OSError with that errno; a safetensors error, whose message holds
    the OS error number; torch's writer failing (`_TORCH_WRITE_FAILED`) or the megatron backend's background write
    (`CheckpointWriteError`), which tell no errno: then a probe file written into `directory` (while the partial files
    still fill the device) gives the device's own answer, so a write that failed for another reason (a file size
    limit, an I/O error) is not called a full disk.
    """
    torch_failed = False
    for e in _chain(err):
        if isinstance(e, OSError) and e.errno in _OUT_OF_SPACE:
            return e.errno
        message = str(e.args[0]) if e.args else ""
        if type(e).__name__ == "SafetensorError" and (m := _RUST_OS_ERROR.search(message)):
            if int(m.group(1)) in _OUT_OF_SPACE:
                return int(m.group(1))
        torch_failed |= isinstance(e, RuntimeError) and bool(_TORCH_WRITE_FAILED.search(message))
        torch_failed |= type(e).__name__ == _MEGATRON_WRITE_FAILED
    if torch_failed:
        probed = _write_probe(Path(directory))
        return probed if probed in _OUT_OF_SPACE else None
    return None


def space_words(code: int) -> str:
    """How a message names `out_of_space`'s answer."""
    return "no space left" if code == errno.ENOSPC else "disk quota exceeded"


def _chain(err: BaseException) -> list[BaseException]:
    seen, todo = [], [err]
    while todo:
        e = todo.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        cause = getattr(e, "cause", None)  # ray.exceptions.RayTaskError: the actor's own exception
        todo += [c for c in (e.__cause__, e.__context__, cause) if isinstance(c, BaseException)]
    return seen


def _write_probe(directory: Path) -> int | None:
    """The errno of writing (and syncing) `_PROBE_BYTES` into a new file in `directory`, None when it fits; the file
    is removed either way."""
    probe = directory / f".space-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            data = memoryview(bytes(_PROBE_BYTES))
            while data:  # a short write is how a filling disk answers first; the next write raises
                data = data[os.write(fd, data) :]
            os.fsync(fd)  # network and delayed-allocation file systems tell at the sync
        finally:
            os.close(fd)
    except OSError as e:
        return e.errno
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return None


def write_problem(path: str | Path) -> str | None:
    """Why a directory cannot be created or written at `path`, None when it can: probed by creating and removing a
    directory in `path`, or in its nearest existing ancestor when it does not exist yet (nothing is left behind)."""
    path = Path(os.path.abspath(path))
    place = path
    while not place.exists() and place != place.parent:
        place = place.parent
    if not place.is_dir():
        return f"{place} is not a directory"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".miles_vl-write-probe-", dir=place))
    except OSError as e:
        return f"a directory cannot be created in {place} ({e.strerror})"
    return None


def write_manifest(directory: Path) -> int:
    """`manifest.json`: every file under `directory` (relative path -> size in bytes). Returns the bytes of every file
    there, the manifest's own included."""
    files = {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    text = json.dumps({"files": files}, indent=1)
    (directory / MANIFEST).write_text(text)
    return sum(files.values()) + len(text.encode())


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


def find_resume_point(root: str | Path, resume: str, set_aside: bool = True) -> ResumePoint:
    """`resolve_resume` with what `auto` skipped. Module docstring for the rules. `set_aside=False`: the broken
    checkpoints `auto` skips stay where they are (a dry run: `miles-vl check`).

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
                for bad, why in skipped if set_aside else ():
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
        raise CheckpointError(not_a_checkpoint(resume, root))
    problems = verify_checkpoint(path)
    if problems:
        good = [str(p) for _, p in list_checkpoints(path.parent) if p != path and not verify_checkpoint(p)]
        offer = f"resume from {good[-1]} instead (checkpoint.resume={good[-1]})" if good else "start a fresh run"
        raise CheckpointError(f"checkpoint {path} is broken: {'; '.join(problems)}; {offer}")
    return ResumePoint(path)


def not_a_checkpoint(resume: str, root: str | Path) -> str:
    """The error for a `checkpoint.resume` path with no driver state: the newest checkpoints to pick, from the first
    place that holds any of the path itself (a run's checkpoints folder), its parent (a mistyped name) and `root`."""
    places = [Path(resume), Path(resume).parent, Path(root)]
    near = next(([str(p) for _, p in found][-3:] for place in places if (found := list_checkpoints(place))), [])
    offer = f"one of {near}" if near else f"a checkpoint directory (none in {Path(resume).parent} or {root})"
    return (
        f"checkpoint.resume={resume!r} is not a checkpoint directory (no {DRIVER_STATE}); use 'auto', 'never' or "
        f"{offer}"
    )


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


# The train.* sizes a megatron checkpoint is tied to: its optimizer state is saved in megatron's "dp_reshardable"
# format (train/megatron/checkpoint.py), resharded over another data-parallel size (train.num_gpus) on load, but laid
# out per TP/PP/CP/EP rank.
MODEL_PARALLEL_KEYS = ("tp", "pp", "cp", "ep")


def parallel_layout_problem(state: dict[str, Any], train_backend: str, sizes: dict[str, int]) -> str | None:
    """Why a megatron checkpoint cannot be resumed at the model-parallel `sizes` (train.tp/pp/cp/ep of this job), or
    None (another train.num_gpus is fine; a checkpoint whose driver.json records no config is not judged here).

    Args:
        state: the checkpoint's driver state (`read_driver_state`), whose `config` is the run's config.
        train_backend: this job's train.backend.
        sizes: this job's {"tp": .., "pp": .., "cp": .., "ep": ..}.
    """
    saved = (state.get("config") or {}).get("train") or {}
    if train_backend != "megatron" or saved.get("backend") != "megatron":
        return None
    changed = {k: (saved[k], sizes[k]) for k in MODEL_PARALLEL_KEYS if k in saved and saved[k] != sizes[k]}
    if not changed:
        return None
    was = " ".join(f"train.{k}={a}" for k, (a, _) in changed.items())
    now = " ".join(f"train.{k}={b}" for k, (_, b) in changed.items())
    step = state["step"]
    return (
        f"the checkpoint of step {step} was saved at {was}, this job has {now}: a megatron checkpoint resumes on "
        "another number of GPUs (train.num_gpus: another data-parallel size) but only at the tensor/pipeline/context/"
        f"expert-parallel sizes it was saved with (its optimizer state is laid out per rank of those). Resume with "
        f"{was}, or export the step (miles-vl export RUN_DIR OUT_DIR --step {step}) and start a new run from it "
        "(model.path=OUT_DIR; the optimizer state starts afresh)"
    )
