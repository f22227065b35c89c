"""miles_vl: reinforcement learning for vision-language models (Qwen3-VL first).

Start at `miles_vl.cli` (`miles-vl --help`). The packages, in import order: `config`, `data`, `reward`,
`algo`, `packing` (pure; no Ray, no engines) -> `rollout`, `train` -> `orchestration` -> `cli`.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("miles-vl")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+source"

__all__ = ["__version__"]
