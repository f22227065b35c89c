"""Hugging Face model directories from a run: `miles-vl export` after training, `checkpoint.save_hf` during it.

    miles-vl export outputs/geo3k_tiny_cpu hf_out            # the newest checkpoint that verifies
    miles-vl export outputs/geo3k_tiny_cpu --step 4 hf_out   # that step's checkpoint

    python -c "from transformers import AutoModelForImageTextToText as M; M.from_pretrained('hf_out')"
    python -m sglang.launch_server --model-path hf_out

The directory holds config.json, the weights as safetensors (sharded with model.safetensors.index.json above
`checkpoint.save_hf.max_shard_bytes`, 5 GB by default; train/hf_files.py), the processor files with the chat template
(the processor the run loaded: `model.processor` or `model.path`, with the run's min/max pixels) and, when model.path
has one, generation_config.json. The weights come from the train backend itself (`TrainBackend.save_hf`): `export_run`
reads the run's config.yaml, starts its trainer as the run did (Ray, the same backend and parallel layout: a megatron
run needs its train GPUs), loads the checkpoint and has the ranks export it (megatron through megatron-bridge's HF
export, the path the weight sync uses). Nothing is started for the engines.

Invariants: an output directory appears complete or not at all (written to `.<name>.tmp-<pid>` beside it and
renamed); `export_run` never replaces a non-empty directory without `force`; a label under <run dir>/hf is written
once (a resumed run that reaches the same step again keeps the first, as checkpoints do). Checkpoints are not touched.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import yaml

from miles_vl.config import JobConfig, load_config
from miles_vl.data import load_processor, processor_metadata
from miles_vl.models.qwen3_vl.tokens import special_tokens
from miles_vl.orchestration.checkpoint import list_checkpoints, step_dir_name, verify_checkpoint
from miles_vl.orchestration.factories import Hooks
from miles_vl.orchestration.placement import ray_session, reserve_gpus

log = logging.getLogger(__name__)

HF_DIR = "hf"  # <run dir>/hf/step_N: checkpoint.save_hf's directories
GENERATION_CONFIG = "generation_config.json"


class ExportError(ValueError):
    """A run, step or output directory that cannot be exported (names what exists and what to do)."""


# ---------------------------------------------------------------------------------------------------------------------
# one directory


def write_hf_dir(
    out_dir: str | Path, write_weights: Callable[[Path], None], processor, model_path: str | None, *, force: bool
) -> Path:
    """Write an HF model directory at `out_dir` atomically (a temporary directory beside it, renamed).

    Args:
        out_dir: the directory to create.
        write_weights: writes config.json and the safetensors into the given directory (a backend's `save_hf`).
        processor: the run's processor (`save_pretrained`: tokenizer, chat template, image and video processors).
        model_path: the checkpoint the run started from (its generation_config.json is copied when there is one).
        force: replace `out_dir` if it exists and is not empty.

    Raises:
        ExportError: `out_dir` is a non-empty directory (or a file) and not `force`.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not (out_dir.is_dir() and not any(out_dir.iterdir())) and not force:
        raise ExportError(f"{out_dir} exists and is not empty; choose another directory, or --force to replace it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        write_weights(tmp)
        processor.save_pretrained(tmp)
        if model_path and (Path(model_path) / GENERATION_CONFIG).is_file():
            shutil.copyfile(Path(model_path) / GENERATION_CONFIG, tmp / GENERATION_CONFIG)
        if out_dir.is_dir():
            shutil.rmtree(out_dir)
        elif out_dir.exists():
            out_dir.unlink()
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("wrote the Hugging Face model %s", out_dir)
    return out_dir


def save_hf_due(step: int, steps: list[int], interval: int, final: bool, last: bool) -> bool:
    """Whether completed step `step` gets an HF directory (`checkpoint.save_hf`); `last`: the run's last step."""
    return step > 0 and (step in steps or bool(interval and step % interval == 0) or (final and last))


def save_hf_during_run(run_dir: Path, step: int, write_weights: Callable[[Path], None], processor, model_path) -> None:
    """<run_dir>/hf/step_N for completed step `step`, unless that label exists (it is written once)."""
    out = run_dir / HF_DIR / step_dir_name(step)
    if out.exists():
        log.info("%s exists (written before a resume): kept", out)
        return
    write_hf_dir(out, write_weights, processor, model_path, force=False)


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
    cfg = load_config(config_file)
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
    max_shard_bytes: int | None = None,
    hooks: Hooks | None = None,
) -> Path:
    """Write the HF model directory of a run's checkpoint (module docstring).

    Args:
        run_dir: the run directory (config.yaml, checkpoints/).
        out_dir: the directory to write; must not exist or be empty unless `force`.
        step: the checkpoint's step; None: the newest that verifies.
        force: replace a non-empty `out_dir`.
        max_shard_bytes: shard above this size; None: the run's `checkpoint.save_hf.max_shard_bytes`.
        hooks: what the trainer is built with (tests pass stand-ins).

    Returns:
        `out_dir`.

    Raises:
        ExportError: see `find_checkpoint` and `write_hf_dir`; also a processor that no longer matches the one the
            run recorded in processor.yaml.
    """
    from miles_vl.orchestration.trainer import Trainer  # imports ray

    hooks = hooks or Hooks()
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    cfg, checkpoint = find_checkpoint(run_dir, step)
    if out_dir.exists() and not (out_dir.is_dir() and not any(out_dir.iterdir())) and not force:
        raise ExportError(f"{out_dir} exists and is not empty; choose another directory, or --force to replace it")
    processor = load_processor(cfg.model.processor or cfg.model.path, cfg.data.min_pixels, cfg.data.max_pixels)
    recorded = run_dir / "processor.yaml"
    if recorded.is_file() and (want := yaml.safe_load(recorded.read_text())) != (got := processor_metadata(processor)):
        raise ExportError(
            f"the processor at {cfg.model.processor or cfg.model.path} is not the one the run recorded in {recorded} "
            f"(recorded {want}, found {got}); restore the run's processor files"
        )
    shard = max_shard_bytes or cfg.checkpoint.save_hf.max_shard_bytes
    log.info("exporting %s to %s", checkpoint, out_dir)
    with ray_session(cfg.ray.address, num_cpus=cfg.ray.num_cpus, dashboard=False):
        gpus = reserve_gpus(cfg.train.num_gpus) if cfg.train.num_gpus else None
        trainer = None
        try:
            trainer = Trainer(cfg, special_tokens(processor), gpus, hooks.train_backends[cfg.train.backend])
            trainer.load_checkpoint(checkpoint)
            write_hf_dir(out_dir, lambda d: trainer.save_hf(d, shard), processor, cfg.model.path, force=force)
        finally:
            if trainer is not None:
                trainer.close()
            if gpus is not None:
                gpus.release()
    return out_dir
