"""The production train backend: megatron-bridge's Qwen3-VL under TP/PP/CP/EP, trained on pre-sharded THD rows.

    backend = build_megatron_backend(hf_path, tokens, tp=2, cp=2, lr=1e-6, ...)   # build.py (GPUs, NCCL)
    metrics = backend.train(samples)          # every rank of the train group calls with the SAME samples

One RL step (`train`) is the torch backend's step (miles_vl/train/torch_backend.py) spread over the process grid:
1. old logprobs of every response token (`compute_logprobs`, no gradient); reference logprobs when `kl_coef > 0`
   (the initial weights, swapped in for that pass);
2. for each PPO epoch and mini-batch of `global_batch_size` samples: the samples are split over DP ranks (equal
   counts, balanced tokens), each rank's share is cut into micro-batches under the token budget, packed as THD
   rows and zigzag-sharded over CP (`batch.py`); megatron's schedule runs forward/backward per micro-batch
   (`step.py`) with the loss of each rank's local label positions weighted by the mini-batch's global
   denominators, so gradients summed over CP, DP and micro-batches are those of the mini-batch loss (the scaling
   is derived in step.py); then gradient clipping and one optimizer step. A non-finite gradient norm skips the
   step and is counted.

The same per-sample loss as the torch backend: logits at a row position score the next token, divided by the
temperature, with the engine's suppressed tokens removed (`vocab_parallel.py`), and `miles_vl.algo.policy_loss`
on those logprobs.

What needs CUDA (AutoBridge loading, DDP, the distributed optimizer, megatron's schedule) comes in through the
constructor: `build.py` builds the real parts; CPU tests pass plain modules, a torch optimizer with megatron's
optimizer methods and `step.sequential_forward_backward`, and run this same code.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
from torch import Tensor

import miles_vl.patches
from miles_vl.algo import LossReduction, PolicyLossMetrics, combine_metrics, loss_denominators, policy_loss
from miles_vl.model import SpecialTokens
from miles_vl.train.megatron import checkpoint as ckpt
from miles_vl.train.megatron.batch import (
    MicroBatch,
    attach_loss_inputs,
    check_loss_masks,
    pack_micro_batch,
    sample_loss_tokens,
)
from miles_vl.train.megatron.export import export_hf_weights
from miles_vl.train.megatron.parallel import ParallelGroups, all_reduce_sum, gather_per_sample, reduce_metrics
from miles_vl.train.megatron.plan import plan_data_parallel, split_for_data_parallel
from miles_vl.train.megatron.step import StepOptions, check_token_norm, forward_step
from miles_vl.train.types import TrainSample

miles_vl.patches.install()  # megatron-bridge's Qwen3-VL module must be patched before the first forward

log = logging.getLogger(__name__)


class MegatronTrainBackend:
    """Implements `TrainBackend` on megatron model chunks. All knobs are plain arguments (`build.py` wires them).

    Args:
        model: model chunks (one per virtual pipeline stage), DDP-wrapped for training; must have
            `zero_grad_buffer()` (megatron DDP).
        optimizer: megatron optimizer, its `clip_grad` set (or an object with `zero_grad`, `prepare_grads`,
            `get_grad_norm`, `step`, `param_groups`, `sharded_state_dict`, `load_state_dict`).
        tokens: special token ids.
        groups: process groups (default: megatron's parallel state).
        schedule: megatron's forward_backward function (default `get_forward_backward_func()`).
        bridge: the AutoBridge the model came from (needed by `export_weights`).
        frozen_prefixes: megatron parameter names that are frozen (not exported), e.g. ("vision_model.",).
        device: where micro-batches and collectives go (default: the current CUDA device, else CPU).
        Others: as `TorchTrainBackend` (betas, eps and the gradient clipping live in the optimizer's config).
    """

    def __init__(
        self,
        model: list[torch.nn.Module],
        optimizer,
        tokens: SpecialTokens,
        *,
        groups: ParallelGroups | None = None,
        schedule: Callable | None = None,
        bridge=None,
        frozen_prefixes: Sequence[str] = (),
        device: torch.device | str | None = None,
        lr: float,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        micro_batch_max_tokens: int = 8192,
        global_batch_size: int | None = None,
        ppo_epochs: int = 1,
        temperature: float = 1.0,
        suppress_token_ids: Sequence[int] = (),
        clip_low: float = 0.2,
        clip_high: float = 0.28,
        dual_clip_c: float | None = None,
        loss_reduction: LossReduction = "token_mean",
        kl_coef: float = 0.0,
        kl_estimator: str = "low_var_kl",
        entropy_coef: float = 0.0,
        tis_mode: str | None = None,
        tis_cap: float = 2.0,
    ):
        from megatron.core.utils import get_model_config

        self.model = list(model)
        self.optimizer = optimizer
        self.tokens = tokens
        self.groups = groups or ParallelGroups.from_megatron(
            sequence_parallel=bool(get_model_config(self.model[0]).sequence_parallel)
        )
        if schedule is None:
            from megatron.core.pipeline_parallel import get_forward_backward_func

            schedule = get_forward_backward_func()
        self.schedule = schedule
        self.bridge = bridge
        self.frozen_prefixes = tuple(frozen_prefixes)
        self.device = torch.device(device) if device is not None else _default_device()
        self.config = get_model_config(self.model[0])
        self.lr, self.weight_decay, self.warmup_steps = lr, weight_decay, warmup_steps
        self.max_tokens = micro_batch_max_tokens
        self.global_batch_size = global_batch_size
        self.ppo_epochs = ppo_epochs
        self.temperature = temperature if temperature > 0 else 1.0  # greedy rollouts: score the plain softmax
        self.suppress = tuple(suppress_token_ids)
        self.reduction = loss_reduction
        self.loss_kwargs = dict(
            clip_low=clip_low,
            clip_high=clip_high,
            dual_clip_c=dual_clip_c,
            kl_coef=kl_coef,
            kl_estimator=kl_estimator,
            entropy_coef=entropy_coef,
            tis_mode=tis_mode,
            tis_cap=tis_cap,
        )
        self.ref_weights = _snapshot(self.model) if kl_coef > 0 else None  # the initial weights, on the CPU
        self.optimizer_steps = 0
        self.skipped_steps = 0

    # ---------------------------------------------------------------------------------------------------------------
    # micro-batches

    def _micro_batch(self, samples: Sequence[TrainSample], spec) -> MicroBatch:
        g = self.groups
        return pack_micro_batch(
            samples,
            spec,
            tokens=self.tokens,
            spatial_merge_size=self.config.spatial_merge_size,
            cp_size=g.cp_size,
            cp_rank=g.cp_rank,
            tp_size=g.pack_tp_size,
        )

    def _options(self, mode: str, samples: Sequence[TrainSample], token_norm: float = 1.0) -> StepOptions:
        return StepOptions(
            mode=mode,
            groups=self.groups,
            device=self.device,
            samples=samples,
            temperature=self.temperature,
            suppress_token_ids=self.suppress,
            vocab_size=getattr(self.config, "vocab_size", None),
            loss_kwargs=self.loss_kwargs,
            token_norm=token_norm,
            # bf16 logits [T/C, V/TP] stay bf16 (Float16Module would upcast them all); vocab_parallel_logprobs
            # works in fp32 chunks, as the torch backend does with its lm_head output
            model_kwargs={"fp32_output": False} if (self.config.bf16 or self.config.fp16) else {},
        )

    def _run(self, options: StepOptions, micro: list[MicroBatch], *, forward_only: bool) -> list[dict]:
        chunks = len(self.model)  # > 1 with virtual pipeline stages: one iterator per chunk
        reports = self.schedule(
            forward_step_func=partial(forward_step, options),
            data_iterator=iter(micro) if chunks == 1 else [iter(micro) for _ in range(chunks)],
            model=self.model if chunks > 1 else self.model[0],
            num_microbatches=len(micro),
            seq_length=max(mb.num_local_tokens for mb in micro),  # only read without variable_seq_lengths
            micro_batch_size=1,
            forward_only=forward_only,
        )
        return list(reports or [])

    # ---------------------------------------------------------------------------------------------------------------
    # TrainBackend

    def compute_logprobs(self, samples: Sequence[TrainSample]) -> list[Tensor]:
        """Current-policy logprobs `[response_len]` (fp32, CPU) of every sample, on every rank (collective)."""
        if not samples:
            return []
        lengths = [s.input_ids.numel() for s in samples]
        g = self.groups
        plans = plan_data_parallel(lengths, dp_size=g.dp_size, max_tokens=self.max_tokens, cp_size=g.cp_size)
        micro = [self._micro_batch(samples, spec) for spec in plans[g.dp_rank]]
        for chunk in self.model:
            chunk.eval()
        with torch.no_grad():
            reports = self._run(self._options("logprobs", samples), micro, forward_only=True)
        mine: dict[int, Tensor] = {}
        for r in reports:
            mine.update(r["logprobs"])
        shares = split_for_data_parallel(lengths, g.dp_size)  # the split plan_data_parallel made
        return gather_per_sample(mine, shares, [s.response_len for s in samples], g, self.device)

    def train(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """All optimizer steps of one RL step on `samples` (the same list on every rank); returns flat metrics."""
        if not samples:
            raise ValueError("train() got no samples")
        check_loss_masks(samples)
        for i, s in enumerate(samples):
            if s.rollout_logprobs.numel() != s.response_len:
                raise ValueError(
                    f"sample {i}: {s.rollout_logprobs.numel()} rollout logprobs for {s.response_len} response tokens"
                )
        gbs = self.global_batch_size or len(samples)
        if len(samples) % gbs:
            raise ValueError(f"{len(samples)} samples are not a multiple of global_batch_size={gbs}")
        if gbs % self.groups.dp_size:
            raise ValueError(
                f"train.global_batch_size={gbs} is not divisible by the data-parallel size {self.groups.dp_size} "
                "(world / (tp * pp * cp)); every DP rank needs the same number of samples"
            )
        old = self.compute_logprobs(samples)
        ref = None
        if self.ref_weights is not None:
            with self._weights(self.ref_weights):
                ref = self.compute_logprobs(samples)
        parts, grad_norms, n_tokens, skipped_before = [], [], 0, self.skipped_steps
        for _ in range(self.ppo_epochs):
            for start in range(0, len(samples), gbs):
                metrics, grad_norm, tokens = self._optimizer_step(samples, list(range(start, start + gbs)), old, ref)
                parts.append(metrics)
                grad_norms.append(grad_norm)
                n_tokens += tokens
        for chunk in self.model:
            chunk.eval()
        out = {f"train/{k}": v for k, v in combine_metrics(parts).as_dict().items()}
        out["train/grad_norm"] = sum(grad_norms) / len(grad_norms)
        out["train/lr"] = self._lr()
        out["train/optimizer_steps"] = float(len(parts))
        out["train/skipped_nonfinite_steps"] = float(self.skipped_steps - skipped_before)
        out["train/tokens"] = float(n_tokens)
        return out

    def accumulate_gradients(
        self,
        samples: Sequence[TrainSample],
        idx: Sequence[int],
        old: Sequence[Tensor],
        ref: Sequence[Tensor] | None = None,
    ) -> tuple[PolicyLossMetrics, int]:
        """Forward/backward of the mini-batch `idx` into the gradient buffers (reduced over DP x CP and scaled by
        megatron's finalize step). Returns (metrics reduced over all ranks, full-row tokens over all DP ranks)."""
        g = self.groups
        lengths = [samples[i].input_ids.numel() for i in idx]
        plans = plan_data_parallel(lengths, dp_size=g.dp_size, max_tokens=self.max_tokens, cp_size=g.cp_size)
        denominators = loss_denominators(torch.tensor([sample_loss_tokens(samples[i]) for i in idx]))
        micro = []
        for spec in plans[g.dp_rank]:
            spec = type(spec)([idx[j] for j in spec.samples], spec.dummy)  # positions in idx -> sample indices
            mb = self._micro_batch(samples, spec)
            micro.append(attach_loss_inputs(mb, samples, old, ref, denominators, reduction=self.reduction))
        (token_norm,) = all_reduce_sum([sum(mb.packed.num_tokens for mb in micro)], g.dp, self.device)
        for chunk in self.model:
            chunk.train()
        reports = self._run(self._options("train", samples, token_norm), micro, forward_only=False)
        check_token_norm(sum(r["num_tokens"] for r in reports), token_norm, g, self.device)
        local = combine_metrics([r["metrics"] for r in reports]) if reports else None
        return reduce_metrics(local, g, self.device, template=_metrics_template(self.loss_kwargs)), int(token_norm)

    def _optimizer_step(self, samples, idx, old, ref) -> tuple[PolicyLossMetrics, float, int]:
        """Accumulate the loss of the mini-batch `idx`, then clip and step (skipped on a non-finite norm)."""
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        metrics, tokens = self.accumulate_gradients(samples, idx, old, ref)
        # megatron's optimizer.step() clips and steps even on a NaN norm (the NaN reaches the weights), so the norm
        # is checked first; step() then repeats the (idempotent) gradient preparation, clips to its clip_grad, steps
        found_inf = self.optimizer.prepare_grads()
        grad_norm = math.nan if found_inf else float(self.optimizer.get_grad_norm())
        stepped = False
        if math.isfinite(grad_norm):
            self._set_lr()
            stepped, _, _ = self.optimizer.step()
        if stepped:
            self.optimizer_steps += 1
        else:
            self.skipped_steps += 1
            log.warning("non-finite loss or gradient norm (%s): optimizer step skipped", grad_norm)
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        return metrics, grad_norm, tokens

    def set_lr(self, lr: float) -> None:
        """Set the peak learning rate (the LR warm-up factor still applies); the optimizer state is kept."""
        self.lr = lr
        self._set_lr()

    def _lr(self) -> float:
        """Linear warmup over `warmup_steps` optimizer steps, then constant (as the torch backend)."""
        if not self.warmup_steps:
            return self.lr
        return self.lr * min(1.0, (self.optimizer_steps + 1) / self.warmup_steps)

    def _set_lr(self) -> None:
        lr = self._lr()
        for group in self.optimizer.param_groups:
            value = lr * group.get("lr_mult", 1.0)
            if isinstance(group.get("lr"), Tensor):
                group["lr"].fill_(value)
            else:
                group["lr"] = value
            group["weight_decay"] = self.weight_decay * group.get("wd_mult", 1.0)

    @contextmanager
    def _weights(self, weights: dict[str, Tensor]):
        """Temporarily load `weights` (a `_snapshot`) into the model chunks."""
        current = _snapshot(self.model)
        _restore(self.model, weights)
        try:
            yield
        finally:
            _restore(self.model, current)

    def export_weights(self) -> Iterable[tuple[str, Tensor]]:
        """Trainable weights as (HF name, full CPU tensor) pairs, vision tower included unless frozen. Collective:
        every rank of the model must consume the iterator."""
        if self.bridge is None:
            raise ValueError("export_weights needs the AutoBridge the model was built from; pass bridge=...")
        return export_hf_weights(self.bridge, self.model, skip_prefixes=self.frozen_prefixes, cpu=True)

    def save_checkpoint(self, directory: Path) -> None:
        state = {"optimizer_steps": self.optimizer_steps, "skipped_steps": self.skipped_steps}
        ckpt.save_checkpoint(Path(directory), self.model, self.optimizer, state, dp_cp_group=self.groups.dp_cp)

    def load_checkpoint(self, directory: Path) -> None:
        state = ckpt.load_checkpoint(Path(directory), self.model, self.optimizer, dp_cp_group=self.groups.dp_cp)
        self.optimizer_steps, self.skipped_steps = state["optimizer_steps"], state["skipped_steps"]


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _metrics_template(loss_kwargs: dict) -> PolicyLossMetrics:
    """A metrics record with the fields these loss options produce (for ranks that compute no loss: PP stages)."""
    empty = torch.zeros(0)
    kw = dict(loss_kwargs)
    return policy_loss(
        empty,
        empty,
        empty,
        empty,
        ref_logprobs=empty if kw["kl_coef"] > 0 else None,
        entropy=empty if kw["entropy_coef"] > 0 else None,
        rollout_logprobs=empty,
        **kw,
    ).metrics


def _snapshot(model: list[torch.nn.Module]) -> dict[str, Tensor]:
    """CPU copies of every local parameter of the chunks (this rank's shards)."""
    return {
        f"{i}.{name}": p.detach().to("cpu", copy=True)
        for i, chunk in enumerate(model)
        for name, p in chunk.named_parameters()
    }


@torch.no_grad()
def _restore(model: list[torch.nn.Module], weights: dict[str, Tensor]) -> None:
    for i, chunk in enumerate(model):
        for name, p in chunk.named_parameters():
            p.copy_(weights[f"{i}.{name}"])
