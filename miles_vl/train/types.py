"""What the driver hands a train backend, and the `TrainBackend` protocol both backends implement."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from torch import FloatTensor, LongTensor, Tensor


@dataclass
class TrainSample:
    """One response with its prompt, ready to be packed. `input_ids = prompt_ids + response_ids`."""

    input_ids: LongTensor  # [L]
    prompt_len: int
    advantage: float
    rollout_logprobs: FloatTensor  # [L - prompt_len] the engine's logprobs of the response tokens
    image_grid_thw: LongTensor | None = None  # [n_images, 3]
    video_grid_thw: LongTensor | None = None
    pixel_values: Tensor | None = None  # [n_patches, C*T*P*P]
    pixel_values_videos: Tensor | None = None
    loss_mask: LongTensor | None = None  # [L]; None: every response token

    @property
    def response_len(self) -> int:
        return self.input_ids.numel() - self.prompt_len


class TrainBackend(Protocol):
    """Trains the policy on packed micro-batches. Implemented by `torch` (embedded) and `megatron` (production)."""

    def compute_logprobs(self, samples: Sequence[TrainSample]) -> list[FloatTensor]:
        """Current policy logprobs of every response token, `[response_len]` per sample (no gradient)."""
        ...

    def train(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """One RL step's optimisation on these samples (all optimizer steps of it); returns flat metrics."""
        ...

    def export_weights(self) -> Iterable[tuple[str, Tensor]]:
        """Trainable weights as (HF name, tensor) pairs, for the rollout engines."""
        ...

    def save_checkpoint(self, directory: Path) -> None: ...

    def load_checkpoint(self, directory: Path) -> None: ...
