"""Datasets -> canonical prompts: parquet/jsonl in the geo3k layouts, prompt building, the processor, a generator.

    processor = load_processor("offline", min_pixels=3136, max_pixels=12544)
    splits = build_datasets(cfg.data, processor, seed=cfg.seed)       # train/eval PromptDataset + LoadReports
    batch = splits.train.next_batch(8)                                 # list[PromptSample]
    tokens = special_tokens(processor)                                 # ids for packing, engines, the tiny model

Modules: `records` (PromptRow, PromptSample, LoadReport, DropReason), `images` (bytes/paths/data URLs),
`layouts` (files and column layouts), `prompt` (messages, chat template, encoding), `loading` (validation and
drop counting), `dataset` (seeded order, resumable cursor, eval split), `processor` and `offline_processor`,
`synth` (procedural geo3k-style problems), `builder` (the only reader of `DataConfig`), `cli` (`miles-vl data`).

Names are imported on first use (PEP 562), so `miles-vl --help` does not pay for torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "DataSplits": "builder",
    "build_datasets": "builder",
    "PromptDataset": "dataset",
    "split_train_eval": "dataset",
    "DataError": "layouts",
    "ImageError": "images",
    "image_ref": "images",
    "open_image": "images",
    "LAYOUT_CHOICES": "layouts",
    "load_dataset_fn": "layouts",
    "read_records": "layouts",
    "resolve_layout": "layouts",
    "load_prompt_file": "loading",
    "load_prompt_records": "loading",
    "OFFLINE_PROCESSOR_DIR": "offline_processor",
    "build_offline_processor": "offline_processor",
    "OFFLINE": "processor",
    "load_processor": "processor",
    "processor_metadata": "processor",
    "special_tokens": "processor",
    "IMAGE_PLACEHOLDER": "prompt",
    "PromptEncoder": "prompt",
    "build_messages": "prompt",
    "DropReason": "records",
    "DroppedRow": "records",
    "ImageRef": "records",
    "LoadReport": "records",
    "PromptRow": "records",
    "PromptSample": "records",
    "COLOURS": "synth",
    "KINDS": "synth",
    "SIDES": "synth",
    "TASKS": "synth",
    "SynthProblem": "synth",
    "generate_problem": "synth",
    "generate_problems": "synth",
    "synth_records": "synth",
    "write_synth_parquet": "synth",
}

__all__ = [
    "COLOURS",
    "IMAGE_PLACEHOLDER",
    "KINDS",
    "LAYOUT_CHOICES",
    "OFFLINE",
    "OFFLINE_PROCESSOR_DIR",
    "DataError",
    "DataSplits",
    "DropReason",
    "DroppedRow",
    "ImageError",
    "ImageRef",
    "LoadReport",
    "PromptDataset",
    "PromptEncoder",
    "PromptRow",
    "PromptSample",
    "SIDES",
    "TASKS",
    "SynthProblem",
    "build_datasets",
    "build_messages",
    "build_offline_processor",
    "generate_problem",
    "generate_problems",
    "image_ref",
    "load_dataset_fn",
    "load_processor",
    "load_prompt_file",
    "load_prompt_records",
    "open_image",
    "processor_metadata",
    "read_records",
    "resolve_layout",
    "special_tokens",
    "split_train_eval",
    "synth_records",
    "write_synth_parquet",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'miles_vl.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"miles_vl.data.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load lazily above
    from miles_vl.data.builder import DataSplits, build_datasets
    from miles_vl.data.dataset import PromptDataset, split_train_eval
    from miles_vl.data.images import ImageError, image_ref, open_image
    from miles_vl.data.layouts import LAYOUT_CHOICES, DataError, load_dataset_fn, read_records, resolve_layout
    from miles_vl.data.loading import load_prompt_file, load_prompt_records
    from miles_vl.data.offline_processor import OFFLINE_PROCESSOR_DIR, build_offline_processor
    from miles_vl.data.processor import OFFLINE, load_processor, processor_metadata, special_tokens
    from miles_vl.data.prompt import IMAGE_PLACEHOLDER, PromptEncoder, build_messages
    from miles_vl.data.records import DroppedRow, DropReason, ImageRef, LoadReport, PromptRow, PromptSample
    from miles_vl.data.synth import (
        COLOURS,
        KINDS,
        SIDES,
        TASKS,
        SynthProblem,
        generate_problem,
        generate_problems,
        synth_records,
        write_synth_parquet,
    )
