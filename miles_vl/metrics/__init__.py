"""Step metrics: JSONL in the run dir, wandb (offline unless a key is set), progress display, PNG reports."""

from miles_vl.metrics.plots import PANELS, write_report
from miles_vl.metrics.sinks import METRICS_FILE, JsonlSink, Sinks, WandbSink, read_metrics

__all__ = ["METRICS_FILE", "PANELS", "JsonlSink", "Sinks", "WandbSink", "read_metrics", "write_report"]
