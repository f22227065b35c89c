"""Logging setup: the standard `logging` module with a rich handler. Call `setup_logging` once, in the CLI."""

from __future__ import annotations

import logging

from rich.console import Console
from rich.logging import RichHandler


def setup_logging(level: str = "INFO") -> None:
    """Route `logging` through rich on stderr (stdout stays clean for machine-readable output)."""
    handler = RichHandler(console=Console(stderr=True), show_path=False, rich_tracebacks=True, markup=False)
    logging.basicConfig(level=level, format="%(message)s", datefmt="[%X]", handlers=[handler], force=True)
