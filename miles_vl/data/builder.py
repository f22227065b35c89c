"""The one place the data package reads the config: `DataConfig` -> train and eval `PromptDataset`s.

    splits = build_datasets(cfg.data, processor, seed=cfg.seed)
    batch = splits.train.next_batch(cfg.rollout.batch_size)

Sources: `train_path` (parquet/jsonl), or `synthetic_n` generated problems of `synthetic_task` (`synth`, seeded by
the job seed): geometry diagrams or polygon questions, one image each (`synthetic_task=many_images`: `synthetic_images`
numbered images each), or with `synthetic_task=motion` short videos
of a moving shape. `blank_images` makes the encoder replace every image and video frame by a white one (the control
run). Eval: `eval_path`, else a seeded `eval_fraction` of the training rows, else none. Every load is counted and
logged (`LoadReport`); a training set with no usable row is an error. Every problem with the files is a `DataError`
naming the file (the CLI exits with status 2 on it, before Ray starts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_vl.config.schema import DataConfig
from miles_vl.data.dataset import PromptDataset, split_train_eval
from miles_vl.data.layouts import DataError, load_dataset_fn
from miles_vl.data.loading import LoadOptions, load_prompt_file, load_prompt_records
from miles_vl.data.prompt import PromptEncoder
from miles_vl.data.records import LoadReport, PromptRow
from miles_vl.data.synth import synth_records
from miles_vl.data.videos import VideoSettings


def video_settings(cfg: DataConfig) -> VideoSettings:
    """The video sampling settings of the `data` section, for `load_processor(..., video=...)` (None: keep the
    checkpoint's)."""
    return VideoSettings(
        fps=cfg.video_fps,
        min_frames=cfg.video_min_frames,
        max_frames=cfg.video_max_frames,
        min_pixels=cfg.video_min_pixels,
        max_pixels=cfg.video_max_pixels,
    )


def load_options(cfg: DataConfig) -> LoadOptions:
    """The layout, columns, `dataset_fn` and limits of the `data` section, as every load of a job's files takes them.

    Raises:
        DataError: a `dataset_fn` that does not resolve (`layouts.load_dataset_fn`).
    """
    return LoadOptions(
        max_prompt_len=cfg.max_prompt_len,
        layout=cfg.format,
        prompt_key=cfg.prompt_key,
        answer_key=cfg.answer_key,
        image_key=cfg.image_key,
        video_key=cfg.video_key,
        dataset_fn=load_dataset_fn(cfg.dataset_fn) if cfg.dataset_fn else None,
        max_image_pixels=cfg.max_image_pixels,
        max_video_bytes=cfg.max_video_bytes,
    )


@dataclass
class DataSplits:
    train: PromptDataset
    eval: PromptDataset | None  # None when neither eval_path nor eval_fraction is set
    reports: list[LoadReport] = field(default_factory=list)  # one per load (train, then eval_path if any)


def build_datasets(
    cfg: DataConfig, processor: Any, *, seed: int, records: Sequence[dict[str, Any]] | None = None
) -> DataSplits:
    """Load, validate and split the data of one job.

    Args:
        cfg: the `data` section of the job config.
        processor: from `load_processor(..., cfg.min_pixels, cfg.max_pixels, video_settings(cfg))`.
        seed: the job seed: synthetic problems, the eval hold-out and the shuffling order derive from it.
        records: the training rows in memory (with `cfg.in_memory`), in the columns of `cfg.format` (or mapped by
            `cfg.dataset_fn`); relative image paths are looked up in the working directory.

    Returns:
        The train dataset (shuffled per `cfg.shuffle`), the eval dataset (load order) or None, and the load reports.

    Raises:
        DataError: both train_path and synthetic_n set; `records` given without `cfg.in_memory` or the reverse; no
            usable training row; errors of the loaders.
    """
    if (records is not None) != cfg.in_memory:
        raise DataError(
            f"data.in_memory={cfg.in_memory} but rows were{'' if records is not None else ' not'} given in memory; "
            "pass dataset= to run_job together with data.in_memory=true (and neither for data from the config)"
        )
    if cfg.train_path and cfg.synthetic_n:
        raise DataError(
            f"data.train_path={cfg.train_path!r} and data.synthetic_n={cfg.synthetic_n} are both set; "
            "set data.synthetic_n=0 to train on the file, or data.train_path=null for generated problems"
        )
    encoder = PromptEncoder(
        processor, system_prompt=cfg.system_prompt, instruction=cfg.instruction, blank_images=cfg.blank_images
    )
    options = load_options(cfg)
    if records is not None:
        train_rows, report = load_prompt_records(records, encoder, options, source="run_job(dataset=...)")
    elif cfg.train_path:
        train_rows, report = load_prompt_file(cfg.train_path, encoder, options)
    else:  # generated rows: the geometry3k layout; the data section's columns and dataset_fn are for files
        synthetic = LoadOptions(
            max_prompt_len=cfg.max_prompt_len,
            layout="geometry3k",
            max_image_pixels=cfg.max_image_pixels,
            max_video_bytes=cfg.max_video_bytes,
        )
        source = f"synthetic(n={cfg.synthetic_n}, seed={seed}, task={cfg.synthetic_task})"
        train_rows, report = load_prompt_records(
            synth_records(cfg.synthetic_n, seed, cfg.synthetic_task, cfg.synthetic_images),
            encoder,
            synthetic,
            source=source,
        )
    reports = [report]
    if not train_rows:
        raise DataError(f"no usable training rows: {report.summary()}; fix the data or the limits (see the log)")
    eval_rows: list[PromptRow] | None = None
    if cfg.eval_path:
        eval_rows, eval_report = load_prompt_file(cfg.eval_path, encoder, options)
        reports.append(eval_report)
    elif cfg.eval_fraction > 0:
        train_rows, eval_rows = split_train_eval(train_rows, cfg.eval_fraction, seed)
    return DataSplits(
        train=PromptDataset(train_rows, encoder, seed=seed, shuffle=cfg.shuffle),
        eval=PromptDataset(eval_rows, encoder, seed=seed, shuffle=False) if eval_rows is not None else None,
        reports=reports,
    )
