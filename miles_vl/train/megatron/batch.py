"""One CP rank's part of a packed micro-batch: the model inputs (pre-sharded THD) and the per-token loss inputs.

    mb = pack_micro_batch(samples, spec, tokens=..., spatial_merge_size=2, cp_size=2, cp_rank=r, tp_size=1)
    mb = attach_loss_inputs(mb, samples, old, ref, denominators, reduction="token_mean")
    out = model(**model_inputs(mb, device))          # logits [1, T/C, V/TP]

Everything stays on the CPU until `model_inputs` moves one micro-batch to the device, just before its forward.
The model gets (DESIGN §4/§5): `input_ids` [1, T/C] (this rank's zigzag shard), rank-local MRoPE `position_ids`
[3, 1, T/C], `PackedSeqParams` with the FULL row's `cu_seqlens` (int32) so megatron-bridge recognises the input as
pre-sharded, every image/video of the micro-batch (`pixel_values`, grids) on every CP rank, and the vision masks
restricted to prompt spans (a policy can generate `<|image_pad|>`; those are text).

Loss inputs are taken at the label positions of the local shard that carry loss: logits at local position j score
`labels[j]`, the next token of the full row (laid out before sharding, so it is right even when that token lives on
another rank). Their weights use the global denominators (`miles_vl.algo.loss_weights`), so the local loss of each
CP rank is its exact share and the sum over CP ranks, micro-batches and DP ranks is the mini-batch loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import LongTensor, Tensor

from miles_vl.algo import LossDenominators, LossReduction, loss_token_weights, sequence_loss_tokens
from miles_vl.models import SpecialTokens
from miles_vl.packing import LocalShard, PackedBatch, cat_present, pack_thd, padded_length, zigzag_index
from miles_vl.train.megatron.plan import MicroBatchSpec
from miles_vl.train.types import TrainSample, at_labels


@dataclass(frozen=True)
class LossInputs:
    """Per-token inputs of `policy_loss` at the local label positions with loss (`[n]` each, fp32 on the CPU)."""

    positions: LongTensor  # [n] positions in the local row (index into the model's [T/C] outputs)
    sample: LongTensor  # [n] sample of each position (index into the micro-batch's samples)
    old_logprobs: (
        Tensor | None
    )  # None: the train forward's own, detached (TrainOptions.old_logprobs_from_train_forward)
    advantages: Tensor
    weights: Tensor  # mask and global denominator (`loss_token_weights`)
    rollout_logprobs: Tensor
    ref_logprobs: Tensor | None = None
    seq_loss_tokens: Tensor | None = None  # [n_samples] loss tokens of each WHOLE sample of the row (GSPO's mean)


@dataclass(frozen=True)
class MicroBatch:
    spec: MicroBatchSpec
    packed: PackedBatch  # the full row (every CP rank of the group packs the same one)
    shard: LocalShard  # this CP rank's part
    pixel_values: Tensor | None  # [n_patches, C*T*P*P] every image of the micro-batch, in row order
    pixel_values_videos: Tensor | None
    image_token_id: int
    video_token_id: int
    loss: LossInputs | None = None  # train only

    @property
    def num_local_tokens(self) -> int:
        return self.shard.input_ids.shape[1]


def sample_loss_tokens(sample: TrainSample) -> int:
    """Loss tokens of a whole sample at label positions: its loss mask without the first token (never a label)."""
    mask = sample.loss_mask
    if mask is None:
        return sample.response_len if sample.prompt_len > 0 else sample.response_len - 1
    return int(mask.reshape(-1)[1:].sum())


def sample_loss_rows(sample: TrainSample, cp_size: int) -> int:
    """The loss positions `sample` puts on the CP rank that holds the most of them: its label positions with loss
    (position j scores token j + 1) in that rank's two zigzag chunks of its padded segment (`zigzag_index`, the
    layout the shards are cut by); at CP=1 its loss tokens. A micro-batch's rows on any rank are at most the sum over
    its samples (the sum of each one's largest share: exact at CP=1, an upper bound at CP > 1). What the micro-batch
    plan adds up against the train logits' limit with `train.logits_only_where_loss` (`plan_data_parallel`'s
    `loss_rows`)."""
    n = sample.input_ids.numel()
    mask = sample.loss_mask.reshape(-1) if sample.loss_mask is not None else torch.arange(n) >= sample.prompt_len
    at_label = torch.zeros(padded_length(n, cp_size), dtype=torch.bool)  # [Lp] position j: the loss of token j + 1
    at_label[: n - 1] = mask[1:].bool()  # pack_thd's label_mask: the loss mask shifted by one
    if cp_size == 1:
        return int(at_label.sum())
    segment = torch.tensor([0, at_label.numel()])
    return max(int(at_label[zigzag_index(segment, cp_size, rank)].sum()) for rank in range(cp_size))


def pack_micro_batch(
    samples: Sequence[TrainSample],
    spec: MicroBatchSpec,
    *,
    tokens: SpecialTokens,
    spatial_merge_size: int,
    cp_size: int,
    cp_rank: int,
    tp_size: int = 1,
) -> MicroBatch:
    """Pack the samples of `spec` into one THD row and cut this rank's shard.

    Args:
        samples: all samples of the call; `spec.samples` indexes them.
        tokens: special token ids (pad, media).
        spatial_merge_size: the vision merge size of the model.
        cp_size, cp_rank: context parallel size and this rank.
        tp_size: the TP size when sequence parallelism is on, else 1 (the local row becomes a multiple of it).
    """
    chosen = [samples[i] for i in spec.samples]
    packed = pack_thd(
        chosen,
        cp_size=cp_size,
        tp_size=tp_size,
        pad_token_id=tokens.pad_token_id,
        spatial_merge_size=spatial_merge_size,
        image_token_id=tokens.image_token_id,
        video_token_id=tokens.video_token_id,
        vision_start_token_id=tokens.vision_start_token_id,
    )
    return MicroBatch(
        spec=spec,
        packed=packed,
        shard=packed.shard(cp_rank),
        pixel_values=cat_present([s.pixel_values for s in chosen]),
        pixel_values_videos=cat_present([s.pixel_values_videos for s in chosen]),
        image_token_id=tokens.image_token_id,
        video_token_id=tokens.video_token_id,
    )


def attach_loss_inputs(
    mb: MicroBatch,
    samples: Sequence[TrainSample],
    old_logprobs: Sequence[Tensor] | None,
    ref_logprobs: Sequence[Tensor] | None,
    denominators: LossDenominators,
    *,
    reduction: LossReduction,
    max_response_len: int | None = None,
) -> MicroBatch:
    """`mb` with the loss inputs of its local label positions (per-sample arrays are `[response_len]` each);
    `reduction` and `max_response_len` as `miles_vl.algo.loss_token_weights` takes them; `old_logprobs` None: the
    loss function takes the forward's own logprobs, detached."""
    shard, packed = mb.shard, mb.packed
    label_mask = shard.label_mask[0]
    pos = label_mask.nonzero().squeeze(1)  # [n] local positions
    sample = shard.sample_index[0][pos]  # [n] index into spec.samples
    full = shard.full_index[pos]  # [n] full-row positions
    resp_idx = full + 1 - packed.cu_seqlens[:-1].long()[sample] - packed.prompt_lens[sample]
    counts = sequence_loss_tokens(packed.label_mask, packed.sample_index, packed.num_samples)  # whole samples
    weights = loss_token_weights(
        label_mask[pos], sample, counts, denominators, reduction=reduction, max_response_len=max_response_len
    )
    ids = mb.spec.samples
    advantages = torch.tensor([float(samples[i].advantage) for i in ids], dtype=torch.float32)[sample]
    rollout = [s.rollout_logprobs for s in samples]
    loss = LossInputs(
        positions=pos,
        sample=sample,
        old_logprobs=at_labels(old_logprobs, ids, sample, resp_idx) if old_logprobs is not None else None,
        advantages=advantages,
        weights=weights.float(),
        rollout_logprobs=at_labels(rollout, ids, sample, resp_idx),
        ref_logprobs=at_labels(ref_logprobs, ids, sample, resp_idx) if ref_logprobs is not None else None,
        seq_loss_tokens=counts,
    )
    return replace(mb, loss=loss)


def to_device(t: Tensor, device: torch.device | str, *, pinned: bool = False) -> Tensor:
    """`t` on `device`. `pinned` (`train.pinned_input_copies`): a CPU tensor bound for a CUDA device is copied into
    pinned host memory and from there without waiting (non_blocking; torch's caching host allocator keeps the pinned
    block until the copy is done). torch's plain copy from pageable memory synchronizes the stream first: the host
    waits for every kernel queued before it, and the GPU idles while the host queues the next ones."""
    if pinned and t.device.type == "cpu" and torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def thd_params(cu_seqlens: Tensor, device: torch.device | str, *, pinned: bool = False):
    """megatron `PackedSeqParams` of a THD row whose segments are `cu_seqlens` ([n_seg + 1], the full row's)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = to_device(cu_seqlens.to(torch.int32), device, pinned=pinned)
    max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=max_len,
        max_seqlen_kv=max_len,
    )


def model_inputs(mb: MicroBatch, device: torch.device | str, *, with_vision: bool = True, pinned: bool = False) -> dict:
    """Keyword arguments of megatron-bridge's `Qwen3VLModel.forward` for this micro-batch, on `device`.

    `with_vision=False` (pipeline stages after the first) leaves the pixels on the CPU; `pinned`: `to_device`'s.
    """
    shard, packed = mb.shard, mb.packed
    ids = shard.input_ids

    def on(t: Tensor) -> Tensor:
        return to_device(t, device, pinned=pinned)

    kwargs = dict(
        input_ids=on(ids),  # [1, T/C]
        position_ids=on(shard.position_ids),  # [3, 1, T/C] rank-local MRoPE positions
        packed_seq_params=thd_params(packed.cu_seqlens, device, pinned=pinned),  # the FULL row's segments
    )
    if not with_vision:
        return kwargs
    vision = shard.vision_mask  # [1, T/C] media tokens inside prompt spans only
    if mb.pixel_values is not None:
        kwargs["pixel_values"] = on(mb.pixel_values)
        kwargs["image_grid_thw"] = on(packed.image_grid_thw)
        kwargs["image_input_mask"] = on(vision & (ids == mb.image_token_id))
    if mb.pixel_values_videos is not None:
        kwargs["pixel_values_videos"] = on(mb.pixel_values_videos)
        kwargs["video_grid_thw"] = on(packed.video_grid_thw)
        kwargs["video_input_mask"] = on(vision & (ids == mb.video_token_id))
    return kwargs
