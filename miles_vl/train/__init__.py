"""Train backends behind one protocol, `TrainBackend`: `torch` (embedded, transformers on packed THD rows) and
`megatron` (production); the RL step over either is `train_step` (step.py).

`MegatronTrainBackend` and `build_megatron_backend` load lazily: importing `miles_vl.train` never imports megatron.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from miles_vl.train.step import train_step
from miles_vl.train.torch_backend import TorchTrainBackend
from miles_vl.train.types import LossOptions, OptimizerOptions, TrainBackend, TrainOptions, TrainSample

_LAZY = {
    "MegatronTrainBackend": "miles_vl.train.megatron.backend",
    "build_megatron_backend": "miles_vl.train.megatron.build",
}

__all__ = [
    "LossOptions",
    "MegatronTrainBackend",
    "OptimizerOptions",
    "TorchTrainBackend",
    "TrainBackend",
    "TrainOptions",
    "TrainSample",
    "build_megatron_backend",
    "train_step",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'miles_vl.train' has no attribute {name!r}")
