"""Logging setup: the standard `logging` module with a rich handler. Call `setup_logging` once, in the CLI.

What the console shows of the driver's log also goes to `<run dir>/driver.log` (`run_log`): plain text, one line per
record with its date, time and level, no ANSI codes; appended on a resume; created 0600 (a log holds sample text,
paths and host names: the user's to share, unlike the exported weights). Lines logged before the run directory is
known (config checks, data loading) are held in memory and written first when it is. Ray's forwarded actor output and
what a process prints without `logging` stay on the console only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from rich.console import Console
from rich.logging import RichHandler

DRIVER_LOG = "driver.log"
MAX_HELD_LINES = 100_000  # lines held before a run directory is known (a long data check logs a few hundred)
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


class RunLog(logging.Handler):
    """Log records as plain lines: held in memory until `attach` names the file, then appended to it."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)-8s %(message)s", "%Y-%m-%d %H:%M:%S"))
        self.held: deque[str] = deque(maxlen=MAX_HELD_LINES)
        self.file: TextIO | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = _ANSI.sub("", self.format(record)) + "\n"
            if self.file is None:
                self.held.append(line)
            else:
                self.file.write(line)
                self.file.flush()  # a killed driver leaves every line it logged
        except Exception:
            self.handleError(record)

    def attach(self, path: Path) -> None:
        """Append to `path` (created 0600), the held lines first."""
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with self.lock:
            self.file = os.fdopen(fd, "a", encoding="utf-8")
            self.file.writelines(self.held)
            self.file.flush()
            self.held.clear()

    def detach(self) -> None:
        """Close the file; later lines are held for the next run of this process."""
        with self.lock:
            if self.file is not None:
                self.file.close()
                self.file = None


RUN_LOG = RunLog()


def setup_logging(level: str = "INFO") -> None:
    """Route `logging` through rich on stderr (stdout stays clean for machine-readable output), and to `RUN_LOG`."""
    handler = RichHandler(console=Console(stderr=True), show_path=False, rich_tracebacks=True, markup=False)
    logging.basicConfig(level=level, format="%(message)s", datefmt="[%X]", handlers=[handler, RUN_LOG], force=True)


@contextlib.contextmanager
def run_log(run_dir: Path) -> Iterator[Path]:
    """The driver's log also in `run_dir/driver.log` for the duration of the block (module docstring). A process that
    did not call `setup_logging` (the library) gets the handler here, with no lines from before."""
    root = logging.getLogger()
    added = RUN_LOG not in root.handlers
    if added:
        root.addHandler(RUN_LOG)
    path = Path(run_dir) / DRIVER_LOG
    RUN_LOG.attach(path)
    try:
        yield path
    finally:
        RUN_LOG.detach()
        if added:
            root.removeHandler(RUN_LOG)
