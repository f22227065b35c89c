"""The hf rollout actor (one per engine; sglang's is in sglang_engines.py, the train ranks' in trainer.py) and the
policy both roles start from.

Actors are thin: each builds its engine or backend from the job config (builders may read the config; the
libraries they call take plain arguments) and forwards calls. Tensors cross between actors through Ray's
object store.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import ray
import torch

from miles_vl.config import JobConfig
from miles_vl.model import SpecialTokens, build_model
from miles_vl.rollout import Generation, HFRolloutEngine, SamplingParams

log = logging.getLogger(__name__)

# Test-only fault injection: when the driver's environment names a file here and that file exists, the next
# generate() call deletes it and kills its process, as a crashed engine would. The driver must replace the engine
# and lose no sample (tests/orchestration/test_loop.py).
FAULT_FILE_ENV = "MILES_VL_FAULT_KILL_ROLLOUT_FILE"


def torch_dtype(cfg: JobConfig, device: str) -> torch.dtype:
    if cfg.model.dtype == "fp32" or (cfg.model.dtype == "auto" and device == "cpu"):
        return torch.float32
    return torch.bfloat16


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_policy(cfg: JobConfig, tokens: SpecialTokens, device: str):
    """The policy model both roles start from (same seed: identical random init on every actor)."""
    return build_model(
        tokens,
        path=cfg.model.path if cfg.model.init == "pretrained" else None,
        tiny=cfg.model.tiny.model_dump(),
        seed=cfg.seed,
        dtype=torch_dtype(cfg, device),
        device=device,
    )


def set_threads(cfg: JobConfig) -> None:
    if cfg.ray.num_cpus:
        torch.set_num_threads(cfg.ray.num_cpus)


@ray.remote
class RolloutWorker:
    def __init__(self, cfg: JobConfig, tokens: SpecialTokens, fault_file: str | None = None):
        set_threads(cfg)
        device = _device()
        self.fault_file = fault_file
        self.engine = HFRolloutEngine(
            build_policy(cfg, tokens, device), tokens, ban_vision_tokens=cfg.rollout.ban_vision_tokens
        )

    def ready(self) -> None:
        """Returns once the engine is built."""

    def generate(self, prompts: Sequence, params: SamplingParams) -> list[list[Generation]]:
        if self.fault_file and Path(self.fault_file).exists():
            Path(self.fault_file).unlink()
            os._exit(1)
        return self.engine.generate(prompts, params)

    # The weight-sync calls every rollout actor answers (weight_sync.py). Buckets load as they come: tensors not
    # sent keep their values, and nothing here depends on the version label.
    def begin_weight_sync(self) -> None:
        pass

    def load_weight_bucket(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        self.engine.load_weights(named_tensors)

    def finish_weight_sync(self, weight_version: str) -> None:
        pass

    def needs_weights(self) -> bool:
        return False  # the model lives in this process: it cannot lose its weights without the actor dying

    def server_restarts(self) -> int:
        return 0

    def release_memory(self) -> None:
        self.engine.release_memory()

    def resume_memory(self) -> None:
        self.engine.resume_memory()

    def shutdown(self) -> None:
        pass
