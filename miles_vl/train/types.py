"""The options both train backends take, and the `TrainBackend` protocol that the RL step (step.py) runs over. What
the driver hands a backend is `miles_vl.algo.TrainSample` (algo/samples.py)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import NamedTuple, Protocol

import torch
from torch import FloatTensor, Tensor

from miles_vl.algo import KLEstimator, LossReduction, PolicyLossMetrics, PolicyLossType, TISMode, TrainSample

# ---------------------------------------------------------------------------------------------------------------------
# options


@dataclass(frozen=True)
class OptimizerOptions:
    """AdamW with gradient-norm clipping; the learning rate warms up linearly over `warmup_steps` optimizer steps,
    then stays constant."""

    lr: float
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float = 1.0
    warmup_steps: int = 0
    cpu_offload: float = 0.0  # fraction of the optimizer state on the CPU (megatron's HybridDeviceOptimizer)


@dataclass(frozen=True)
class LossOptions:
    """The policy loss (`miles_vl.algo.policy_loss`, its token weights) and the distribution it scores: the one the
    engine samples from, logits / `temperature` with the tokens the engine bans removed."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip_c: float | None = None
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "low_var_kl"
    entropy_coef: float = 0.0
    tis_mode: TISMode | None = None
    tis_cap: float = 2.0
    policy_loss_type: PolicyLossType = "ppo"  # gspo: each token's response ratio (`seq_log_ratio`, from the backend)
    reduction: LossReduction = "token_mean"
    max_response_len: int | None = None  # the constant of reduction="seq_mean_token_sum_norm" (Dr.GRPO)
    temperature: float = 1.0  # the rollout's sampling temperature
    suppress_token_ids: tuple[int, ...] = ()  # tokens the engine bans: scored out of the same distribution

    @property
    def score_temperature(self) -> float:
        """The temperature logits are divided by (greedy rollouts, temperature 0: the plain softmax)."""
        return self.temperature if self.temperature > 0 else 1.0

    def policy_loss_kwargs(self) -> dict:
        """The keyword arguments of `miles_vl.algo.policy_loss` (the fields but the token-weight and scoring ones)."""
        scoring = ("reduction", "max_response_len", "temperature", "suppress_token_ids")
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in scoring}


@dataclass(frozen=True)
class TrainOptions:
    """Everything a train backend is trained with, besides its model and parallel layout.

    Args:
        optimizer: the optimizer and its schedule.
        loss: the policy loss.
        micro_batch_max_tokens: token budget of one packed micro-batch (per CP group).
        global_batch_size: samples per optimizer step; None: all samples of the RL step.
        ppo_epochs: passes over the samples per RL step.
        freeze_vision: the vision tower (and its mergers) is neither trained nor exported.
        old_logprobs_from_train_forward: when the RL step makes one optimizer update (one mini-batch of all the
            samples, one epoch), the old logprobs are the train forward's own, detached, instead of those of a
            separate no-gradient forward before it: the weights are the same, so the values are (step.py).
        logits_only_where_loss: the train forward's output layer (the vocabulary projection) runs on the hidden
            states of the positions whose label carries loss only, not on prompt positions.
        vision_once_per_image: the vision tower runs once per distinct image of a micro-batch (the n samples of a
            prompt share its images) and its output is read at every use (models/qwen3_vl/vision_once.py).
        pinned_input_copies: the megatron backend copies a micro-batch's tensors to the GPU through pinned host
            memory, without the stream synchronization of a copy from pageable memory (megatron/batch.py to_device).
    """

    optimizer: OptimizerOptions
    loss: LossOptions = LossOptions()
    micro_batch_max_tokens: int = 8192
    global_batch_size: int | None = None
    ppo_epochs: int = 1
    freeze_vision: bool = False
    old_logprobs_from_train_forward: bool = False
    logits_only_where_loss: bool = False
    vision_once_per_image: bool = False
    pinned_input_copies: bool = False


# ---------------------------------------------------------------------------------------------------------------------
# the protocol


class MiniBatch(NamedTuple):
    """The samples of one optimizer step, `samples[i] for i in idx`, among all the RL step's samples. `old` and `ref`
    hold one `[response_len]` tensor per sample of `samples` (not of the mini-batch)."""

    samples: Sequence[TrainSample]  # all the RL step's samples
    idx: Sequence[int]  # the mini-batch's indices into `samples`
    old: Sequence[Tensor] | None  # the old policy's logprobs; None: this forward's own, detached (`train_step` decides)
    ref: Sequence[Tensor] | None = None  # the reference policy's logprobs, for the KL term; None: no KL term


class Accumulated(NamedTuple):
    """What one mini-batch's forward/backward left besides the gradients."""

    metrics: PolicyLossMetrics  # over every rank of the mini-batch
    tokens: int  # packed row tokens processed (padding included), over every DP rank
    finite: bool  # every loss was finite (a non-finite one is not back-propagated)
    micro_batches: int  # packed forward-backward passes of one DP rank (every DP rank runs as many)


class CheckpointWrite(Protocol):
    """A checkpoint write in flight (`TrainBackend.start_checkpoint`). A distributed backend's calls are collective:
    every rank calls them in the same order."""

    def done(self) -> bool:
        """Whether the write has ended (then the files are complete, or `wait` raises why not); does not wait."""
        ...

    def wait(self) -> None:
        """Wait for the write to end; raises its error (a full disk, ...)."""
        ...


class TrainBackend(Protocol):
    """Forward, backward, optimizer step and checkpoints of one policy; `train_step` (step.py) is the RL step over it.
    Implemented by `TorchTrainBackend` (embedded) and `MegatronTrainBackend` (production). Every method of a
    distributed backend is collective: all ranks call it with the same samples."""

    options: TrainOptions
    dp_size: int  # data-parallel ranks: every one needs the same number of samples per mini-batch

    def compute_logprobs(self, samples: Sequence[TrainSample]) -> list[FloatTensor]:
        """Current policy logprobs of every response token, `[response_len]` per sample (fp32, CPU; no gradient)."""
        ...

    def compute_ref_logprobs(self, samples: Sequence[TrainSample]) -> list[FloatTensor]:
        """The same under the reference policy (the initial weights), for the KL term."""
        ...

    def accumulate_gradients(self, batch: MiniBatch) -> Accumulated:
        """Zero the gradients, then back-propagate the policy loss of the mini-batch `batch.samples[batch.idx]`
        micro-batch by micro-batch. The token weights use the mini-batch's global denominators, so the gradient is that
        of the mini-batch loss however the samples are split. `batch.old` None: the old logprobs are this forward's
        own, detached (only right before the weights' first update on these samples: `train_step` decides)."""
        ...

    def optimizer_step(self, finite: bool) -> tuple[float, bool]:
        """Clip and step unless `finite` is False or the gradient norm is not finite; zero the gradients.
        Returns (gradient norm, whether the weights moved)."""
        ...

    def lr(self) -> float:
        """The learning rate of the last optimizer step."""
        ...

    def set_lr(self, lr: float) -> None:
        """Make `lr` the peak learning rate (`options.optimizer.lr`) from the next optimizer step on; the LR warm-up
        factor still applies and the optimizer state is kept (the format warm-up runs at its own peak lr)."""
        ...

    def set_vision_trainable(self, trainable: bool) -> None:
        """Train the vision tower from the next optimizer step on, or hold it where it is (the format warm-up);
        a no-op when it is frozen for the whole run (`freeze_vision`)."""
        ...

    def export_weights(self, on_device: bool = False) -> Iterable[tuple[str, Tensor]]:
        """Trainable weights as (HF name, tensor) pairs, for the rollout engines: CPU tensors, or with `on_device`
        tensors where the trainer holds them (a GPU sync takes them without a copy through the CPU)."""
        ...

    def save_hf(self, directory: Path, max_shard_bytes: int) -> None:
        """The whole policy (frozen parts too) as a Hugging Face model directory (config.json, safetensors sharded
        above `max_shard_bytes`; train/hf_files.py), for transformers' `from_pretrained` and SGLang. Collective: rank
        0 writes. The processor files are the caller's."""
        ...

    def save_checkpoint(self, directory: Path, optimizer_state: bool = True) -> None:
        """Write the trainer's checkpoint files into `directory`: the weights, counters and LR schedule, and with
        `optimizer_state` the optimizer's state (fp32 main weights, Adam moments; checkpoint.optimizer_state). A backend
        that can write in the background also has one of (the train actor uses it when present,
        orchestration/trainer.py; else this, before the next step), taking `optimizer_state` alike:
        - `checkpoint_snapshot(optimizer_state) -> write(directory)` (torch: the state copied to host memory at the
          call, so the next step does not change what `write` writes; the actor runs `write` in a thread);
        - `start_checkpoint(directory, optimizer_state) -> CheckpointWrite` (megatron: the backend starts the write
          itself, in megatron-core's writer process, and finishes it with collective calls on every rank)."""
        ...

    def load_checkpoint(self, directory: Path) -> None:
        """Restore what `save_checkpoint` wrote, into a backend as built. From files without the optimizer's state the
        optimizer starts afresh on the loaded weights: its moments zero, its fp32 main weights the loaded ones."""
        ...


# ---------------------------------------------------------------------------------------------------------------------
# helpers both backends use


def check_loss_masks(samples: Sequence[TrainSample]) -> None:
    """Raises ValueError if a sample's loss_mask marks prompt tokens (only response tokens can carry loss)."""
    for i, s in enumerate(samples):
        if s.loss_mask is not None and bool(s.loss_mask[: s.prompt_len].any()):
            raise ValueError(f"sample {i}: loss_mask marks prompt tokens; only response tokens can carry loss")


def at_labels(per_sample: Sequence[Tensor], ids: Sequence[int], sample: Tensor, resp_idx: Tensor) -> Tensor:
    """Per-sample response arrays (`[response_len]` each) read at a micro-batch's label positions (fp32, CPU).

    Args:
        per_sample: one array per sample of the call.
        ids: the micro-batch's samples (indices into `per_sample`), in row order.
        sample: [n] each label position's sample, as an index into `ids`.
        resp_idx: [n] each label position's index in its sample's response.
    """
    flat = torch.cat([per_sample[i].detach().float().cpu().reshape(-1) for i in ids])
    lens = torch.tensor([per_sample[i].numel() for i in ids])
    return flat[(torch.cumsum(lens, 0) - lens)[sample] + resp_idx]


def response_logprobs(full_row: Tensor, cu_seqlens: Tensor, row_samples: Sequence[TrainSample]) -> list[Tensor]:
    """Per-sample `[response_len]` slices (fp32, CPU) of a full packed row's `[T]` label logprobs, whose segments are
    `cu_seqlens` and hold `row_samples` in order: the logits before the first response token score it."""
    starts = [int(cu_seqlens[j]) + s.prompt_len - 1 for j, s in enumerate(row_samples)]
    return [full_row[a : a + s.response_len].float().cpu().clone() for a, s in zip(starts, row_samples, strict=True)]
