"""What goes into and comes out of a rollout engine, and the `RolloutEngine` protocol both engines implement."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from torch import FloatTensor, LongTensor, Tensor


class PromptLike(Protocol):
    """A canonical prompt (miles_vl.data's records satisfy this): the engine must see exactly these ids."""

    prompt_ids: LongTensor  # [L], image tokens already expanded
    pixel_values: Tensor | None  # [n_patches, C*T*P*P]
    image_grid_thw: LongTensor | None  # [n_images, 3]


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # responses per prompt
    max_new_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    seed: int = 0  # the same seed and prompts give the same responses (resume reproduces a run)


@dataclass(frozen=True)
class Generation:
    response_ids: LongTensor  # [R], ends with an EOS token when finish_reason == "stop"
    logprobs: FloatTensor  # [R] log-probability of each sampled token under the sampling distribution
    finish_reason: Literal["stop", "length"]


class RolloutEngine(Protocol):
    """Generates responses for canonical prompts and takes new weights. Implemented by `hf` and `sglang`."""

    def generate(self, prompts: Sequence[PromptLike], params: SamplingParams) -> list[list[Generation]]:
        """`params.n` generations per prompt, in prompt order."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Replace the weights (HF names) and drop every cache that depends on them."""
        ...

    def release_memory(self) -> None:
        """Free accelerator memory while the trainer runs (colocated placement)."""
        ...

    def resume_memory(self) -> None: ...
