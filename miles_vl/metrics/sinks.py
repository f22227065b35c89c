"""Where step metrics go: a JSONL file in the run dir (always), wandb (offline unless a key is set), and a rich
progress line. Metrics are flat `{name: float}` dicts, one per RL step, with `step` set.

metrics.jsonl is appended one whole line per step. A writer killed mid-line leaves a torn last line (no newline):
readers skip it with a warning that names the file (its step is past the last checkpoint, so a resume writes it
again); any other line that is not a JSON object is an error naming the file and line. A resume rewrites the file
atomically (temp file + rename) without the records it will write again.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


class JsonlSink:
    """Appends one JSON object per step to `<run_dir>/metrics.jsonl`; on resume, drops steps >= the resume step
    so that the file reads as one uninterrupted run."""

    def __init__(self, run_dir: str | Path, resume_step: int = 0):
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            records = read_metrics(self.path)
            kept = [r for r in records if r.get("step", 0) < resume_step]
            if len(kept) < len(records):
                log.info(
                    "%s: %d records past step %d will be written again",
                    self.path,
                    len(records) - len(kept),
                    resume_step - 1,
                )
            tmp = self.path.with_name(f".{METRICS_FILE}.tmp-{os.getpid()}")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, self.path)

    def log(self, metrics: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({k: _jsonable(v) for k, v in metrics.items()}) + "\n")

    def close(self) -> None:
        pass


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All step records of a metrics.jsonl (a run dir or the file itself); a torn last line is skipped (logged).

    Raises:
        FileNotFoundError: no metrics.jsonl there.
        ValueError: a line other than a torn last one is not a JSON object (names the file and line).
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.exists():
        raise FileNotFoundError(f"no {METRICS_FILE} at {path}; is this a miles-vl run directory?")
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    records = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:
            if lineno == len(lines) and not text.endswith("\n"):
                log.warning("%s:%d: skipped a torn last line (a writer stopped mid-line): %.80r", path, lineno, line)
                continue
            raise ValueError(f"{path}:{lineno}: not a JSON record ({err}); fix or remove the line") from None
        if not isinstance(record, dict):
            raise ValueError(
                f"{path}:{lineno}: expected a JSON object, found {type(record).__name__}; fix or remove the line"
            )
        records.append(record)
    return records


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no nan/inf
    return v


class WandbSink:
    """wandb in offline mode unless `mode=online`, or `mode=auto` with WANDB_API_KEY set."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        project: str,
        entity: str | None,
        mode: str,
        name: str,
        config: dict[str, Any],
        resume_step: int = 0,
    ):
        import wandb

        if mode == "auto":
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        self.resume_step = resume_step
        self.run = wandb.init(
            project=project,
            entity=entity,
            mode=mode,
            name=name,
            dir=str(run_dir),
            config=config,
            reinit="finish_previous",
            settings=wandb.Settings(silent=True),
        )
        log.info("wandb: %s mode, files under %s", mode, Path(run_dir) / "wandb")

    def log(self, metrics: dict[str, Any]) -> None:
        self.run.log({k: v for k, v in metrics.items() if k != "step"}, step=int(metrics["step"]))

    def log_samples(self, name: str, records: list[dict[str, Any]], step: int) -> None:
        """A step's samples (orchestration/samples.py) as the table `samples/<name>`, one row per sample."""
        import wandb

        columns = list(dict.fromkeys(k for r in records for k in r))
        table = wandb.Table(columns=columns, data=[[_cell(r.get(c)) for c in columns] for r in records])
        self.run.log({f"samples/{name}": table}, step=step)

    def close(self) -> None:
        self.run.finish()


def _cell(value: Any) -> Any:
    """A wandb table cell: a scalar, so a dict (a sample's rewards by function) goes as its JSON text."""
    return json.dumps(value) if isinstance(value, dict | list) else value


class Sinks:
    """Fan out to several sinks."""

    def __init__(self, sinks: list):
        self.sinks = sinks

    def log(self, metrics: dict[str, Any]) -> None:
        for s in self.sinks:
            s.log(metrics)

    def log_samples(self, name: str, records: list[dict[str, Any]], step: int) -> None:
        """To the sinks that keep sample tables (wandb); metrics.jsonl does not (the samples have their own files)."""
        for s in self.sinks:
            if hasattr(s, "log_samples"):
                s.log_samples(name, records, step)

    def close(self) -> None:
        for s in self.sinks:
            s.close()
