"""Train backends behind one protocol, `TrainBackend`: `torch` (embedded, transformers on packed THD rows) and
`megatron` (production, `miles_vl.train.megatron`: importing `miles_vl.train` never imports megatron); the RL step
over either is `train_step` (step.py).
"""

from miles_vl.train.step import train_step
from miles_vl.train.torch_backend import TorchTrainBackend
from miles_vl.train.types import CheckpointWrite, LossOptions, OptimizerOptions, TrainBackend, TrainOptions, TrainSample

__all__ = [
    "CheckpointWrite",
    "LossOptions",
    "OptimizerOptions",
    "TorchTrainBackend",
    "TrainBackend",
    "TrainOptions",
    "TrainSample",
    "train_step",
]
