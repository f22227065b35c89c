"""The production train backend: megatron-bridge's Qwen3-VL under TP/PP/CP/EP, trained on pre-sharded THD rows.

    parallel = ParallelOptions(tp_size=2, cp_size=2)
    backend = build_megatron_backend(hf_path, tokens, options, parallel)   # build.py (GPUs, NCCL)
    metrics = train_step(backend, samples)    # miles_vl/train/step.py; every rank calls with the SAME samples

The RL step (miles_vl/train/step.py) is the same as the torch backend's; this backend spreads its parts over the
process grid: old and reference logprobs (`compute_logprobs`, `compute_ref_logprobs`: the initial weights, swapped
in for that pass) are gathered to every rank; for a mini-batch (`accumulate_gradients`) the samples are split over
DP ranks (equal counts, balanced tokens), each rank's share is cut into micro-batches under the token budget,
packed as THD rows and zigzag-sharded over CP (`batch.py`); megatron's schedule runs forward/backward per
micro-batch (`step.py`) with the loss of each rank's local label positions weighted by the mini-batch's global
denominators, so gradients summed over CP, DP and micro-batches are those of the mini-batch loss (the scaling is
derived in step.py); `optimizer_step` clips and steps, skipping a non-finite gradient norm. A mini-batch whose train
logits on some rank would have 2^31 elements or more (`step.MAX_TRAIN_LOGITS_ELEMENTS`: past it the backward fails with
`CUDA error: invalid argument`) is refused on every rank before its first forward.

The same per-sample loss as the torch backend: logits at a row position score the next token, divided by the
temperature, with the engine's suppressed tokens removed (`vocab_parallel.py`), and `miles_vl.algo.policy_loss`
on those logprobs.

What needs CUDA (AutoBridge loading, DDP, the distributed optimizer, megatron's schedule) comes in through the
constructor: `build.py` builds the real parts; CPU tests pass plain modules, a torch optimizer with megatron's
optimizer methods and `step.sequential_forward_backward`, and run this same code.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

import miles_vl.patches
from miles_vl.algo import PolicyLossMetrics, combine_metrics, loss_denominators, policy_loss
from miles_vl.models import SpecialTokens
from miles_vl.models.qwen3_vl import MEGATRON_VISION_PREFIXES
from miles_vl.models.qwen3_vl.vision_once import distinct_images
from miles_vl.train.hf_files import DEFAULT_MAX_SHARD_BYTES, write_hf_model
from miles_vl.train.megatron import checkpoint as ckpt
from miles_vl.train.megatron.batch import (
    MicroBatch,
    attach_loss_inputs,
    pack_micro_batch,
    sample_loss_rows,
    sample_loss_tokens,
)
from miles_vl.train.megatron.export import ExportPlan
from miles_vl.train.megatron.parallel import ParallelGroups, all_reduce_sum, gather_per_sample, reduce_metrics
from miles_vl.train.megatron.plan import forward_only_max_tokens, plan_data_parallel, split_for_data_parallel
from miles_vl.train.megatron.step import (
    ForwardOptions,
    check_token_norm,
    forward_step,
    max_train_logits_rows,
    train_logits_problem,
)
from miles_vl.train.types import Accumulated, LossOptions, MiniBatch, TrainOptions, TrainSample

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
        options: optimizer, loss and batching (betas, eps and the gradient clipping live in the optimizer's config).
        groups: process groups (default: megatron's parallel state).
        schedule: megatron's forward_backward function (default `get_forward_backward_func()`).
        bridge: the AutoBridge the model came from (needed by `export_weights`).
        frozen_prefixes: megatron parameter names that are frozen (not exported), e.g. ("vision_model.",).
        device: where micro-batches and collectives go (default: the current CUDA device, else CPU).
    """

    def __init__(
        self,
        model: list[torch.nn.Module],
        optimizer,
        tokens: SpecialTokens,
        options: TrainOptions,
        *,
        groups: ParallelGroups | None = None,
        schedule: Callable | None = None,
        bridge=None,
        frozen_prefixes: Sequence[str] = (),
        device: torch.device | str | None = None,
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
        self._export_plans: dict[tuple[str, ...], ExportPlan] = {}  # export_plan: per skipped-prefix set
        self.vision_trainable = True  # set_vision_trainable
        self.device = torch.device(device) if device is not None else _default_device()
        self.config = get_model_config(self.model[0])
        self.options = options
        self.loss = options.loss
        if options.logits_only_where_loss and self.groups.sequence_parallel:
            # the output layer's input is then one TP rank's part of the row: the positions are not its rows
            raise ValueError(
                "train.logits_only_where_loss is not supported with sequence parallelism (train.sp, or the MoE "
                "provider's sp under tp > 1); set train.logits_only_where_loss=false or train.sp=false"
            )
        dropout = {k: getattr(self.config, k, 0.0) for k in ("hidden_dropout", "attention_dropout")}
        if options.old_logprobs_from_train_forward and any(dropout.values()):
            # the train forward would score a dropout-perturbed policy, not the one the rollout sampled from
            raise ValueError(
                f"train.old_logprobs_from_train_forward needs a model without dropout, found {dropout}; "
                "set train.old_logprobs_from_train_forward=false"
            )
        self.dp_size = self.groups.dp_size
        if options.vision_once_per_image:
            run_vision_once_per_image(self.model)
        self.ref_weights = _snapshot(self.model) if self.loss.kl_coef > 0 else None  # the initial weights, on the CPU
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

    def _options(self, mode: str, samples: Sequence[TrainSample], token_norm: float = 1.0) -> ForwardOptions:
        return ForwardOptions(
            mode=mode,
            groups=self.groups,
            device=self.device,
            loss=self.loss,
            samples=samples,
            vocab_size=getattr(self.config, "vocab_size", None),
            token_norm=token_norm,
            logits_only_where_loss=self.options.logits_only_where_loss,
            pinned_input_copies=self.options.pinned_input_copies,
            # bf16 logits [T/C, V/TP] stay bf16 (Float16Module would upcast them all); vocab_parallel_logprobs
            # works in fp32 chunks, as the torch backend does with its lm_head output
            model_kwargs={"fp32_output": False} if (self.config.bf16 or self.config.fp16) else {},
        )

    def _run(self, options: ForwardOptions, micro: list[MicroBatch], *, forward_only: bool) -> list[dict]:
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
        max_tokens = self.options.micro_batch_max_tokens
        if self.options.logits_only_where_loss:  # this pass's logits cover every position (`forward_only_max_tokens`)
            max_rows = max_train_logits_rows(self.config.vocab_size, g.tp_size)
            max_tokens = forward_only_max_tokens(max_tokens, lengths, cp_size=g.cp_size, max_rows=max_rows)
        plans = plan_data_parallel(lengths, dp_size=g.dp_size, max_tokens=max_tokens, cp_size=g.cp_size)
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

    def compute_ref_logprobs(self, samples: Sequence[TrainSample]) -> list[Tensor]:
        with self._weights(self.ref_weights):
            return self.compute_logprobs(samples)

    def accumulate_gradients(self, batch: MiniBatch) -> Accumulated:
        """`TrainBackend.accumulate_gradients` into the gradient buffers (reduced over DP x CP and scaled by
        megatron's finalize step); metrics reduced over all ranks, tokens over all DP ranks. A non-finite loss shows
        as a non-finite gradient norm (`optimizer_step`)."""
        samples, idx, old, ref = batch
        self._zero_grad()
        g = self.groups
        lengths = [samples[i].input_ids.numel() for i in idx]
        max_tokens = self.options.micro_batch_max_tokens
        rows, max_rows = self._loss_rows([samples[i] for i in idx])
        plans = plan_data_parallel(
            lengths, dp_size=g.dp_size, max_tokens=max_tokens, cp_size=g.cp_size, loss_rows=rows, max_loss_rows=max_rows
        )
        denominators = loss_denominators(torch.tensor([sample_loss_tokens(samples[i]) for i in idx]))
        micro = []
        for spec in plans[g.dp_rank]:
            spec = type(spec)([idx[j] for j in spec.samples], spec.dummy)  # positions in idx -> sample indices
            mb = self._micro_batch(samples, spec)
            loss = self.loss
            mb = attach_loss_inputs(
                mb, samples, old, ref, denominators, reduction=loss.reduction, max_response_len=loss.max_response_len
            )
            micro.append(mb)
        self._check_train_logits(micro)
        (token_norm,) = all_reduce_sum([sum(mb.packed.num_tokens for mb in micro)], g.dp, self.device)
        for chunk in self.model:
            chunk.train()
        reports = self._run(self._options("train", samples, token_norm), micro, forward_only=False)
        check_token_norm(sum(r["num_tokens"] for r in reports), token_norm, g, self.device)
        local = combine_metrics([r["metrics"] for r in reports]) if reports else None
        metrics = reduce_metrics(local, g, self.device, template=_metrics_template(self.loss))
        return Accumulated(metrics, int(token_norm), True, len(micro))

    def _loss_rows(self, samples: Sequence[TrainSample]) -> tuple[list[int] | None, int | None]:
        """With `train.logits_only_where_loss`, a train forward's logits have one row per loss position of the rank:
        each sample's loss positions on one rank at most (`sample_loss_rows`) and the most rows the logits may have
        (`step.max_train_logits_rows`), so that the micro-batch plan keeps every micro-batch under the limit
        whatever `micro_batch_max_tokens` is; else (None, None): the rows are the local row, which
        `micro_batch_max_tokens` bounds (the preflight checks it).

        Raises:
            ValueError: one sample alone would reach the limit (`step.train_logits_problem`'s message); every rank
                plans the same samples, so every rank raises alike.
        """
        if not self.options.logits_only_where_loss:
            return None, None
        g, vocab = self.groups, self.config.vocab_size
        rows = [sample_loss_rows(s, g.cp_size) for s in samples]
        problem = train_logits_problem(
            max(rows, default=0),
            vocab,
            g.tp_size,
            logits_only_where_loss=True,
            tokens_from="one sample's loss positions on a rank, which no micro-batch plan can split",
        )
        if problem:
            raise ValueError(problem)
        return rows, max_train_logits_rows(vocab, g.tp_size)

    def _check_train_logits(self, micro: Sequence[MicroBatch]) -> None:
        """Refuse, before any forward, a mini-batch whose train logits on some rank would reach the CUDA limit
        (`step.train_logits_problem`). The largest rows over every rank's micro-batches are all-reduced (MAX) first,
        so every rank decides alike: one that went on into the forward alone would wait in its collectives forever.

        Raises:
            ValueError: the message of `train_logits_problem`.
        """
        only = self.options.logits_only_where_loss
        # the rows of the output layer's output: [T/C, V/TP], or [n loss positions, V/TP] (`logits_at`)
        local = max((mb.loss.positions.numel() if only else mb.num_local_tokens for mb in micro), default=0)
        rows = torch.tensor([local], dtype=torch.int64, device=self.device)
        dist.all_reduce(rows, op=dist.ReduceOp.MAX, group=self.groups.dp_cp)
        where = "the most loss positions of a rank" if only else "the longest local row (T/C) of a rank"
        problem = train_logits_problem(
            int(rows),
            self.config.vocab_size,
            self.groups.tp_size,
            logits_only_where_loss=only,
            tokens_from=f"{where} in this mini-batch's micro-batches",
        )
        if problem:
            raise ValueError(problem)

    def optimizer_step(self, finite: bool = True) -> tuple[float, bool]:
        # megatron's optimizer.step() clips and steps even on a NaN norm (the NaN reaches the weights), so the norm
        # is checked first; step() then repeats the (idempotent) gradient preparation, clips to its clip_grad, steps
        if not self.vision_trainable:  # the gradients are reduced; what the optimizer reads of them is zeroed
            for chunk in self.model:
                for name, p in chunk.named_parameters():
                    if _is_vision(name):
                        for grad in (getattr(p, "main_grad", None), p.grad):  # DDP's buffer, or a plain .grad
                            if grad is not None:
                                grad.zero_()
        found_inf = self.optimizer.prepare_grads()
        grad_norm = math.nan if found_inf or not finite else float(self.optimizer.get_grad_norm())
        stepped = False
        if math.isfinite(grad_norm):
            self._set_lr()
            stepped, _, _ = self.optimizer.step()
        if stepped:
            self.optimizer_steps += 1
        else:
            self.skipped_steps += 1
        self._zero_grad()
        return grad_norm, stepped

    def _zero_grad(self) -> None:
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def lr(self) -> float:
        """Linear warmup over `warmup_steps` optimizer steps, then constant (as the torch backend)."""
        o = self.options.optimizer
        if not o.warmup_steps:
            return o.lr
        return o.lr * min(1.0, (self.optimizer_steps + 1) / o.warmup_steps)

    def set_lr(self, lr: float) -> None:
        """Set the peak learning rate from now on (the LR warm-up factor still applies); the optimizer state is kept.
        `options` gets a copy with the new `optimizer.lr` (the options object passed in is not changed)."""
        self.options = replace(self.options, optimizer=replace(self.options.optimizer, lr=lr))
        self._set_lr()

    def _set_lr(self) -> None:
        lr = self.lr()
        for group in self.optimizer.param_groups:
            value = lr * group.get("lr_mult", 1.0)
            if isinstance(group.get("lr"), Tensor):
                group["lr"].fill_(value)
            else:
                group["lr"] = value
            group["weight_decay"] = self.options.optimizer.weight_decay * group.get("wd_mult", 1.0)

    @contextmanager
    def _weights(self, weights: dict[str, Tensor]):
        """Temporarily load `weights` (a `_snapshot`) into the model chunks."""
        current = _snapshot(self.model)
        _restore(self.model, weights)
        try:
            yield
        finally:
            _restore(self.model, current)

    def set_vision_trainable(self, trainable: bool) -> None:
        """Train the vision tower (megatron's `vision_model.*`: tower, merger, deepstack mergers) from the next
        optimizer step on, or not: frozen, its gradients are zeroed before the optimizer reads them, so only weight
        decay moves it (AdamW's moments stay at what they were). A no-op when the tower is frozen for the run
        (`freeze_vision`). The format warm-up freezes it (warmup.py)."""
        if not self.frozen_prefixes:
            self.vision_trainable = trainable

    def export_weights(self, on_device: bool = False) -> Iterable[tuple[str, Tensor]]:
        """Trainable weights as (HF name, full tensor) pairs, vision tower included unless frozen: CPU tensors, or GPU
        ones with `on_device` (megatron-bridge's `cpu=False`: the colocated IPC sync packs them on the GPU).
        Collective: every rank of the model must consume the iterator."""
        return self.hf_weights(self.frozen_prefixes, cpu=not on_device)

    def hf_weights(self, skip_prefixes: Sequence[str] = (), *, cpu: bool = True) -> Iterable[tuple[str, Tensor]]:
        """Every weight but those under `skip_prefixes` (megatron names) as (HF name, full tensor; on the CPU with
        `cpu`), through megatron-bridge's HF export (export.py). Collective: every rank must consume the iterator."""
        return self.export_plan(skip_prefixes).weights(self.model, cpu=cpu)

    def export_plan(self, skip_prefixes: Sequence[str] = ()) -> ExportPlan:
        """The export of every weight but those under `skip_prefixes`, with megatron-bridge's conversion tasks built
        on its first use and reused while the model's parameters are the same objects (export.py): every sync
        exports the trainable weights, and building the tasks walks the whole model."""
        if self.bridge is None:
            raise ValueError("exporting HF weights needs the AutoBridge the model was built from; pass bridge=...")
        key = tuple(skip_prefixes)
        if key not in self._export_plans:
            self._export_plans[key] = ExportPlan(self.bridge, skip_prefixes=key)
        return self._export_plans[key]

    def save_hf(self, directory: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
        """The whole model (frozen vision tower too) as an HF model directory with the config of the checkpoint the
        bridge was built from; every rank takes part in the export, rank 0 writes (hf_files.py)."""
        weights = self.hf_weights(())
        if _rank() == 0:
            config = copy.deepcopy(self.bridge.hf_pretrained.config)
            write_hf_model(directory, config, weights, max_shard_bytes=max_shard_bytes)
        else:
            for _ in weights:
                pass
        if dist.is_initialized():
            dist.barrier()  # the files exist when any rank returns

    def save_checkpoint(self, directory: Path, optimizer_state: bool = True) -> None:
        """The model's and the optimizer's shards and the counters (checkpoint.py); `optimizer_state=False`: the
        optimizer's shards (fp32 main weights, Adam moments) are left out (checkpoint.optimizer_state). Collective."""
        optimizer = self.optimizer if optimizer_state else None
        ckpt.save_checkpoint(Path(directory), self.model, optimizer, self._counters(), dp_cp_group=self.groups.dp_cp)

    def start_checkpoint(self, directory: Path, optimizer_state: bool = True) -> ckpt.SaveInFlight:
        """`save_checkpoint` in the background (megatron-core's async save, checkpoint.py): returns once the state is
        staged in host memory, so the next optimizer step does not change what is written. Collective."""
        optimizer = self.optimizer if optimizer_state else None
        return ckpt.start_save(Path(directory), self.model, optimizer, self._counters(), dp_cp_group=self.groups.dp_cp)

    def _counters(self) -> dict[str, int]:
        return {"optimizer_steps": self.optimizer_steps, "skipped_steps": self.skipped_steps}

    def load_checkpoint(self, directory: Path) -> None:
        """Restore what `save_checkpoint` wrote; from a checkpoint without the optimizer's shards the optimizer starts
        afresh on the loaded weights (checkpoint.py `load_checkpoint`). Collective."""
        state = ckpt.load_checkpoint(Path(directory), self.model, self.optimizer, dp_cp_group=self.groups.dp_cp)
        self.optimizer_steps, self.skipped_steps = state["optimizer_steps"], state["skipped_steps"]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def run_vision_once_per_image(chunks: Sequence[torch.nn.Module]) -> int:
    """`TrainOptions.vision_once_per_image`: every call of a chunk's vision tower (megatron-bridge's
    `Qwen3VLVisionModel`, called with `hidden_states=` patches and `grid_thw=`) runs on the distinct images of the
    call only, and its outputs (merged embeddings, deepstack features) are read back at every use
    (models/qwen3_vl/vision_once.py): two hooks, so parameter names and the model code stay as they are. Under CP the
    tower is called with every image of the micro-batch on every CP rank, or with this rank's share of them
    (`vision_dp_when_cp`); either way the call's images are deduplicated among themselves, which is exact.
    Returns how many towers got the hooks (0 on pipeline stages without one)."""
    towers = [m for chunk in chunks for name, m in chunk.named_modules() if name.split(".")[-1] == "vision_model"]
    pending: dict[int, object] = {}

    def before(tower, args, kwargs):
        if args or "hidden_states" not in kwargs or "grid_thw" not in kwargs:
            raise TypeError("the vision tower is expected to be called as vision_model(hidden_states=, grid_thw=)")
        distinct = distinct_images(kwargs["hidden_states"], kwargs["grid_thw"], tower.config.spatial_merge_size)
        pending[id(tower)] = distinct
        if distinct is None:
            return None
        return args, {**kwargs, "hidden_states": distinct.pixel_values, "grid_thw": distinct.grid_thw}

    def after(tower, args, kwargs, output):
        distinct = pending.pop(id(tower))
        if distinct is None:
            return None
        embeds, deepstack = output
        return distinct.expand(embeds), [distinct.expand(d) for d in deepstack]

    for tower in towers:
        tower.register_forward_pre_hook(before, with_kwargs=True)
        tower.register_forward_hook(after, with_kwargs=True)
    return len(towers)


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _metrics_template(loss: LossOptions) -> PolicyLossMetrics:
    """A metrics record with the fields these loss options produce (for ranks that compute no loss: PP stages)."""
    empty = torch.zeros(0)
    return policy_loss(
        empty,
        empty,
        empty,
        empty,
        ref_logprobs=empty if loss.kl_coef > 0 else None,
        entropy=empty if loss.entropy_coef > 0 else None,
        rollout_logprobs=empty,
        seq_log_ratio=empty if loss.policy_loss_type == "gspo" else None,
        **loss.policy_loss_kwargs(),
    ).metrics


def _is_vision(name: str) -> bool:
    """Whether a chunk's parameter name (DDP's `module.` prefixes stripped) is under the vision tower."""
    while name.startswith("module."):
        name = name[len("module.") :]
    return name.startswith(MEGATRON_VISION_PREFIXES)


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
