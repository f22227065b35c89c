"""Load a dataset into validated `PromptRow`s, dropping (never repairing) the rows that cannot be used.

    rows, report = load_prompt_file("geo3k/train.parquet", encoder, LoadOptions(max_prompt_len=2048))
    # report: kept 2099 of 2101 rows (layout geometry3k); dropped 2: corrupt_image=1, prompt_too_long=1

Checks, in order, for every row (the first failure is its drop reason, see `records.DropReason`):
prompt and answer present -> as many `<image>` placeholders as images and `<video>` as videos -> every image
resolves (no remote URLs, no missing files), is within `max_image_pixels` and decodes -> every video resolves, its
frames are sampled (the processor's fps and frame limits), take at most `max_video_bytes` decoded (from their headers
before decoding, and while decoding) and decode, all of one size -> the canonical prompt (image
and video tokens expanded) fits `max_prompt_len`. A video file with no decoder installed is a `DataError` (it says
what to install), not a dropped row. A custom `dataset_fn` that raises or returns junk is a `DataError` naming the
file and row. The report is logged (`logging`, logger `miles_vl.data.loading`) when the load ends.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_vl.data.images import ImageError, image_ref, open_image
from miles_vl.data.layouts import (
    DataError,
    DatasetFn,
    LayoutKeys,
    RowFields,
    apply_dataset_fn,
    read_records,
    resolve_layout,
    row_fields,
)
from miles_vl.data.prompt import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, PromptEncoder
from miles_vl.data.records import DropReason, LoadReport, PromptRow
from miles_vl.data.videos import VideoError, probe_video, video_source

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadOptions:
    """How a load reads rows and which rows it keeps: the `data.*` settings the loaders take (`builder.load_options`
    makes one from the `data` section).

    Attributes:
        max_prompt_len: longest allowed canonical prompt, in tokens; longer rows are dropped.
        layout: auto | geometry3k | geo3k_imgurl | verl | generic (ignored with `dataset_fn`).
        prompt_key, answer_key, image_key: columns of the generic layout.
        video_key: the video column (every layout; it may be absent).
        dataset_fn: custom mapper from a raw record to the geometry3k shape (or None to skip it).
        max_image_pixels: rows with a larger image are dropped (`image_too_large`) before it is decoded; None: no
            bound but PIL's.
        max_video_bytes: rows with a video whose sampled frames take more bytes decoded are dropped
            (`video_too_large`), before decoding from the headers and while decoding; None: no bound.
    """

    max_prompt_len: int
    layout: str = "auto"
    prompt_key: str = "problem"
    answer_key: str = "answer"
    image_key: str = "images"
    video_key: str = "videos"
    dataset_fn: DatasetFn | None = None
    max_image_pixels: int | None = None
    max_video_bytes: int | None = None


def load_prompt_file(
    path: str | Path, encoder: PromptEncoder, options: LoadOptions
) -> tuple[list[PromptRow], LoadReport]:
    """Read a parquet/jsonl file and validate every row (see `load_prompt_records`).

    Relative image paths are looked up in the file's folder first, then in the working directory.

    Raises:
        DataError: from `layouts.read_records` / `layouts.resolve_layout`, or a failing `dataset_fn`.
    """
    path = Path(path)
    return load_prompt_records(read_records(path), encoder, options, source=str(path), base_dir=path.parent)


def load_prompt_records(
    records: Sequence[dict[str, Any]],
    encoder: PromptEncoder,
    options: LoadOptions,
    *,
    source: str,
    base_dir: Path | None = None,
) -> tuple[list[PromptRow], LoadReport]:
    """Validate raw records into `PromptRow`s; count and log every dropped row.

    Args:
        records: raw rows (dicts) in one of the layouts of `miles_vl.data.layouts`.
        encoder: renders and counts prompts (its processor fixes the image token counts).
        options: the layout, columns, `dataset_fn` and limits (`LoadOptions`).
        source: name of the data for the report and the log.
        base_dir: folder relative image and video paths are looked up in first.

    Returns:
        The kept rows in record order, and the `LoadReport`.

    Raises:
        ValueError: a bad `max_prompt_len`.
        DataError: a bad layout or missing column (see `resolve_layout`); a `dataset_fn` that raises or returns
            something other than None or a mapping with problem and answer (names the source and the row); a video
            file with no video decoder installed (names the source, the row and what to install).
    """
    if options.max_prompt_len <= 0:
        raise ValueError(f"max_prompt_len must be positive, found {options.max_prompt_len}; fix data.max_prompt_len")
    keys: LayoutKeys | None = None
    if options.dataset_fn is None:
        keys = resolve_layout(
            records,
            options.layout,
            prompt_key=options.prompt_key,
            answer_key=options.answer_key,
            image_key=options.image_key,
            video_key=options.video_key,
            source=source,
        )
    report = LoadReport(source=source, layout=keys.layout if keys else "custom", n_rows=len(records))
    rows: list[PromptRow] = []
    for index, record in enumerate(records):
        try:
            fields = row_fields(record, keys) if keys else apply_dataset_fn(options.dataset_fn, record)
        except DataError as err:  # a record the layout cannot read (a verl prompt with a system message)
            raise DataError(f"{source}: row {index}: {err}") from err
        except Exception as err:
            raise DataError(f"{source}: row {index}: dataset_fn failed: {type(err).__name__}: {err}") from err
        if fields is None:
            report.drop(index, DropReason.SKIPPED_BY_DATASET_FN, "dataset_fn returned None")
            continue
        try:
            row = _validate(index, fields, encoder, options, base_dir, report)
        except DataError as err:
            raise DataError(f"{source}: row {index}: {err}") from err
        if row is not None:
            rows.append(row)
    report.n_kept = len(rows)
    report.log(log)
    return rows, report


def _validate(
    index: int,
    fields: RowFields,
    encoder: PromptEncoder,
    options: LoadOptions,
    base_dir: Path | None,
    report: LoadReport,
) -> PromptRow | None:
    problem, answer = fields.problem, fields.answer
    if not isinstance(problem, str) or not problem.strip():
        report.drop(index, DropReason.MISSING_FIELD, f"prompt is {_describe(problem)}, expected non-empty text")
        return None
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        report.drop(index, DropReason.MISSING_FIELD, f"answer is {_describe(answer)}")
        return None
    for placeholder, media, what in (
        (IMAGE_PLACEHOLDER, fields.images, "images"),
        (VIDEO_PLACEHOLDER, fields.videos, "videos"),
    ):
        if (n_placeholders := problem.count(placeholder)) != len(media):
            fix = f"put one {placeholder} in the prompt per entry of the {what} column"
            if not media:  # perhaps the text means it literally: it cannot be kept as text
                fix = (
                    f"the row has no {what}, and {placeholder} always marks where one goes (it is never kept as text): "
                    f"give the {what} as a list in the {what} column (data.{what[:-1]}_key), or reword the prompt "
                    f"(in the file, or with a data.dataset_fn) if {placeholder} is meant literally"
                )
            report.drop(
                index,
                DropReason.PLACEHOLDER_MISMATCH,
                f"{n_placeholders} {placeholder} placeholders but {len(media)} {what}; {fix}",
            )
            return None
    try:
        refs = tuple(image_ref(value, base_dir) for value in fields.images)
        # (width, height); decoding all of it catches truncation
        sizes = [open_image(ref, options.max_image_pixels).size for ref in refs]
    except ImageError as err:
        report.drop(index, err.reason, str(err))
        return None
    for width, height in sizes:
        try:
            encoder.image_tokens(width, height)
        except ValueError as err:  # e.g. an aspect ratio above 200, which Qwen's smart_resize refuses
            report.drop(index, DropReason.CORRUPT_IMAGE, f"the processor cannot take a {width}x{height} image: {err}")
            return None
    try:
        videos = tuple(
            probe_video(
                video_source(value, base_dir), encoder.processor, options.max_image_pixels, options.max_video_bytes
            )
            for value in fields.videos
        )
    except VideoError as err:
        report.drop(index, err.reason, str(err))
        return None
    prompt_len = encoder.count_tokens(problem, sizes, videos)
    if prompt_len > options.max_prompt_len:
        frames = f", video frames {[len(v.indices) for v in videos]}" if videos else ""
        report.drop(
            index,
            DropReason.PROMPT_TOO_LONG,
            f"{prompt_len} tokens > max_prompt_len {options.max_prompt_len} (images {sizes}{frames})",
        )
        return None
    return PromptRow(
        index=index,
        problem=problem,
        images=refs,
        label=str(answer).strip(),
        prompt_len=prompt_len,
        metadata=fields.metadata,
        videos=videos,
    )


def _describe(value: Any) -> str:
    return "missing" if value is None else f"{type(value).__name__} {str(value)[:40]!r}"
