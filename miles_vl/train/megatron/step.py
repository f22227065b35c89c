"""The forward step and loss function that megatron's pipeline schedule runs on each micro-batch.

    schedule(forward_step_func=partial(forward_step, options), data_iterator=iter(micro_batches), model=chunks,
             num_microbatches=len(micro_batches), seq_length=..., micro_batch_size=1, forward_only=...)

`forward_step` moves ONE micro-batch to the device and runs the model on its pre-sharded THD shard; the loss
function (last pipeline stage only) turns the `[1, T/C, V/TP]` vocab-parallel logits into label logprobs
(`vocab_parallel_logprobs`) and then either
- returns them (`mode="logprobs"`): all-gathered over CP, un-zigzagged, cut into per-sample response slices; or
- returns the policy loss (`mode="train"`) of this rank's local label positions with the global denominators.

Gradient scaling (megatron-core 0.19 with `calculate_per_token_loss=True`, which the backend always sets):
the schedule neither divides the loss by the number of micro-batches nor by the CP size; megatron's DDP reduces
gradients over DP x CP as a SUM (`gradient_scaling_factor = 1`), and `finalize_model_grads` then divides them by
the total of the `num_tokens` that every loss call returned, summed over micro-batches and all-reduced over DP x CP.
Our local loss is already the exact share of the mini-batch loss (global denominators), so the plain sum over
ranks and micro-batches is what we want. The loss function returns `local_loss * token_norm` together with
`num_tokens = T/C` (the local row length, padding included), where `token_norm` is the sum of the full row
lengths of every micro-batch of every DP rank in this optimizer step: megatron's division by exactly that total
then cancels the factor, leaving the gradient of the mini-batch loss. The detour keeps megatron's own token
normalisation consistent for the parts it scales itself (the MoE auxiliary and z losses assume `num_tokens` counts
every token). The backend checks that the tokens megatron saw equal `token_norm`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from miles_vl.algo import policy_loss, sequence_mean_log_ratio
from miles_vl.packing.distributed import gather_full_row
from miles_vl.train.megatron.batch import MicroBatch, model_inputs, to_device
from miles_vl.train.megatron.parallel import ParallelGroups
from miles_vl.train.megatron.vocab_parallel import vocab_parallel_logprobs
from miles_vl.train.types import LossOptions, TrainSample, response_logprobs

# One rank's train logits must have fewer elements than this. Past 2^31 the first backward of the RL loss fails with
# `CUDA error: invalid argument` (through IndexSelectBackward0 / SelectBackward0 of `train_loss_func`), raised
# asynchronously and naming no kernel: 16,384 tokens a rank x 151,936 = 2.49e9 failed at 32K CP=2 and 64K CP=4
# (issue 32, docs/long_context.md), every run of at most 8,192 tokens a rank (1.24e9) trained, and the same jobs with
# logits_only_where_loss trained. The forward-only logprob pass over the same 2.49e9-element logits ran, so only the
# train forward is held to it. A module attribute, read at each check, so that tests can lower it.
MAX_TRAIN_LOGITS_ELEMENTS = 2**31


def max_train_logits_rows(vocab_size: int, tp_size: int) -> int:
    """The most rows a rank's train logits `[rows, ceil(vocab_size / tp_size)]` may have: fewer elements than
    `MAX_TRAIN_LOGITS_ELEMENTS` (read at the call, so that tests can lower it)."""
    return (MAX_TRAIN_LOGITS_ELEMENTS - 1) // -(-vocab_size // tp_size)


def train_logits_problem(
    tokens: int, vocab_size: int, tp_size: int, *, logits_only_where_loss: bool, tokens_from: str
) -> str | None:
    """Why a train forward whose logits on one rank are `[tokens, ceil(vocab_size / tp_size)]` must not run (the
    message names the sizes, the limit `MAX_TRAIN_LOGITS_ELEMENTS`, the symptom and the fixes), or None.

    Args:
        tokens: the rows of one rank's logits: its local row `T/C`, or with `logits_only_where_loss` its loss
            positions.
        vocab_size: the model's vocabulary (megatron-bridge's provider does not pad it: `should_pad_vocab` is off).
        tp_size: tensor parallel size (the output layer splits the vocabulary over it).
        logits_only_where_loss: whether `tokens` counts loss positions (`train.logits_only_where_loss`).
        tokens_from: where `tokens` comes from, for the message.
    """
    vocab = -(-vocab_size // tp_size)
    elements = tokens * vocab
    limit = MAX_TRAIN_LOGITS_ELEMENTS
    if elements < limit:
        return None
    what = "loss positions" if logits_only_where_loss else "tokens"
    if logits_only_where_loss:
        fixes = (
            "lower rollout.max_response_len (the micro-batch plan keeps each micro-batch's loss positions under the "
            "limit, but cannot split a sample), or raise train.tp / train.cp"
        )
    else:
        fixes = (
            "set train.logits_only_where_loss=true (logits at the response positions only), or lower "
            "train.micro_batch_max_tokens, or raise train.cp / train.tp"
        )
    return (
        f"the train forward's logits on one rank would be {tokens:,} {what} ({tokens_from}) x {vocab:,} vocabulary "
        f"entries (vocab {vocab_size:,} / train.tp={tp_size}) = {elements:,} elements, at or past the limit of "
        f"{limit:,}: the backward of the RL loss over them fails with `CUDA error: invalid argument`. At this vocab "
        f"a rank may hold at most {max_train_logits_rows(vocab_size, tp_size):,} {what}: {fixes}"
    )


@dataclass
class ForwardOptions:
    """What the forward step and loss function need besides the micro-batch."""

    mode: Literal["logprobs", "train"]
    groups: ParallelGroups
    device: torch.device | str
    loss: LossOptions  # the policy loss and the distribution it scores
    samples: Sequence[TrainSample] = ()
    vocab_size: int | None = None
    token_norm: float = 1.0  # train: total full-row tokens of the optimizer step over all DP ranks (see above)
    logits_only_where_loss: bool = False  # train: the output layer runs at the loss positions only (`logits_at`)
    pinned_input_copies: bool = False  # tensors to the GPU without a stream synchronization (batch.py `to_device`)
    model_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. fp32_output=False for megatron's Float16Module


def forward_step(options: ForwardOptions, data_iterator: Iterator[MicroBatch], model):
    """megatron's `forward_step_func`: (output tensor, loss function of it)."""
    mb = next(data_iterator)
    positions = None
    if options.mode == "train" and options.logits_only_where_loss and mb.loss is not None:
        positions = mb.loss.positions
    with logits_at(model, positions):
        output = model(
            **model_inputs(
                mb, options.device, with_vision=options.groups.first_stage, pinned=options.pinned_input_copies
            ),
            **options.model_kwargs,
        )

    def loss_func(output_tensor):
        if options.mode == "logprobs":
            return logprobs_loss_func(options, mb, output_tensor)
        return train_loss_func(options, mb, output_tensor)

    return output, loss_func


@contextmanager
def logits_at(model, positions: Tensor | None):
    """While the model runs, its output layer (the vocabulary projection) takes the hidden states of the local row
    positions `positions` only: the model returns logits `[1, n, V/TP]` instead of `[1, T/C, V/TP]` (None: no change).

    Prompt positions carry no loss, and their logits are most of the output layer's work and of the logits' memory.
    A forward pre-hook on the output layer selects the rows of its `[T/C, 1, H]` input. Not under sequence
    parallelism, where that input is one TP rank's part of the row (the backend refuses the combination). Pipeline
    stages without the output layer are unchanged.
    """
    if positions is None:
        yield
        return

    def select(layer, args, kwargs):
        hidden = args[0]  # [T/C, 1, H]
        return (hidden.index_select(0, positions.to(hidden.device)), *args[1:]), kwargs

    layers = [m for name, m in model.named_modules() if name.split(".")[-1] == "output_layer"]
    handles = [layer.register_forward_pre_hook(select, with_kwargs=True) for layer in layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _local_logits(output) -> Tensor:
    """[T/C, V/TP] out of the model's output (megatron-bridge may return (logits, loss_mask))."""
    logits = output[0] if isinstance(output, tuple) else output
    if logits.dim() != 3 or logits.shape[0] != 1:
        raise ValueError(f"expected THD logits [1, T/C, V/TP] from the model, found {tuple(logits.shape)}")
    return logits[0]


def _num_tokens(options: ForwardOptions, mb: MicroBatch, like: Tensor) -> Tensor:
    if options.pinned_input_copies:  # filled on the device: no copy from the host
        return like.new_full((), mb.num_local_tokens, dtype=torch.int)
    return torch.tensor(mb.num_local_tokens, dtype=torch.int, device=like.device)


def logprobs_loss_func(options: ForwardOptions, mb: MicroBatch, output) -> tuple[Tensor, Tensor, dict]:
    """Label logprobs of the whole micro-batch: {"logprobs": {sample index: [response_len] fp32 CPU}}."""
    logits = _local_logits(output)
    labels = to_device(mb.shard.labels[0], logits.device, pinned=options.pinned_input_copies)
    logp, _ = vocab_parallel_logprobs(
        logits,
        labels,
        tp_group=options.groups.tp,
        temperature=options.loss.score_temperature,
        suppress_token_ids=options.loss.suppress_token_ids,
        vocab_size=options.vocab_size,
    )  # [T/C]
    if options.groups.cp_size > 1:
        full = gather_full_row(logp.detach(), mb.packed.cu_seqlens, options.groups.cp)  # [T]; cu_seqlens on the CPU
    else:
        full = logp.detach()
    per_sample = {}
    if not mb.spec.dummy:
        chosen = [options.samples[i] for i in mb.spec.samples]
        per_sample = dict(zip(mb.spec.samples, response_logprobs(full, mb.packed.cu_seqlens, chosen), strict=True))
    zero = logits.new_zeros((), dtype=torch.float32)
    return zero, _num_tokens(options, mb, logits), {"logprobs": per_sample}


def train_loss_func(options: ForwardOptions, mb: MicroBatch, output) -> tuple[Tensor, Tensor, dict]:
    """This rank's share of the policy loss, times `token_norm` (module docstring), and its metrics."""
    if mb.loss is None:
        raise ValueError("train_loss_func needs a micro-batch with loss inputs (attach_loss_inputs)")
    logits = _local_logits(output)
    device = logits.device
    li = mb.loss

    def on(t: Tensor) -> Tensor:
        return to_device(t, device, pinned=options.pinned_input_copies)

    pos = on(li.positions)
    labels = on(mb.shard.labels[0])[pos]
    if options.logits_only_where_loss:  # the model computed them there only (`logits_at`)
        if logits.shape[0] != pos.numel():
            raise AssertionError(f"{logits.shape[0]} logits for {pos.numel()} loss positions")
    else:
        logits = logits.index_select(0, pos)
    logp, entropy = vocab_parallel_logprobs(
        logits,  # only the label positions that carry loss: [n, V/TP]
        labels,
        tp_group=options.groups.tp,
        temperature=options.loss.score_temperature,
        suppress_token_ids=options.loss.suppress_token_ids,
        vocab_size=options.vocab_size,
        with_entropy=options.loss.entropy_coef > 0,
    )
    # None: one update per RL step, the weights are those a separate logprobs pass would score (step.py)
    old = logp.detach() if li.old_logprobs is None else on(li.old_logprobs)
    seq_log_ratio = None
    if options.loss.policy_loss_type == "gspo":
        seq_log_ratio = sequence_mean_log_ratio(
            logp, old, on(li.sample), li.seq_loss_tokens, on(li.weights), all_reduce=_cp_sum(options)
        )
    out = policy_loss(
        logp,
        old,
        on(li.advantages),
        on(li.weights),
        ref_logprobs=on(li.ref_logprobs) if li.ref_logprobs is not None else None,
        entropy=entropy,
        rollout_logprobs=on(li.rollout_logprobs),
        seq_log_ratio=seq_log_ratio,
        **options.loss.policy_loss_kwargs(),
    )
    report = {"metrics": out.metrics, "num_tokens": mb.num_local_tokens}
    return out.loss * options.token_norm, _num_tokens(options, mb, logits), report


def _cp_sum(options: ForwardOptions):
    """GSPO's per-sample sums over the CP ranks of a row (a sample's tokens are zigzagged over all of them; a sample
    never spans micro-batches: the planners pack whole samples). Every CP rank of the group runs the loss function of
    the same micro-batch (dummy ones included), so the collective matches; None without CP."""
    if options.groups.cp_size == 1:
        return None

    def reduce(x: Tensor) -> Tensor:
        x = x.clone()
        dist.all_reduce(x, group=options.groups.cp)
        return x

    return reduce


def sequential_forward_backward(
    *,
    forward_step_func,
    data_iterator,
    model,
    num_microbatches: int,
    seq_length: int | None = None,
    micro_batch_size: int = 1,
    forward_only: bool = False,
    finalize=None,
) -> list:
    """megatron's no-pipelining schedule with `calculate_per_token_loss=True`, in plain torch (no CUDA needed).

    For each micro-batch: forward, loss function, backward of the returned loss (never divided); afterwards
    `finalize(model_chunks, total_num_tokens)` (megatron's `finalize_model_grads` role). Returns what each loss
    function reported, like megatron's schedules. Used where megatron's schedule cannot run (CPU tests, tools);
    the backend uses megatron's `get_forward_backward_func()` on GPUs.
    """
    del seq_length, micro_batch_size
    chunk = model[0] if isinstance(model, list) else model
    store, total = [], 0
    for _ in range(num_microbatches):
        output, loss_func = forward_step_func(data_iterator, chunk)
        loss, num_tokens, reported = loss_func(output)
        total += int(num_tokens)
        store.append(reported)
        if not forward_only:
            loss.backward()
    if not forward_only and finalize is not None:
        finalize(model if isinstance(model, list) else [model], torch.tensor(total))
    return store


def check_token_norm(reported_tokens: int, token_norm: float, groups: ParallelGroups, device) -> None:
    """Internal invariant: the tokens megatron divides by (all-reduced over DP x CP) are `token_norm`."""
    t = torch.tensor([float(reported_tokens)], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=groups.dp_cp)
    if groups.last_stage and float(t) != token_norm:
        raise AssertionError(
            f"megatron normalises gradients by {float(t)} tokens but the loss was scaled by {token_norm}; "
            "the micro-batch plans of the DP ranks disagree"
        )
