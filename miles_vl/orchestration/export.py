"""Hugging Face model directories from a run: `miles-vl export` after training, `checkpoint.save_hf` during it.

    miles-vl export runs/geo3k_tiny_cpu hf_out            # the newest checkpoint that verifies
    miles-vl export runs/geo3k_tiny_cpu --step 4 hf_out   # that step's checkpoint

    python -c "from transformers import AutoModelForImageTextToText as M; M.from_pretrained('hf_out')"
    python -m sglang.launch_server --model-path hf_out

The directory holds config.json, the weights as safetensors (sharded with model.safetensors.index.json above
`checkpoint.save_hf.max_shard_bytes`, 5 GB by default; train/hf_files.py), the processor files with the chat template
(the processor the run loaded: `model.processor` or `model.path`, with the run's min/max pixels) and, when model.path
has one, generation_config.json. The weights come from the train backend itself (`TrainBackend.save_hf`): `export_run`
reads the run's config.yaml, starts its trainer as the run did (Ray, the same backend and parallel layout: a megatron
run needs its train GPUs), loads the checkpoint and has the ranks export it (megatron through megatron-bridge's HF
export, the path the weight sync uses). Nothing is started for the engines.

Invariants:
- An output directory appears complete or not at all (written to `.<name>.tmp-<pid>` beside it and renamed). The
  temporary directories of writes whose process died (a SIGKILL mid-export) are removed by the next write into the
  same place (`checkpoint.remove_stale_temp_dirs`): those of the same name, or holding the marker below.
- Every directory written here holds `.miles_vl_export.json` (the run, the step, the time): the marker of an export.
- Nothing of a run is ever replaced (`out_dir_problem`): OUT_DIR may not be the run directory, hold it or lie inside
  it, nor lie inside any run (`run_data`: metrics.jsonl, config.yaml with processor.yaml, or checkpoints), nor be
  the current directory. A non-empty OUT_DIR is replaced only with `force`, and only when it is an earlier export
  (the marker) with no run's files anywhere below it; the run's own `<run dir>/hf/step_N` lie inside a run and are
  never replaced. A label under <run dir>/hf is written once (a resumed run that reaches the same step again keeps
  the first, as checkpoints do). Checkpoints are not touched.
- Every refusal, a `--max-shard-bytes` that is not a whole number above 0 and an OUT_DIR that cannot be written are
  one `ExportError` before Ray starts; a full disk mid-write is a `DiskFullError` naming the place, with the
  partial directory removed.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
import socket
import stat
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

import miles_vl
from miles_vl.config import JobConfig, load_run_config
from miles_vl.data import load_processor, processor_metadata, video_settings
from miles_vl.metrics import METRICS_FILE
from miles_vl.models.hub import cached_model_dir
from miles_vl.models.qwen3_vl.tokens import special_tokens
from miles_vl.orchestration.checkpoint import (
    DRIVER_STATE,
    DiskFullError,
    list_checkpoints,
    out_of_space,
    read_driver_state,
    remove_stale_temp_dirs,
    space_words,
    step_dir_name,
    verify_checkpoint,
    write_problem,
)
from miles_vl.orchestration.factories import Hooks
from miles_vl.orchestration.placement import ray_session, reserve_gpus

log = logging.getLogger(__name__)

HF_DIR = "hf"  # <run dir>/hf/step_N: checkpoint.save_hf's directories
GENERATION_CONFIG = "generation_config.json"
EXPORT_MARKER = ".miles_vl_export.json"  # in every directory written here: what `force` may replace
RUN_FILES = ("config.yaml", "processor.yaml")  # loop.write_run_files, at the start of every run
_TEMP_DIR = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)$")  # `.<name>.tmp-<pid>`, as write_hf_dir names them


class ExportError(ValueError):
    """A run, step or output directory that cannot be exported (names what exists and what to do)."""


# ---------------------------------------------------------------------------------------------------------------------
# one directory


def write_hf_dir(
    out_dir: str | Path,
    write_weights: Callable[[Path], None],
    processor,
    model_path: str | None,
    *,
    force: bool,
    origin: dict[str, Any] | None = None,
) -> Path:
    """Write an HF model directory at `out_dir` atomically (a temporary directory beside it, renamed), with the
    export marker. Temporary directories that dead processes left beside it are removed first.

    Args:
        out_dir: the directory to create.
        write_weights: writes config.json and the safetensors into the given directory (a backend's `save_hf`).
        processor: the run's processor (`save_pretrained`: tokenizer, chat template, image and video processors).
        model_path: the checkpoint the run started from (its generation_config.json is copied when there is one).
        force: replace `out_dir` if it is a non-empty earlier export (`replace_problem`).
        origin: what the marker records besides the time (the run directory, the step, the checkpoint).

    Raises:
        ExportError: `out_dir` is a non-empty directory (or a file) and not `force`, or not one `force` may replace.
        DiskFullError: the device ran out of space or quota; the partial directory is removed.
    """
    out_dir = write_path(out_dir)
    if out_dir.is_symlink() or (out_dir.exists() and not _empty_dir(out_dir)):
        _check_replace(out_dir, force)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_dirs(out_dir.parent, _TEMP_DIR, owned=lambda p: _is_export_temp(p, out_dir.name))
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        marker = {"written_by": f"miles-vl {miles_vl.__version__}", "host": socket.gethostname(), **(origin or {})}
        marker["time"] = datetime.now().astimezone().isoformat(timespec="seconds")
        (tmp / EXPORT_MARKER).write_text(json.dumps(marker, indent=1))  # first: a leftover of this write is known
        write_weights(tmp)
        processor.save_pretrained(tmp)
        source = cached_model_dir(model_path) if model_path else None  # a hub id: its snapshot in the local cache
        if source and (source / GENERATION_CONFIG).is_file():
            shutil.copyfile(source / GENERATION_CONFIG, tmp / GENERATION_CONFIG)
        _readable_like(tmp / EXPORT_MARKER, tmp)
        _move_into_place(tmp, out_dir, force)
    except BaseException as err:
        full = out_of_space(err, tmp)  # before the partial files go: a probe must meet the disk as the writer did
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise DiskFullError(
                full,
                f"{space_words(full)} on the device of {out_dir.parent} while writing {out_dir}; the partial "
                "directory was removed; free space there or write the model elsewhere",
            ) from err
        raise
    log.info("wrote the Hugging Face model %s", out_dir)
    return out_dir


def _readable_like(reference: Path, directory: Path) -> None:
    """Give every file under `directory` the mode of `reference`, a file written the ordinary way (0666 less the
    umask: 0644 under the usual 022, 0600 under 077). safetensors writes its files 0600, so that a model exported for
    others to load could not be read by them; the files are weights, config and tokenizer, no secret (a run's
    config.yaml, where a secret would be redacted anyway, is not copied here)."""
    mode = stat.S_IMODE(reference.stat().st_mode)
    for path in directory.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)


def _move_into_place(tmp: Path, out_dir: Path, force: bool) -> None:
    """Rename `tmp` to `out_dir`; an earlier export there is checked again (the write took a while), set aside as a
    temporary directory of this process, and removed once the new one is in place (put back if that fails)."""
    if not (out_dir.exists() or out_dir.is_symlink()) or _empty_dir(out_dir):
        os.replace(tmp, out_dir)  # rename(2) replaces an empty directory
        return
    _check_replace(out_dir, force)
    old = out_dir.with_name(f".{out_dir.name}.old.tmp-{os.getpid()}")  # holds the marker: a stale one is removable
    os.replace(out_dir, old)
    try:
        os.replace(tmp, out_dir)
    except BaseException:
        os.replace(old, out_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)
    log.info("replaced the earlier export %s", out_dir)


def _check_replace(out_dir: Path, force: bool) -> None:
    """Raise unless the existing, non-empty `out_dir` may be replaced (with `force`, `replace_problem`)."""
    if not force:
        if (out_dir / EXPORT_MARKER).is_file() and not out_dir.is_symlink():
            how = "choose another directory, or --force to replace this earlier export"
        else:
            how = (
                f"it is not an earlier export (no {EXPORT_MARKER}), so --force does not replace it either: choose "
                "another directory, or move or delete it yourself if it is not needed"
            )
        raise ExportError(f"{out_dir} exists and is not empty; {how}")
    if problem := replace_problem(out_dir):
        raise ExportError(problem)


def _empty_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and not any(path.iterdir())


def _is_export_temp(path: Path, name: str) -> bool:
    """A `.<name>.tmp-<pid>` directory write_hf_dir made on this host: its marker names this host, or it has none yet
    and is of the name written now. Process ids are only checked on this host, so another host's export into a shared
    folder (its marker names its host) is never taken for a dead one."""
    m = _TEMP_DIR.match(path.name)
    if not m:
        return False
    try:
        return json.loads((path / EXPORT_MARKER).read_text()).get("host") == socket.gethostname()
    except FileNotFoundError:
        return m.group("name") == name
    except (OSError, ValueError, AttributeError):
        return False  # unreadable or not ours: left alone


# ---------------------------------------------------------------------------------------------------------------------
# what an export may write, and replace


def run_data(path: Path) -> str | None:
    """Why `path` belongs to a run, or None. A run directory is known by what the driver writes into it: metrics.jsonl
    (JsonlSink), config.yaml with processor.yaml (`loop.write_run_files`) or checkpoints (`step_N` with driver.json:
    `save_checkpoint`), in `checkpoints/` or in a `checkpoint.dir` of its own; a checkpoint by its driver.json. A
    directory that cannot be read is not known to be a run's."""
    try:
        if (path / METRICS_FILE).is_file():
            return f"it holds {METRICS_FILE}"
        if all((path / name).is_file() for name in RUN_FILES):
            return f"it holds {' and '.join(RUN_FILES)}"
        if (path / DRIVER_STATE).is_file():
            return f"it is a checkpoint (it holds {DRIVER_STATE})"
        for root in (path, path / "checkpoints"):
            steps = [p for _, p in list_checkpoints(root) if (p / DRIVER_STATE).is_file()]
            if steps:
                return f"it holds the checkpoint {steps[-1].relative_to(path)}"
    except OSError:
        return None
    return None


def replace_problem(out_dir: str | Path) -> str | None:
    """Why `force` may not replace the existing `out_dir`, or None: it may replace only a directory an earlier export
    wrote (EXPORT_MARKER), not a link, holding no run's files anywhere below it and lying inside no run."""
    out_dir = Path(out_dir)
    never = "--force never replaces a run's files"
    if out_dir.is_symlink():
        return f"{out_dir} is a symbolic link; --force replaces only a directory that an earlier export wrote"
    if not out_dir.is_dir():
        return f"{out_dir} is a file, not an earlier export; --force replaces only a directory that an export wrote"
    if _empty_dir(out_dir):
        return None
    if why := run_data(out_dir):
        return f"{out_dir} belongs to a run ({why}); {never}: choose another OUT_DIR"
    if inside := _inside_run(out_dir):
        return inside
    if not (out_dir / EXPORT_MARKER).is_file():
        return (
            f"{out_dir} is not an earlier export (no {EXPORT_MARKER}); --force replaces only a directory that "
            "miles-vl export wrote: move or delete it yourself if it is not needed, or choose another OUT_DIR"
        )
    for folder, subfolders, _ in os.walk(out_dir):  # links are not followed: rmtree removes a link, not its target
        for sub in subfolders:
            if why := run_data(Path(folder) / sub):
                return (
                    f"{out_dir} holds {Path(folder) / sub}, which belongs to a run ({why}); {never}: move that run "
                    "out first, or choose another OUT_DIR"
                )
    return None


def write_path(out_dir: str | Path) -> Path:
    """The absolute path an export of `out_dir` writes, as the kernel walks it: its parent resolved (a symlink then `..`
    leads where the link points, not where the text says, which `os.path.abspath` would take), its last name kept so
    that a symlink there is seen and refused. Every check and the write itself use this one path."""
    path = Path(out_dir).absolute()
    if path.name in ("", ".", ".."):
        return path.resolve()
    return path.parent.resolve() / path.name


def _inside_run(out_dir: Path) -> str | None:
    for above in write_path(out_dir).resolve().parents:
        if why := run_data(above):
            return (
                f"OUT_DIR {out_dir} is inside {above}, which belongs to a run ({why}); an export never writes into a "
                "run's directories (its hf/ is checkpoint.save_hf's): choose a directory outside it"
            )
    return None


def out_dir_problem(out_dir: str | Path, run_dir: str | Path, *, force: bool) -> str | None:
    """Why `export_run` may not write `out_dir` from `run_dir`, or None (module docstring, Invariants)."""
    out, run, cwd = write_path(out_dir).resolve(), Path(run_dir).resolve(), Path.cwd().resolve()
    outside = f"choose a directory outside it, e.g. {run.with_name(run.name + '-hf')}"
    if out == run:
        return f"OUT_DIR {out_dir} is the run directory {run_dir}; an export never replaces a run: {outside}"
    if out.is_relative_to(run):
        return f"OUT_DIR {out_dir} is inside the run directory {run_dir}; {outside}"
    if run.is_relative_to(out):
        return f"OUT_DIR {out_dir} holds the run directory {run_dir}; an export never replaces a run: {outside}"
    if cwd.is_relative_to(out):
        held = "the current directory" if cwd == out else f"a directory that holds the current one ({cwd})"
        return f"OUT_DIR {out_dir} is {held}; an export writes a directory of its own: name a new one, e.g. hf_model"
    if inside := _inside_run(out):
        return inside
    if problem := write_problem(out.parent):
        return f"OUT_DIR {out_dir} cannot be written: {problem}; choose a place this user can write"
    if Path(out_dir).is_symlink() or (out.exists() and not _empty_dir(out)):
        try:
            _check_replace(Path(out_dir), force)
        except ExportError as err:
            return str(err)
    return None


def check_max_shard_bytes(value: object) -> int | None:
    """`max_shard_bytes` (`--max-shard-bytes`) as a whole number of bytes above 0, or None (the run's setting).

    Raises:
        ExportError: anything else (names what was found).
    """
    if value is None:
        return None
    try:
        number = int(value) if isinstance(value, str) else value
    except ValueError:
        number = None
    if isinstance(number, bool) or not isinstance(number, int) or number < 1:
        raise ExportError(
            f"--max-shard-bytes {value!r}: expected a whole number of bytes above 0 (the size above which the weights "
            "are written in several safetensors files, e.g. 5000000000); leave it out for the run's "
            "checkpoint.save_hf.max_shard_bytes"
        )
    return number


def save_hf_due(step: int, steps: list[int], interval: int, final: bool, last: bool) -> bool:
    """Whether completed step `step` gets an HF directory (`checkpoint.save_hf`); `last`: the run's last step."""
    return step > 0 and (step in steps or bool(interval and step % interval == 0) or (final and last))


def save_hf_during_run(run_dir: Path, step: int, write_weights: Callable[[Path], None], processor, model_path) -> None:
    """<run_dir>/hf/step_N for completed step `step`, unless that label exists (it is written once)."""
    out = run_dir / HF_DIR / step_dir_name(step)
    if out.exists():
        log.info("%s exists (written before a resume): kept", out)
        return
    origin = {"run_dir": str(run_dir.resolve()), "step": step, "by": "checkpoint.save_hf"}
    write_hf_dir(out, write_weights, processor, model_path, force=False, origin=origin)


# ---------------------------------------------------------------------------------------------------------------------
# miles-vl export


def find_checkpoint(run_dir: str | Path, step: int | None) -> tuple[JobConfig, Path]:
    """The run's config and the checkpoint to export: `step`'s, or the newest that verifies.

    Raises:
        ExportError: no run at `run_dir` (no config.yaml), no checkpoint, no checkpoint of `step`, or a broken one;
            each names what exists.
    """
    run_dir = Path(run_dir)
    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        near = (
            sorted(p.name for p in run_dir.parent.iterdir() if (p / "config.yaml").is_file())
            if (run_dir.parent.is_dir())
            else []
        )
        where = f"; runs in {run_dir.parent}: {', '.join(near)}" if near else ""
        raise ExportError(f"{run_dir} is not a run directory (no config.yaml){where}")
    cfg = load_run_config(config_file)
    root = Path(cfg.checkpoint.dir or run_dir / "checkpoints")
    found = list_checkpoints(root)
    if not found:
        raise ExportError(f"{run_dir} has no checkpoint in {root}: the run saved none (checkpoint.interval)")
    steps = [s for s, _ in found]
    if step is not None:
        if step not in steps:
            raise ExportError(f"{run_dir} has no checkpoint of step {step}; its checkpoints are steps {steps}")
        path = dict(found)[step]
        if problems := verify_checkpoint(path):
            raise ExportError(f"checkpoint {path} is broken: {'; '.join(problems)}; its checkpoints are steps {steps}")
        return cfg, path
    for _, path in reversed(found):
        problems = verify_checkpoint(path)
        if not problems:
            return cfg, path
        log.warning("checkpoint %s is broken (%s): trying the one before", path, "; ".join(problems))
    raise ExportError(f"no checkpoint of {run_dir} verifies (steps {steps}); see the warnings above")


def export_run(
    run_dir: str | Path,
    out_dir: str | Path,
    *,
    step: int | None = None,
    force: bool = False,
    max_shard_bytes: int | str | None = None,
    hooks: Hooks | None = None,
) -> Path:
    """Write the HF model directory of a run's checkpoint (module docstring).

    Args:
        run_dir: the run directory (config.yaml, checkpoints/).
        out_dir: the directory to write; must not exist or be empty unless `force`, and lie outside every run.
        step: the checkpoint's step; None: the newest that verifies.
        force: replace a non-empty `out_dir` that is an earlier export (`replace_problem`).
        max_shard_bytes: shard above this size (bytes, >= 1; the CLI's text is checked here); None: the run's
            `checkpoint.save_hf.max_shard_bytes`.
        hooks: what the trainer is built with (tests pass stand-ins).

    Returns:
        `out_dir`.

    Raises:
        ExportError: see `find_checkpoint`, `out_dir_problem`, `check_max_shard_bytes` and `write_hf_dir`; also a
            processor that no longer matches the one the run recorded in processor.yaml. All before Ray starts.
        DiskFullError: the device of `out_dir` ran out of space; the partial directory is removed.
    """
    from miles_vl.orchestration.trainer import Trainer  # imports ray

    hooks = hooks or Hooks()
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    max_shard_bytes = check_max_shard_bytes(max_shard_bytes)
    cfg, checkpoint = find_checkpoint(run_dir, step)
    if problem := out_dir_problem(out_dir, run_dir, force=force):
        raise ExportError(problem)
    processor = load_processor(
        cfg.model.processor or cfg.model.path, cfg.data.min_pixels, cfg.data.max_pixels, video_settings(cfg.data)
    )
    recorded = run_dir / "processor.yaml"
    got = processor_metadata(processor)
    # Compared on the keys the run recorded: runs from before the video settings were recorded lack them.
    if recorded.is_file() and (want := yaml.safe_load(recorded.read_text())) != {k: got.get(k) for k in want}:
        raise ExportError(
            f"the processor at {cfg.model.processor or cfg.model.path} is not the one the run recorded in {recorded} "
            f"(recorded {want}, found {got}); restore the run's processor files"
        )
    shard = cfg.checkpoint.save_hf.max_shard_bytes if max_shard_bytes is None else max_shard_bytes
    origin = {"run_dir": str(run_dir.resolve()), "step": read_driver_state(checkpoint)["step"]}
    origin |= {"checkpoint": str(checkpoint.resolve()), "by": "miles-vl export"}
    log.info("exporting %s to %s", checkpoint, out_dir)
    with ray_session(cfg.ray.address, num_cpus=cfg.ray.num_cpus, dashboard=False):
        gpus = reserve_gpus(cfg.train.num_gpus) if cfg.train.num_gpus else None
        trainer = None
        try:
            trainer = Trainer(cfg, special_tokens(processor), gpus, hooks.train_backends[cfg.train.backend])
            trainer.load_checkpoint(checkpoint)
            write = functools.partial(trainer.save_hf, max_shard_bytes=shard)
            write_hf_dir(out_dir, write, processor, cfg.model.path, force=force, origin=origin)
        finally:
            if trainer is not None:
                trainer.close()
            if gpus is not None:
                gpus.release()
    return out_dir
