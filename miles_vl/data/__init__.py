"""Datasets -> canonical prompts: parquet/jsonl in the geo3k layouts, prompt building, the processor, a generator.

    processor = load_processor("offline", min_pixels=3136, max_pixels=12544)
    splits = build_datasets(cfg.data, processor, seed=cfg.seed)       # train/eval PromptDataset + LoadReports
    batch = splits.train.next_batch(8)                                 # list[PromptSample]

Modules: `records` (PromptRow, VideoRef, PromptSample, LoadReport, DropReason), `images` (bytes/paths/data URLs),
`videos` (frame lists and files, frame sampling), `layouts` (files and column layouts), `prompt` (messages, chat
template, encoding), `loading` (validation and drop counting, with `LoadOptions`), `dataset` (seeded order, resumable
cursor, eval split), `processor` (loading it, its settings), `synth` (procedural problems: geometry diagrams, polygon
questions, the motion video task), `fetch` (public datasets from the hub: geometry3k), `builder` (the only reader of
`DataConfig`), `cli` (`miles-vl data`).
The model family's special tokens and offline processor are in miles_vl/models/qwen3_vl/.

Names are imported on first use (PEP 562), so `miles-vl --help` does not pay for torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

# The names used outside this package, each with the module that defines it.
_EXPORTS = {
    "COLOURS": "synth",
    "DataError": "layouts",
    "DropReason": "records",
    "ImageError": "images",
    "KINDS": "synth",
    "LoadOptions": "loading",
    "PromptDataset": "dataset",
    "PromptEncoder": "prompt",
    "PromptRow": "records",
    "SIDES": "synth",
    "TASKS": "synth",
    "build_datasets": "builder",
    "build_messages": "prompt",
    "convert_geo3k": "fetch",
    "fetch_dataset": "fetch",
    "generate_problems": "synth",
    "load_dataset_fn": "layouts",
    "load_processor": "processor",
    "load_prompt_file": "loading",
    "load_prompt_records": "loading",
    "open_image": "images",
    "processor_metadata": "processor",
    "read_records": "layouts",
    "split_train_eval": "dataset",
    "synth_records": "synth",
    "VideoSettings": "videos",
    "video_settings": "builder",
    "write_synth_parquet": "synth",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'miles_vl.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"miles_vl.data.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
