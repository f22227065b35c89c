"""The embedded train backend: a transformers Qwen3-VL trained on packed THD rows (CPU fp32 or one GPU bf16).

One RL step (`train`):
1. old logprobs of every response token under the current weights (no gradient); their distance to the rollout
   engine's logprobs is `train_rollout_logprob_abs_diff` (~0 in fp32 on CPU; ~0.01 is healthy in bf16);
2. reference logprobs when `kl_coef > 0` (a frozen copy of the initial weights);
3. for each PPO epoch and each mini-batch of `global_batch_size` samples: micro-batches planned under the token
   budget, packed (`pack_thd`, per-segment positions, block-diagonal attention), the policy loss with global
   denominators (each micro-batch's loss is its exact share, so gradients accumulate to the full mini-batch
   gradient), gradient clipping, one AdamW step. A non-finite loss or gradient skips that optimizer step and is
   counted.

Per-token tensors are taken at label positions: logits at row position j score the token at j + 1.
"""

from __future__ import annotations

import copy
import logging
import math
import pickle
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model
from torch import Tensor
from transformers import Qwen3VLForConditionalGeneration

from miles_vl.algo import (
    LossReduction,
    PolicyLossMetrics,
    combine_metrics,
    loss_denominators,
    loss_token_weights,
    policy_loss,
    sequence_loss_tokens,
)
from miles_vl.model import SpecialTokens
from miles_vl.packing import PackedBatch, pack_thd, plan_micro_batches
from miles_vl.train.packed_forward import label_logprobs
from miles_vl.train.types import TrainSample

log = logging.getLogger(__name__)


class TorchTrainBackend:
    """Implements `TrainBackend` on one device. All knobs are plain arguments (the orchestration builds it)."""

    def __init__(
        self,
        model: Qwen3VLForConditionalGeneration,
        tokens: SpecialTokens,
        *,
        lr: float,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        grad_clip: float = 1.0,
        warmup_steps: int = 0,
        micro_batch_max_tokens: int = 8192,
        global_batch_size: int | None = None,
        ppo_epochs: int = 1,
        freeze_vision: bool = False,
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
        self.model = model
        self.tokens = tokens
        self.device = next(model.parameters()).device
        if freeze_vision:
            for p in model.model.visual.parameters():
                p.requires_grad_(False)
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0
        )
        self.grad_clip = grad_clip
        self.max_tokens = micro_batch_max_tokens
        self.global_batch_size = global_batch_size
        self.ppo_epochs = ppo_epochs
        self.temperature = temperature if temperature > 0 else 1.0  # greedy rollouts: score the plain softmax
        self.suppress = tuple(suppress_token_ids)  # tokens the engine bans: scored out of the same distribution
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
        self.reduction = loss_reduction
        self.ref_model = None
        if kl_coef > 0:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        self.optimizer_steps = 0
        self.skipped_steps = 0

    # ---------------------------------------------------------------------------------------------------------------
    # packing

    def _pack(self, samples: Sequence[TrainSample]) -> tuple[PackedBatch, Tensor | None, Tensor | None]:
        t = self.tokens
        for i, s in enumerate(samples):
            if s.loss_mask is not None and bool(s.loss_mask[: s.prompt_len].any()):
                raise ValueError(f"sample {i}: loss_mask marks prompt tokens; only response tokens can carry loss")
        packed = pack_thd(
            samples,
            cp_size=1,
            pad_token_id=t.pad_token_id,
            spatial_merge_size=self.model.config.vision_config.spatial_merge_size,
            image_token_id=t.image_token_id,
            video_token_id=t.video_token_id,
            vision_start_token_id=t.vision_start_token_id,
        )
        return packed, _cat([s.pixel_values for s in samples]), _cat([s.pixel_values_videos for s in samples])

    def _micro_batches(self, samples: Sequence[TrainSample]) -> list[list[int]]:
        return plan_micro_batches([s.input_ids.numel() for s in samples], self.max_tokens).micro_batches

    @staticmethod
    def _label_positions(packed: PackedBatch) -> tuple[Tensor, Tensor, Tensor]:
        """Row positions whose label carries loss, their sample, and the label's index in the sample's response."""
        pos = packed.label_mask.nonzero().squeeze(1)
        sample = packed.sample_index[pos]
        resp_idx = pos + 1 - packed.cu_seqlens[:-1].long()[sample] - packed.prompt_lens[sample]
        return pos, sample, resp_idx

    # ---------------------------------------------------------------------------------------------------------------
    # TrainBackend

    @torch.no_grad()
    def compute_logprobs(self, samples: Sequence[TrainSample], model=None) -> list[Tensor]:
        model = model or self.model
        out: list[Tensor | None] = [None] * len(samples)
        for mb in self._micro_batches(samples):
            packed, pv, pvv = self._pack([samples[i] for i in mb])
            logp, _ = label_logprobs(
                model, packed, pv, pvv, temperature=self.temperature, suppress_token_ids=self.suppress
            )
            logp = logp.float().cpu()
            for j, i in enumerate(mb):
                start = int(packed.cu_seqlens[j]) + samples[i].prompt_len - 1  # logits before the first response token
                out[i] = logp[start : start + samples[i].response_len].clone()
        return out  # type: ignore[return-value]

    def train(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """All optimizer steps of one RL step on `samples`; returns flat metrics (means over response tokens)."""
        if not samples:
            raise ValueError("train() got no samples")
        for i, s in enumerate(samples):
            if s.rollout_logprobs.numel() != s.response_len:
                raise ValueError(
                    f"sample {i}: {s.rollout_logprobs.numel()} rollout logprobs for {s.response_len} response tokens"
                )
        self.model.train()
        old = self.compute_logprobs(samples)
        ref = self.compute_logprobs(samples, self.ref_model) if self.ref_model is not None else None
        gbs = self.global_batch_size or len(samples)
        if len(samples) % gbs:
            raise ValueError(f"{len(samples)} samples are not a multiple of global_batch_size={gbs}")
        parts, grad_norms, n_tokens, skipped_before = [], [], 0, self.skipped_steps
        for _ in range(self.ppo_epochs):
            for start in range(0, len(samples), gbs):
                idx = list(range(start, start + gbs))
                metrics, grad_norm, tokens = self._optimizer_step(samples, idx, old, ref)
                parts.append(metrics)
                grad_norms.append(grad_norm)
                n_tokens += tokens
        self.model.eval()
        out = {f"train/{k}": v for k, v in combine_metrics(parts).as_dict().items()}
        out["train/grad_norm"] = sum(grad_norms) / len(grad_norms)
        out["train/lr"] = self.scheduler.get_last_lr()[0]
        out["train/optimizer_steps"] = float(len(parts))
        out["train/skipped_nonfinite_steps"] = float(self.skipped_steps - skipped_before)
        out["train/tokens"] = float(n_tokens)
        return out

    def set_lr(self, lr: float) -> None:
        """Set the peak learning rate (the LR warm-up factor still applies); the optimizer state is kept."""
        self.scheduler.base_lrs = [lr] * len(self.optimizer.param_groups)
        factor = self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * factor

    def _optimizer_step(self, samples, idx, old, ref):
        """Accumulate the loss of the mini-batch `idx` over its micro-batches, then clip and step."""
        self.optimizer.zero_grad(set_to_none=True)
        metrics, finite, tokens = self.accumulate_gradients(samples, idx, old, ref)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.trainable, self.grad_clip)) if finite else math.nan
        if finite and math.isfinite(grad_norm):
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer_steps += 1
        else:
            self.skipped_steps += 1
            log.warning("non-finite loss or gradient norm (%s): optimizer step skipped", grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        return metrics, grad_norm, tokens

    def accumulate_gradients(
        self,
        samples: Sequence[TrainSample],
        idx: Sequence[int],
        old: Sequence[Tensor],
        ref: Sequence[Tensor] | None = None,
    ) -> tuple[PolicyLossMetrics, bool, int]:
        """Backward the policy loss of samples `idx` (one mini-batch) micro-batch by micro-batch into `.grad`.

        The loss weights use the mini-batch's global denominators, so the accumulated gradient is the gradient of
        the mini-batch loss however the samples are split. Returns (metrics, all losses finite, tokens processed).
        """
        micro = [[idx[j] for j in mb] for mb in self._micro_batches([samples[i] for i in idx])]
        packs = [self._pack([samples[i] for i in mb]) for mb in micro]
        counts = [sequence_loss_tokens(p.label_mask, p.sample_index, p.num_samples) for p, _, _ in packs]
        denominators = loss_denominators(torch.cat(counts))
        rollout = [s.rollout_logprobs for s in samples]
        parts, finite, tokens = [], True, 0
        for mb, (packed, pv, pvv), count in zip(micro, packs, counts, strict=True):
            pos, sample, resp_idx = self._label_positions(packed)
            logp, entropy = label_logprobs(
                self.model,
                packed,
                pv,
                pvv,
                temperature=self.temperature,
                suppress_token_ids=self.suppress,
                with_entropy=self.loss_kwargs["entropy_coef"] > 0,
            )
            at = (mb, sample, resp_idx)  # where each label position reads per-sample response arrays
            weights = loss_token_weights(packed.label_mask[pos], sample, count, denominators, reduction=self.reduction)
            advantages = torch.tensor([samples[i].advantage for i in mb], dtype=torch.float32)[sample]
            out = policy_loss(
                logp[pos],
                _at_labels(old, *at).to(self.device),
                advantages.to(self.device),
                weights.to(self.device),
                ref_logprobs=_at_labels(ref, *at).to(self.device) if ref is not None else None,
                entropy=entropy[pos] if entropy is not None else None,
                rollout_logprobs=_at_labels(rollout, *at).to(self.device),
                **self.loss_kwargs,
            )
            finite = finite and bool(torch.isfinite(out.loss))
            if finite:
                out.loss.backward()
            parts.append(out.metrics)
            tokens += packed.num_tokens
        return combine_metrics(parts), finite, tokens

    def export_weights(self) -> Iterable[tuple[str, Tensor]]:
        """Trainable tensors with their HF names (frozen ones are not sent: the engine already has them)."""
        trainable = {name for name, p in self.model.named_parameters() if p.requires_grad}
        return [(name, t.detach().cpu()) for name, t in self.model.state_dict().items() if name in trainable]

    def save_checkpoint(self, directory: Path) -> None:
        directory = Path(directory)
        save_model(self.model, str(directory / "model.safetensors"))
        torch.save(
            {
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "optimizer_steps": self.optimizer_steps,
                "skipped_steps": self.skipped_steps,
                "rng_cpu": torch.get_rng_state(),
                "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            },
            directory / "trainer_state.pt",
        )
        if self.ref_model is not None:
            save_model(self.ref_model, str(directory / "ref_model.safetensors"))

    def load_checkpoint(self, directory: Path) -> None:
        """Restore what `save_checkpoint` wrote.

        Raises:
            ValueError: trainer_state.pt holds anything but tensors and plain containers (a crafted pickle would run
                code on load: it is refused, never executed).
        """
        directory = Path(directory)
        load_model(self.model, str(directory / "model.safetensors"), device=str(self.device))
        file = directory / "trainer_state.pt"
        try:
            state = torch.load(file, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            raise ValueError(
                f"{file}: refused to load: it holds objects other than tensors and plain containers, which only a "
                f"crafted or foreign file does ({str(err).splitlines()[0]}); resume from a checkpoint miles-vl wrote"
            ) from None
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.optimizer_steps, self.skipped_steps = state["optimizer_steps"], state["skipped_steps"]
        torch.set_rng_state(state["rng_cpu"])
        if state["rng_cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng_cuda"])
        if self.ref_model is not None:
            load_model(self.ref_model, str(directory / "ref_model.safetensors"), device=str(self.device))


def _at_labels(per_sample: Sequence[Tensor], mb: Sequence[int], sample: Tensor, resp_idx: Tensor) -> Tensor:
    """Per-sample response arrays (`[response_len]` each) read at the label positions of a micro-batch."""
    flat = torch.cat([per_sample[i].detach().float().cpu() for i in mb])
    lens = torch.tensor([per_sample[i].numel() for i in mb])
    return flat[(torch.cumsum(lens, 0) - lens)[sample] + resp_idx]


def _cat(parts: list[Tensor | None]) -> Tensor | None:
    present = [p for p in parts if p is not None and p.numel()]
    return torch.cat(present) if present else None
