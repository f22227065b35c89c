"""Ray actors for the two roles: a rollout worker per engine (hf here; sglang in sglang_engines.py) and the train
worker.

They are thin: each builds its engine or backend from the job config (builders may read the config; the
libraries they call take plain arguments) and forwards calls. Tensors cross between actors through Ray's
object store.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import ray
import torch

from miles_vl.config import JobConfig
from miles_vl.model import SpecialTokens, build_model
from miles_vl.orchestration.sglang_engines import EngineAddress, TrainerWeightGroup
from miles_vl.rollout import Generation, HFRolloutEngine, SamplingParams
from miles_vl.rollout.hf_engine import vision_token_ids
from miles_vl.rollout.sglang import SyncReport, iter_buckets
from miles_vl.train import TorchTrainBackend, TrainSample

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


def _set_threads(cfg: JobConfig) -> None:
    if cfg.ray.num_cpus:
        torch.set_num_threads(cfg.ray.num_cpus)


@ray.remote
class RolloutWorker:
    def __init__(self, cfg: JobConfig, tokens: SpecialTokens, fault_file: str | None = None):
        _set_threads(cfg)
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


@ray.remote
class TrainWorker:
    def __init__(self, cfg: JobConfig, tokens: SpecialTokens):
        _set_threads(cfg)
        device = _device()
        t, a = cfg.train, cfg.algo
        o = t.optimizer
        self.backend = TorchTrainBackend(
            build_policy(cfg, tokens, device),
            tokens,
            lr=o.lr,
            weight_decay=o.weight_decay,
            betas=o.betas,
            eps=o.eps,
            grad_clip=o.grad_clip,
            warmup_steps=o.warmup_steps,
            micro_batch_max_tokens=t.micro_batch_max_tokens,
            global_batch_size=t.global_batch_size,
            ppo_epochs=t.ppo_epochs,
            freeze_vision=t.freeze_vision,
            temperature=cfg.rollout.temperature,
            suppress_token_ids=vision_token_ids(tokens) if cfg.rollout.ban_vision_tokens else (),
            clip_low=a.clip_low,
            clip_high=a.clip_high,
            dual_clip_c=a.dual_clip_c,
            loss_reduction=a.loss_reduction,
            kl_coef=a.kl_coef,
            kl_estimator=a.kl_estimator,
            entropy_coef=a.entropy_coef,
            tis_mode=a.tis.mode if a.tis.enabled else None,
            tis_cap=a.tis.cap,
        )

    def train(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        return self.backend.train(samples)

    def export_weights(self) -> list:
        return list(self.backend.export_weights())

    def export_weight_buckets(self, max_bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The trainable weights in byte-bounded buckets, one at a time: call with
        `.options(num_returns="streaming")` so that each bucket is its own object (weight_sync.py)."""
        yield from iter_buckets(self.backend.export_weights(), max_bucket_bytes)

    # NCCL weight sync (disaggregated sglang engines): this actor is the source rank of the weight-update group.
    weight_group: TrainerWeightGroup | None = None

    def open_weight_group(self, engines: Sequence[EngineAddress], **options) -> None:
        """Form the weight-update group with these engines (they join concurrently; returns once formed).
        `options`: those of `TrainerWeightGroup` (backend, max_bucket_bytes, timeouts)."""
        if self.weight_group is not None:
            raise RuntimeError("a weight-update group is already open: close_weight_group() first")
        self.weight_group = TrainerWeightGroup(engines, **options)

    def send_weights(self, weight_version: str) -> SyncReport:
        """Broadcast the trainable weights to every engine of the group, labelled `weight_version`."""
        if self.weight_group is None:
            raise RuntimeError("send_weights() before open_weight_group()")
        return self.weight_group.send(self.backend.export_weights(), weight_version)

    def close_weight_group(self) -> None:
        if self.weight_group is not None:
            group, self.weight_group = self.weight_group, None
            group.close()

    def save_checkpoint(self, directory: str) -> None:
        self.backend.save_checkpoint(Path(directory))

    def load_checkpoint(self, directory: str) -> None:
        self.backend.load_checkpoint(Path(directory))
