"""Train backends behind one protocol: `torch` (embedded, transformers on packed THD rows) and `megatron`."""

from miles_vl.train.torch_backend import TorchTrainBackend
from miles_vl.train.types import TrainBackend, TrainSample

__all__ = ["TorchTrainBackend", "TrainBackend", "TrainSample"]
