"""What goes into and comes out of a rollout engine, and `RolloutEngine`, the protocol every engine implements."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from torch import FloatTensor, LongTensor, Tensor


class PromptLike(Protocol):
    """A canonical prompt (miles_vl.data's records satisfy this): the engine must see exactly these ids."""

    prompt_ids: LongTensor  # [L], image and video tokens already expanded
    pixel_values: Tensor | None  # [n_patches, C*T*P*P]
    image_grid_thw: LongTensor | None  # [n_images, 3]
    pixel_values_videos: Tensor | None  # [n_video_patches, C*T*P*P]; None without videos
    video_grid_thw: LongTensor | None  # [n_videos, 3] (t in frame groups of temporal_patch_size); None without videos


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
    # A generation continued under newer weights (partial rollouts: rollout/sglang/engine.py): (start, end, weight
    # version) of each span of `response_ids`, in order, covering it; `logprobs[start:end]` are that version's.
    # Empty: the whole response was sampled with one version (the one the engine held for the call).
    spans: tuple[tuple[int, int, str | None], ...] = ()


# What an engine's memory release covers, by SGLang's names (sglang/srt/constants.py, 0.5.16): a colocated step
# resumes the weights before the weight sync (which writes them) and the rest after it, so that the engine's KV cache
# is not held beside the sync's buffers.
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
WEIGHTS_MEMORY = ("weights",)


class EngineDiedError(RuntimeError):
    """The engine's worker is gone and will not come back by itself: the driver replaces the engine."""


class RolloutEngine(Protocol):
    """One rollout engine as the driver drives it: a Ray actor (orchestration/engines.py runs a group of them).

    An engine derives from this protocol. It implements `generate`, `load_weight_bucket`, `release_memory` and
    `resume_memory`; the other calls default to what an engine that holds its model in its own process does (hf),
    and an engine with a server process (sglang) overrides them. Implemented by `HFRolloutEngine` (rollout/hf) and
    `SGLangRolloutHost` (rollout/sglang).

    Weights reach an engine one of two ways (miles_vl/rollout/weight_sync.py): through the driver,
    `begin_weight_sync()`, `load_weight_bucket(bucket)` per bucket, `finish_weight_sync(version)`; or, for an
    engine the trainer reaches over NCCL, `begin_weight_sync()`, the trainer's broadcast to `endpoint()`, then
    `expect_weight_version(version)`.
    """

    def ready(self) -> None:
        """Returns once the engine can generate (its constructor waits for that)."""

    def generate(self, prompts: Sequence[PromptLike], params: SamplingParams) -> list[list[Generation]]:
        """`params.n` generations per prompt, in prompt order."""
        ...

    def begin_weight_sync(self) -> None:
        """A sync starts: until it finishes, the engine may hold a mix of old and new tensors."""

    def load_weight_bucket(self, named_tensors: Sequence[tuple[str, Tensor]]) -> None:
        """Load one bucket of (HF name, tensor); tensors not sent keep their values."""
        ...

    def finish_weight_sync(self, weight_version: str) -> None:
        """The sync is complete: the engine serves weights `weight_version` and drops caches of the old ones."""

    def endpoint(self) -> Any:
        """Where trainer rank 0 reaches the engine for an NCCL sync: what the engine kind's group opener takes
        (orchestration/factories.py; sglang: `rollout.sglang.weights.EngineAddress`)."""
        raise NotImplementedError(f"{type(self).__name__} takes weights through load_weight_bucket only")

    def expect_weight_version(self, weight_version: str) -> None:
        """The trainer broadcast weights `weight_version` to this engine over NCCL."""

    def needs_weights(self) -> bool:
        """True when the engine lives but lost its weights (a restarted server): it must be synced again."""
        return False

    def server_restarts(self) -> int:
        """How often the engine relaunched its server process itself."""
        return 0

    def release_memory(self) -> None:
        """Free accelerator memory while the trainer runs (colocated placement)."""
        ...

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Take the memory back after training (weights may then need a sync): `tags` among `MEMORY_TAGS`, None =
        all that is still released; resuming what is not released is a no-op. The loop resumes `WEIGHTS_MEMORY`
        before the weight sync and the rest after it."""
        ...

    def shutdown(self) -> None:
        """Stop what the engine started (a server process outlives a killed actor)."""
