"""Step metrics: JSONL in the run dir, wandb (offline unless a key or a login is at hand), TensorBoard, progress
display, PNG reports."""

from miles_vl.metrics.plots import PANELS, write_report
from miles_vl.metrics.sinks import METRICS_FILE, JsonlSink, Sinks, TensorBoardSink, WandbSink, read_metrics

__all__ = [
    "METRICS_FILE",
    "PANELS",
    "JsonlSink",
    "Sinks",
    "TensorBoardSink",
    "WandbSink",
    "read_metrics",
    "write_report",
]
