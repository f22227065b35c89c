"""The embedded train backend: a transformers Qwen3-VL trained on packed THD rows (CPU fp32 or one GPU bf16).

    backend = TorchTrainBackend(model, tokens, TrainOptions(OptimizerOptions(lr=1e-6)))
    metrics = train_step(backend, samples)                      # step.py: the RL step over any backend

Implements `TrainBackend`: micro-batches planned under the token budget and packed (`pack_thd`, per-segment positions,
block-diagonal attention), label logprobs under the engine's sampling distribution (models/qwen3_vl/forward.py), the
policy loss with global denominators, AdamW with gradient clipping. The reference policy for the KL term is a frozen
copy of the initial weights. Per-token tensors are taken at label positions: logits at row position j score the token at
j + 1.
"""

from __future__ import annotations

import copy
import math
import pickle
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model
from torch import Tensor
from transformers import Qwen3VLForConditionalGeneration

from miles_vl.algo import (
    combine_metrics,
    loss_denominators,
    loss_token_weights,
    policy_loss,
    sequence_loss_tokens,
    sequence_mean_log_ratio,
)
from miles_vl.models import SpecialTokens
from miles_vl.models.qwen3_vl.forward import label_logprobs
from miles_vl.packing import PackedBatch, cat_present, pack_thd, plan_micro_batches
from miles_vl.train.hf_files import DEFAULT_MAX_SHARD_BYTES, write_hf_model
from miles_vl.train.types import (
    Accumulated,
    MiniBatch,
    TrainOptions,
    TrainSample,
    at_labels,
    check_loss_masks,
    response_logprobs,
)


class TorchTrainBackend:
    """Implements `TrainBackend` on one device (the orchestration builds it from the config)."""

    dp_size = 1

    def __init__(self, model: Qwen3VLForConditionalGeneration, tokens: SpecialTokens, options: TrainOptions):
        self.model = model
        self.tokens = tokens
        if options.optimizer.cpu_offload:  # the config refuses it first (schema.py); this guards direct callers
            raise ValueError(
                f"optimizer.cpu_offload={options.optimizer.cpu_offload}: the torch backend keeps its AdamW state on "
                "the model's device; use 0 here, or the megatron backend to offload"
            )
        self.options = options
        self.device = next(model.parameters()).device
        if options.freeze_vision:
            for p in model.model.visual.parameters():
                p.requires_grad_(False)
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        o = options.optimizer
        self.optimizer = torch.optim.AdamW(
            self.trainable, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / o.warmup_steps) if o.warmup_steps else 1.0
        )
        self.loss = options.loss
        self.ref_model = None
        if self.loss.kl_coef > 0:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        self.optimizer_steps = 0
        self.skipped_steps = 0

    # ---------------------------------------------------------------------------------------------------------------
    # packing

    def _pack(self, samples: Sequence[TrainSample]) -> tuple[PackedBatch, Tensor | None, Tensor | None]:
        t = self.tokens
        check_loss_masks(samples)
        packed = pack_thd(
            samples,
            cp_size=1,
            pad_token_id=t.pad_token_id,
            spatial_merge_size=self.model.config.vision_config.spatial_merge_size,
            image_token_id=t.image_token_id,
            video_token_id=t.video_token_id,
            vision_start_token_id=t.vision_start_token_id,
        )
        pixels = cat_present([s.pixel_values for s in samples])
        return packed, pixels, cat_present([s.pixel_values_videos for s in samples])

    def _micro_batches(self, samples: Sequence[TrainSample]) -> list[list[int]]:
        lengths = [s.input_ids.numel() for s in samples]
        return plan_micro_batches(lengths, self.options.micro_batch_max_tokens).micro_batches

    @staticmethod
    def _label_positions(packed: PackedBatch) -> tuple[Tensor, Tensor, Tensor]:
        """Row positions whose label carries loss, their sample, and the label's index in the sample's response."""
        pos = packed.label_mask.nonzero().squeeze(1)
        sample = packed.sample_index[pos]
        resp_idx = pos + 1 - packed.cu_seqlens[:-1].long()[sample] - packed.prompt_lens[sample]
        return pos, sample, resp_idx

    def _label_logprobs(
        self,
        model: Qwen3VLForConditionalGeneration,
        packed: PackedBatch,
        pixel_values: Tensor | None,
        pixel_values_videos: Tensor | None,
        *,
        with_entropy: bool = False,
        positions: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """`label_logprobs` of `model` over one packed row under the loss's scoring distribution (temperature,
        suppressed tokens) and this backend's vision mode: the old, reference and current policy are scored alike."""
        return label_logprobs(
            model,
            packed,
            pixel_values,
            pixel_values_videos,
            temperature=self.loss.score_temperature,
            suppress_token_ids=self.loss.suppress_token_ids,
            vision_once_per_image=self.options.vision_once_per_image,
            with_entropy=with_entropy,
            positions=positions,
        )

    # ---------------------------------------------------------------------------------------------------------------
    # TrainBackend

    @torch.no_grad()
    def compute_logprobs(self, samples: Sequence[TrainSample], model=None) -> list[Tensor]:
        model = model or self.model
        out: list[Tensor | None] = [None] * len(samples)
        for mb in self._micro_batches(samples):
            packed, pv, pvv = self._pack([samples[i] for i in mb])
            logp, _ = self._label_logprobs(model, packed, pv, pvv)
            for i, lp in zip(mb, response_logprobs(logp, packed.cu_seqlens, [samples[i] for i in mb]), strict=True):
                out[i] = lp
        return out  # type: ignore[return-value]

    def compute_ref_logprobs(self, samples: Sequence[TrainSample]) -> list[Tensor]:
        return self.compute_logprobs(samples, self.ref_model)

    def accumulate_gradients(self, batch: MiniBatch) -> Accumulated:
        """`TrainBackend.accumulate_gradients` into `.grad`; a non-finite loss is not back-propagated, nor is any
        loss after it. `old` None: this forward's detached logprobs are the old ones."""
        samples, idx, old, ref = batch
        self.optimizer.zero_grad(set_to_none=True)
        self.model.train()
        micro = [[idx[j] for j in mb] for mb in self._micro_batches([samples[i] for i in idx])]
        packs = [self._pack([samples[i] for i in mb]) for mb in micro]
        counts = [sequence_loss_tokens(p.label_mask, p.sample_index, p.num_samples) for p, _, _ in packs]
        denominators = loss_denominators(torch.cat(counts))
        rollout = [s.rollout_logprobs for s in samples]
        parts, finite, tokens = [], True, 0
        for mb, (packed, pv, pvv), count in zip(micro, packs, counts, strict=True):
            pos, sample, resp_idx = self._label_positions(packed)
            only_loss = self.options.logits_only_where_loss  # logits at the loss positions only: [n], not [T]
            logp, entropy = self._label_logprobs(
                self.model,
                packed,
                pv,
                pvv,
                with_entropy=self.loss.entropy_coef > 0,
                positions=pos if only_loss else None,
            )
            if not only_loss:
                logp, entropy = logp[pos], entropy[pos] if entropy is not None else None
            at = (mb, sample, resp_idx)  # where each label position reads per-sample response arrays
            weights = loss_token_weights(
                packed.label_mask[pos],
                sample,
                count,
                denominators,
                reduction=self.loss.reduction,
                max_response_len=self.loss.max_response_len,
            )
            advantages = torch.tensor([samples[i].advantage for i in mb], dtype=torch.float32)[sample]
            # the same fp32 values a separate `compute_logprobs` pass returns (same weights, same packed row)
            old_at = logp.detach() if old is None else at_labels(old, *at).to(self.device)
            seq_log_ratio = None
            if self.loss.policy_loss_type == "gspo":  # a sample lies whole in one micro-batch row: no reduction
                seq_log_ratio = sequence_mean_log_ratio(logp, old_at, sample, count, weights.to(self.device))
            out = policy_loss(
                logp,
                old_at,
                advantages.to(self.device),
                weights.to(self.device),
                ref_logprobs=at_labels(ref, *at).to(self.device) if ref is not None else None,
                entropy=entropy,
                rollout_logprobs=at_labels(rollout, *at).to(self.device),
                seq_log_ratio=seq_log_ratio,
                **self.loss.policy_loss_kwargs(),
            )
            finite = finite and bool(torch.isfinite(out.loss))
            if finite:
                out.loss.backward()
            parts.append(out.metrics)
            tokens += packed.num_tokens
        return Accumulated(combine_metrics(parts), tokens, finite, len(micro))

    def optimizer_step(self, finite: bool) -> tuple[float, bool]:
        grad_norm = math.nan
        if finite:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.trainable, self.options.optimizer.grad_clip))
        stepped = finite and math.isfinite(grad_norm)
        if stepped:
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer_steps += 1
        else:
            self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, stepped

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def set_lr(self, lr: float) -> None:
        """Set the peak learning rate from now on (the LR warm-up factor still applies); the optimizer state is kept.
        `options` gets a copy with the new `optimizer.lr` (the options object passed in is not changed)."""
        self.options = replace(self.options, optimizer=replace(self.options.optimizer, lr=lr))
        self.scheduler.base_lrs = [lr] * len(self.optimizer.param_groups)
        factor = self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * factor
        self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]  # what lr() reads

    def set_vision_trainable(self, trainable: bool) -> None:
        """Train the vision tower (`model.visual`: tower, merger, deepstack mergers) from the next step on, or not:
        frozen, it gets no gradient, so its weights and optimizer state stay as they are. A no-op under
        `freeze_vision`, which keeps it frozen for the whole run. The format warm-up freezes it (warmup.py)."""
        if self.options.freeze_vision:
            return
        for p in self.model.model.visual.parameters():
            p.requires_grad_(trainable)

    def export_weights(self, on_device: bool = False) -> Iterable[tuple[str, Tensor]]:
        """Trainable tensors with their HF names (frozen ones are not sent: the engine already has them); CPU copies
        unless `on_device`."""
        trainable = {name for name, p in self.model.named_parameters() if p.requires_grad}
        return [
            (name, t.detach() if on_device else t.detach().cpu())
            for name, t in self.model.state_dict().items()
            if name in trainable
        ]

    def save_hf(self, directory: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
        """The whole model (frozen parts too) as an HF model directory: config.json and safetensors (hf_files.py).
        Tied tensors (one storage under two names) are written once, under the first name, as `save_pretrained`
        does."""
        config = copy.deepcopy(self.model.config)
        config.architectures = [type(self.model).__name__]
        seen: set[int] = set()
        weights = []
        for name, t in self.model.state_dict().items():
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                weights.append((name, t))
        write_hf_model(directory, config, weights, max_shard_bytes=max_shard_bytes)

    def save_checkpoint(self, directory: Path, optimizer_state: bool = True) -> None:
        self.checkpoint_snapshot(optimizer_state)(Path(directory))

    def checkpoint_snapshot(self, optimizer_state: bool = True) -> Callable[[Path], None]:
        """The state `save_checkpoint` writes, copied now (weights, optimizer and scheduler state, counters, RNG), and
        the function that writes it into a directory: the write may run in another thread while training goes on,
        and what it writes is still this moment's state. Tensors that share storage (tied weights) still share it in
        the copy, so the file is the one `save_model` writes. `optimizer_state=False`: AdamW's state (its moments, as
        large as the weights twice) is left out of trainer_state.pt (checkpoint.optimizer_state)."""
        model = _copy_tensors(self.model.state_dict())
        ref = _copy_tensors(self.ref_model.state_dict()) if self.ref_model is not None else None
        state = _copy_tensors(
            {
                **({"optimizer": self.optimizer.state_dict()} if optimizer_state else {}),
                "scheduler": self.scheduler.state_dict(),
                "optimizer_steps": self.optimizer_steps,
                "skipped_steps": self.skipped_steps,
                "rng_cpu": torch.get_rng_state(),
                "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            }
        )

        def write(directory: Path) -> None:
            directory = Path(directory)
            save_model(_Tensors(model), str(directory / "model.safetensors"))
            torch.save(state, directory / "trainer_state.pt")
            if ref is not None:
                save_model(_Tensors(ref), str(directory / "ref_model.safetensors"))

        return write

    def load_checkpoint(self, directory: Path) -> None:
        """Restore what `save_checkpoint` wrote. A checkpoint without the optimizer's state (checkpoint.optimizer_state
        =false) leaves the optimizer as built, its moments zero until the next step, and stepping the loaded weights;
        the learning rate still follows the restored schedule.

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
        self.scheduler.load_state_dict(state["scheduler"])
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        else:  # the param groups' learning rate is the built one (the schedule's first): set the restored schedule's
            for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr(), strict=True):
                group["lr"] = lr
        self.optimizer_steps, self.skipped_steps = state["optimizer_steps"], state["skipped_steps"]
        torch.set_rng_state(state["rng_cpu"])
        if state["rng_cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng_cuda"])
        if self.ref_model is not None:
            load_model(self.ref_model, str(directory / "ref_model.safetensors"), device=str(self.device))


def _copy_tensors(obj: Any, storages: dict | None = None) -> Any:
    """`obj` (tensors in dicts, lists and tuples) with every tensor copied into host memory that nothing else holds,
    views of one storage still views of one copy (tied weights stay tied); other values deep-copied."""
    storages = {} if storages is None else storages
    if isinstance(obj, Tensor):
        t = obj.detach()
        storage = t.untyped_storage()
        key = (storage.device, storage.data_ptr())
        if key not in storages:
            storages[key] = storage.clone() if storage.device.type == "cpu" else storage.cpu()
        return torch.empty(0, dtype=t.dtype).set_(storages[key], t.storage_offset(), t.size(), t.stride())
    if isinstance(obj, dict):
        return {k: _copy_tensors(v, storages) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_copy_tensors(v, storages) for v in obj)
    return copy.deepcopy(obj)


class _Tensors:
    """A state dict where `safetensors.torch.save_model` wants a module (it drops tied duplicates as for the model)."""

    def __init__(self, tensors: dict[str, Tensor]):
        self.tensors = tensors

    def state_dict(self) -> dict[str, Tensor]:
        return dict(self.tensors)
