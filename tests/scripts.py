"""Import a script of this repository that is not a package module (scripts/gpu/*.py, benchmarks/...) by its path."""

import importlib.util
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load_script(relative: str, name: str | None = None) -> ModuleType:
    """The module at REPO/`relative`, executed once per call, named `name` (default: the file's stem)."""
    path = REPO / relative
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
