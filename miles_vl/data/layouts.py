"""Dataset files and the row layouts users already have, mapped to one shape: (problem, images, answer, metadata).

Files: `.parquet` (pyarrow) or `.jsonl` (one JSON object per line). Layouts:

    geometry3k    hiyouga/geometry3k: `problem` (with `<image>`), `images` = list of {bytes, path}, `answer`
    geo3k_imgurl  chenhegu/geo3k_imgurl: the same columns, `images` = list of strings (paths, file:// or data URLs)
    verl          verl's geo3k preprocessing (examples/data_preprocess/geo3k.py): `prompt` = chat messages, a list of
                  {role, content} with one `user` message (its content the problem: a string with `<image>`, or a list
                  of {type: text, text} / {type: image} parts), `images` as in geometry3k,
                  `reward_model` = {ground_truth: answer, ...}; `data_source`, `ability` become metadata
    generic       any columns: the prompt, answer and image columns are named by `prompt_key`, `answer_key`,
                  `image_key` (the image column may be absent for text-only prompts, or hold one image per row)

`auto` picks geometry3k or geo3k_imgurl when the file has `problem`, `answer` and `images` and the keys are the
defaults (by the type of the first image value), verl when it has `prompt` and `reward_model` (and no `problem`) and
the keys are the defaults, else generic. A verl prompt with a `system` or `assistant` message is a `DataError`: the
system prompt is `data.system_prompt`, one for every row. Any image value `images.image_ref` understands works
in every layout; the layout fixes the columns. Videos are read from the `video_key` column (default `videos`) in
every layout when it holds a list: one entry per `<video>` placeholder, each a frame list or a file path (see
`videos`); a scalar in that column is metadata. A custom
`dataset_fn` (`module:function`, see `load_dataset_fn`) maps each raw record to the geometry3k shape instead.

A file that cannot be read (missing, not parquet, truncated, a jsonl line that is not UTF-8 or not a JSON object,
missing columns) is a `DataError` that names the file (and the line); the CLI prints it and exits with status 2
before Ray starts.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from miles_vl.import_path import shadowing_problem

Layout = Literal["geometry3k", "geo3k_imgurl", "verl", "generic"]
LAYOUT_CHOICES = ("auto", "geometry3k", "geo3k_imgurl", "verl", "generic")
GEO3K_KEYS = ("problem", "answer", "images")  # prompt, answer, image columns of both geo3k layouts (the defaults)
VERL_KEYS = ("prompt", "reward_model", "images")  # chat messages, {ground_truth: ...}, images

# A custom row mapper: one raw record -> {"problem": str, "answer": str, "images": list?, "videos": list?,
# "metadata": dict?} or None.
DatasetFn = Callable[[dict[str, Any]], Mapping[str, Any] | None]


class DataError(ValueError):
    """A dataset file (or custom mapper) that cannot be used; the message names the file, the line and the fix."""


@dataclass(frozen=True)
class RowFields:
    """One record's prompt, images, videos and answer as found (not yet validated)."""

    problem: Any
    images: list[Any]
    answer: Any
    metadata: dict[str, Any] = field(default_factory=dict)
    videos: list[Any] = field(default_factory=list)  # one value per `<video>`: a frame list or a file path


@dataclass(frozen=True)
class LayoutKeys:
    layout: Layout
    prompt_key: str
    answer_key: str
    image_key: str
    video_key: str = "videos"


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """All records of a parquet or jsonl file, as dicts (parquet structs become dicts, lists stay lists).

    Raises:
        DataError: no such file; another suffix; a parquet file that does not read (not parquet, truncated,
            corrupt); a jsonl line that is not UTF-8, not JSON or not an object (names the line).
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"dataset file not found: {path}; check data.train_path / data.eval_path")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as err:  # pyarrow raises ArrowInvalid, OSError, ... depending on how the file is broken
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise DataError(
                f"{path}: cannot read it as parquet ({first}); the file is truncated, corrupt or not parquet: write "
                "it again (e.g. `miles-vl data synth`, pandas.DataFrame.to_parquet)"
            ) from None
    if suffix == ".jsonl":
        return _read_jsonl(path)
    raise DataError(f"{path}: unsupported file type {suffix!r}; use .parquet or .jsonl")


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise DataError(
                    f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column {err.start + 1}); save "
                    "the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno}: not valid JSON ({err}); fix or remove the line") from None
            if not isinstance(record, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, found {type(record).__name__}")
            records.append(record)
    return records


def resolve_layout(
    records: Sequence[Mapping[str, Any]],
    layout: str = "auto",
    *,
    prompt_key: str = "problem",
    answer_key: str = "answer",
    image_key: str = "images",
    video_key: str = "videos",
    source: str = "dataset",
) -> LayoutKeys:
    """Decide the layout and the columns to read, and check that the columns exist.

    Args:
        records: the raw records (only their keys and the first image value are looked at).
        layout: auto | geometry3k | geo3k_imgurl | verl | generic.
        prompt_key, answer_key, image_key: the columns of the generic layout.
        video_key: the video column, in every layout (it may be absent).
        source: the file name, for messages.

    Returns:
        The layout and its column names.

    Raises:
        DataError: an unknown layout; a geo3k layout combined with non-default keys; a prompt or answer column that
            no record has (the message names the file and lists the columns found).
    """
    if layout not in LAYOUT_CHOICES:
        raise DataError(f"unknown data format {layout!r}; choose one of {', '.join(LAYOUT_CHOICES)}")
    keys = (prompt_key, answer_key, image_key)
    columns = sorted({k for r in records for k in r})
    if layout in ("geometry3k", "geo3k_imgurl", "verl") and keys != GEO3K_KEYS:
        raise DataError(
            f"data.format={layout} reads fixed columns, but prompt_key/answer_key/image_key are {keys}, not the "
            f"defaults {GEO3K_KEYS}; leave them at the defaults, or set data.format=generic for your own column names"
        )
    if layout == "auto":
        layout = "generic"
        if keys == GEO3K_KEYS and {"prompt", "reward_model"} <= set(columns) and "problem" not in columns:
            layout = "verl"
        elif keys == GEO3K_KEYS and set(GEO3K_KEYS) <= set(columns):
            first = next((v for r in records for v in as_image_list(r.get("images"))), None)
            if isinstance(first, dict):
                layout = "geometry3k"
            elif isinstance(first, str):
                layout = "geo3k_imgurl"
    if layout == "verl":
        prompt_key, answer_key, image_key = VERL_KEYS
    for what, key in (("prompt", prompt_key), ("answer", answer_key)):
        if records and key not in columns:
            raise DataError(
                f"{source}: no {what} column {key!r} (layout {layout}); the columns are {columns}; "
                f"set data.{what}_key (with data.format=generic) or data.dataset_fn"
            )
    return LayoutKeys(layout, prompt_key, answer_key, image_key, video_key)


def row_fields(record: Mapping[str, Any], keys: LayoutKeys) -> RowFields:
    """The prompt, images, videos and answer of one record; its other scalar columns become metadata.

    The video column counts only when it holds a list (of video entries): a column of that name with a scalar (a
    count, a tag, written by someone who never meant videos) is metadata like any other.
    """
    videos = record.get(keys.video_key)
    has_videos = isinstance(videos, list | tuple)
    taken = (keys.prompt_key, keys.answer_key, keys.image_key) + ((keys.video_key,) if has_videos else ())
    metadata = {k: v for k, v in record.items() if k not in taken and _is_scalar(v)}
    problem, answer = record.get(keys.prompt_key), record.get(keys.answer_key)
    if keys.layout == "verl":
        problem = verl_problem(problem)
        answer = answer.get("ground_truth") if isinstance(answer, Mapping) else None
    return RowFields(
        problem=problem,
        images=as_image_list(record.get(keys.image_key)),
        answer=answer,
        metadata=metadata,
        videos=list(videos) if has_videos else [],
    )


def verl_problem(messages: Any) -> str | None:
    """The problem text of a verl `prompt`: the content of its one `user` message, a string, or a list of parts
    ({type: text, text} kept as text, {type: image} as `<image>`, in order). None (the row is dropped as
    `missing_field`) when the prompt is missing or has no user message.

    Raises:
        DataError: a message that is not {role, content}, a `system` or `assistant` message (the system prompt is
            `data.system_prompt`, for every row), more than one user message, a content part of another type.
    """
    if messages is None:
        return None
    if not isinstance(messages, list | tuple) or not all(isinstance(m, Mapping) and "role" in m for m in messages):
        raise DataError(
            f"the verl column 'prompt' must be a list of chat messages {{role, content}}, found "
            f"{type(messages).__name__}: {str(messages)[:80]!r}; fix the file or set data.format"
        )
    roles = [m["role"] for m in messages]
    if set(roles) - {"user"} or len(roles) > 1:
        raise DataError(
            f"the verl prompt has the messages {roles}, expected one 'user' message; the system prompt is "
            "data.system_prompt (one for every row) and a prompt has no assistant turns: remove the others from the "
            "file, or map the rows with data.dataset_fn"
        )
    if not roles:
        return None
    content = messages[0].get("content")
    if isinstance(content, list | tuple):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind not in ("text", "image"):
                raise DataError(
                    f"the verl user message has a content part {str(part)[:80]!r}; expected {{type: text, text}} or "
                    "{type: image}; fix the file or map the rows with data.dataset_fn"
                )
            parts.append((part.get("text") or "") if kind == "text" else "<image>")
        return "".join(parts)
    return content


def as_image_list(value: Any) -> list[Any]:
    """An image column value as a list: None -> [], a list/tuple -> itself, one image -> [it]."""
    if value is None:
        return []
    if isinstance(value, list | tuple):
        return list(value)
    return [value]


def as_video_list(value: Any) -> list[Any]:
    """A `dataset_fn`'s `videos` as a list of videos: None -> [], a string or dict (one video) -> [it], a list ->
    itself (a list of videos: one video of frames is `[[frame, ...]]`)."""
    if value is None:
        return []
    if isinstance(value, str | dict):
        return [value]
    return list(value)


def load_dataset_fn(spec: str) -> DatasetFn:
    """Import a custom row mapper given as `package.module:function`.

    The function takes one raw record (dict) and returns `{"problem": str, "answer": str, "images": [...],
    "videos": [...], "metadata": {...}}` (images, videos and metadata optional) in the geometry3k shape, or None to
    skip the record (counted as `skipped_by_dataset_fn`).

    Raises:
        DataError: malformed spec, module not importable, attribute missing or not callable (names the spec).
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise DataError(f"data.dataset_fn={spec!r} must look like 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise DataError(f"data.dataset_fn={spec!r}: cannot import {module_name!r}: {err}") from err
    if problem := shadowing_problem(module_name, obj):
        raise DataError(f"data.dataset_fn={spec!r}: {problem}")
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise DataError(f"data.dataset_fn={spec!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise DataError(f"data.dataset_fn={spec!r} is a {type(obj).__name__}, not a function")
    return obj


def apply_dataset_fn(fn: DatasetFn, record: dict[str, Any]) -> RowFields | None:
    """Run a custom row mapper on one record; None means skip.

    Raises:
        TypeError: the mapper returned something other than None or a mapping with `problem` and `answer`.
    """
    out = fn(record)
    if out is None:
        return None
    if not isinstance(out, Mapping) or "problem" not in out or "answer" not in out:
        raise TypeError(
            f"dataset_fn {getattr(fn, '__name__', fn)!r} returned {type(out).__name__}; it must return None or a "
            "mapping with 'problem' and 'answer' (and optionally 'images', 'videos', 'metadata')"
        )
    return RowFields(
        problem=out["problem"],
        images=as_image_list(out.get("images")),
        answer=out["answer"],
        metadata=dict(out.get("metadata") or {}),
        videos=as_video_list(out.get("videos")),
    )


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool)
