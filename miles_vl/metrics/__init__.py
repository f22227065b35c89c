"""Step metrics: JSONL in the run dir, wandb (offline unless a key or a login is at hand), TensorBoard, progress
display, PNG reports.

The names below are imported on first use: a Ray actor that imports one submodule (a train rank imports `profile`)
does not import matplotlib and the sinks with it (about 0.6 s of each actor's start on a small machine)."""

import importlib

_SUBMODULE = {
    "PANELS": "plots",
    "write_report": "plots",
    "METRICS_FILE": "sinks",
    "JsonlSink": "sinks",
    "Sinks": "sinks",
    "TensorBoardSink": "sinks",
    "WandbSink": "sinks",
    "read_metrics": "sinks",
}
__all__ = sorted(_SUBMODULE)


def __getattr__(name: str):
    if submodule := _SUBMODULE.get(name):
        return getattr(importlib.import_module(f"miles_vl.metrics.{submodule}"), name)
    raise AttributeError(f"module 'miles_vl.metrics' has no attribute {name!r}")
