"""Where step metrics go: a JSONL file in the run dir (always), wandb (offline unless a key or a `wandb login` is at
hand; a resume continues the run's wandb run), TensorBoard (`logging.tensorboard`), and a rich progress line.
Metrics are flat `{name: float}` dicts, one per RL step, with `step` set.

metrics.jsonl is appended one whole line per step. A writer killed mid-line leaves a torn last line (no newline):
readers skip it with a warning that names the file (its step is past the last checkpoint, so a resume writes it
again); any other line that is not a JSON object is an error naming the file and line. A resume rewrites the file
atomically (temp file + rename) without the records it will write again.
"""

from __future__ import annotations

import json
import logging
import math
import netrc
import os
import secrets
import string
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from miles_vl.metrics.tfevents import EventFileWriter

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def replace_text(path: Path, text: str) -> None:
    """`path` holds `text`, written atomically: into a temporary file beside it, then renamed over it (a reader sees
    the old file or the new, never a part)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


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
            replace_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))

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


WANDB_RUN_ID = "wandb_run_id"  # in the run directory: the id a resume continues
WANDB_HOST = "https://api.wandb.ai"


class WandbSink:
    """wandb, online or offline as `wandb_mode` decides. A run directory keeps its wandb run id (`wandb_run_id`), and a
    resume continues that wandb run (`resume`: the job resumed from a checkpoint); a fresh start begins a new one."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        project: str,
        entity: str | None,
        mode: str,
        name: str,
        config: dict[str, Any],
        resume: bool = False,
    ):
        import wandb

        mode, why = wandb_mode(mode)
        run_id, continued = _wandb_run_id(Path(run_dir), resume)
        self.run = wandb.init(
            project=project,
            entity=entity,
            mode=mode,
            name=name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            config=config,
            reinit="finish_previous",
            settings=wandb.Settings(silent=True),
        )
        what = "continuing" if continued else "new"
        log.info("wandb: %s mode (%s), %s run %s, files under %s", mode, why, what, run_id, Path(run_dir) / "wandb")

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


TENSORBOARD_DIR = "tensorboard"


class TensorBoardSink:
    """Every numeric metric of a step as a TensorBoard scalar, in `<run_dir>/tensorboard` (tfevents.py: no tensorboard
    package needed to write it; `tensorboard --logdir <run dir>/tensorboard` to read it). `resume_step`: the first step
    a resumed run writes (TensorBoard then drops the earlier files' points from that step on)."""

    def __init__(self, run_dir: str | Path, resume_step: int | None = None):
        self.writer = EventFileWriter(Path(run_dir) / TENSORBOARD_DIR, first_step=resume_step)
        log.info("tensorboard: %s", self.writer.path)

    def log(self, metrics: dict[str, Any]) -> None:
        values = {k: v.item() if hasattr(v, "item") else v for k, v in metrics.items() if k != "step"}
        self.writer.add_scalars(
            int(metrics["step"]), {k: float(v) for k, v in values.items() if isinstance(v, int | float)}
        )

    def close(self) -> None:
        self.writer.close()


def wandb_mode(mode: str) -> tuple[str, str]:
    """The mode wandb runs in for `logging.wandb.mode`, and why. `auto` is online when wandb has an API key at hand:
    WANDB_API_KEY, or the one `wandb login` stored in the netrc file (NETRC, else ~/.netrc) for the wandb host
    (WANDB_BASE_URL, else api.wandb.ai); else offline. A netrc file that does not parse is named in a warning."""
    if mode != "auto":
        return mode, f"logging.wandb.mode={mode}"
    if os.environ.get("WANDB_API_KEY"):
        return "online", "auto: WANDB_API_KEY is set"
    path = Path(os.environ.get("NETRC") or "~/.netrc").expanduser()
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or WANDB_HOST).netloc
    try:
        entry = netrc.netrc(path).authenticators(host) if path.is_file() else None
    except (netrc.NetrcParseError, OSError, UnicodeDecodeError) as err:
        log.warning("wandb: %s cannot be read (%s), so a `wandb login` there is not seen: running offline", path, err)
        entry = None
    if entry and entry[2]:
        return "online", f"auto: the `wandb login` for {host} in {path}"
    return "offline", f"auto: no WANDB_API_KEY and no `wandb login` for {host} in {path}"


def _wandb_run_id(run_dir: Path, resume: bool) -> tuple[str, bool]:
    """The wandb run id of this start and whether it continues the run directory's wandb run: a resume continues the
    id in `run_dir/wandb_run_id`; a fresh start (or a resume of a run from before the file existed) records a new one.
    A fresh start in a directory that has one is a run started again after it left no checkpoint: its earlier wandb
    run stays in wandb, named in a warning."""
    path = run_dir / WANDB_RUN_ID
    earlier = path.read_text().strip() if path.is_file() else None
    if resume and earlier:
        return earlier, True
    run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # as wandb's ids
    if earlier:
        log.warning(
            "wandb: %s starts again from step 0 as wandb run %s; the earlier one was %s", run_dir, run_id, earlier
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(run_id + "\n")
    return run_id, False


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
