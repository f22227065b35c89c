"""This rank's place in the megatron process grid, and the few collectives the backend runs itself.

Ranks of one tensor-parallel (TP) group compute the same values (logprobs, losses, metrics); the ranks of one
context-parallel (CP) group share a micro-batch; data-parallel (DP) ranks hold different samples; only the last
pipeline (PP) stage sees logits. So: logprobs are all-gathered over CP and DP and broadcast from the last PP stage;
metrics are reduced over DP x CP and broadcast from the last PP stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch import Tensor

from miles_vl.algo import PolicyLossMetrics


@dataclass(frozen=True)
class ParallelOptions:
    """The megatron model's parallel layout and precision (`build_megatron_backend`).

    Args:
        tp_size, pp_size, cp_size, ep_size: tensor, pipeline, context and expert parallel sizes (`train.tp/pp/cp/ep`;
            the rest of the world is data parallel).
        sp: sequence parallel (needs tp_size > 1).
        recompute: activation recompute ("none", "selective", "full", "vision": the vision tower only, "language": the
            language model only).
        recompute_layers: with recompute "full" or "language", recompute only the first this many decoder layers of
            the language model (of each pipeline stage); None: every layer.
        vision_dp_when_cp: split the vision tower's work across CP ranks.
        bf16: bf16 weights and compute (else fp32).
        seed: megatron's model-parallel RNG seed.
    """

    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1
    ep_size: int = 1
    sp: bool = False
    recompute: str = "none"
    recompute_layers: int | None = None
    vision_dp_when_cp: bool = False
    bf16: bool = True
    seed: int = 1234


def recompute_layers_problem(recompute_layers: int, num_layers: int, pp_size: int, model: str) -> str | None:
    """Why `recompute_layers` (`ParallelOptions`) cannot apply to `model`'s `num_layers` decoder layers over `pp_size`
    pipeline stages (more than a stage has), or None; `miles-vl check` and the trainer's build both ask it."""
    stage = num_layers // pp_size
    if recompute_layers <= stage:
        return None
    return (
        f"train.recompute_layers={recompute_layers} but a pipeline stage of {model} has {stage} decoder layers "
        f"({num_layers} / train.pp={pp_size}): set at most {stage}, or null for every layer"
    )


@dataclass(frozen=True)
class ParallelGroups:
    tp: dist.ProcessGroup
    cp: dist.ProcessGroup
    dp: dist.ProcessGroup  # data parallel, without CP
    dp_cp: dist.ProcessGroup  # data x context parallel (megatron's gradient-reduction group)
    pp: dist.ProcessGroup
    sequence_parallel: bool = False

    @classmethod
    def from_megatron(cls, *, sequence_parallel: bool = False) -> ParallelGroups:
        """The groups of megatron-core's initialized `parallel_state`."""
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise RuntimeError(
                "megatron's parallel state is not initialized; call build_megatron_backend (or "
                "parallel_state.initialize_model_parallel) first"
            )
        return cls(
            tp=ps.get_tensor_model_parallel_group(),
            cp=ps.get_context_parallel_group(),
            dp=ps.get_data_parallel_group(with_context_parallel=False),
            dp_cp=ps.get_data_parallel_group(with_context_parallel=True),
            pp=ps.get_pipeline_model_parallel_group(),
            sequence_parallel=sequence_parallel,
        )

    tp_size = property(lambda self: dist.get_world_size(self.tp))
    cp_size = property(lambda self: dist.get_world_size(self.cp))
    cp_rank = property(lambda self: dist.get_rank(self.cp))
    dp_size = property(lambda self: dist.get_world_size(self.dp))
    dp_rank = property(lambda self: dist.get_rank(self.dp))
    pp_size = property(lambda self: dist.get_world_size(self.pp))
    first_stage = property(lambda self: dist.get_rank(self.pp) == 0)
    last_stage = property(lambda self: dist.get_rank(self.pp) == dist.get_world_size(self.pp) - 1)

    @property
    def pack_tp_size(self) -> int:
        """What `pack_thd(tp_size=...)` needs: the TP size with sequence parallelism, else 1."""
        return self.tp_size if self.sequence_parallel else 1


def all_reduce_sum(values: Sequence[float], group: dist.ProcessGroup, device: torch.device | str) -> list[float]:
    """Element-wise sum of a few numbers over `group` (float64)."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return t.tolist()


def gather_per_sample(
    mine: dict[int, Tensor], shares: Sequence[Sequence[int]], lengths: Sequence[int], groups: ParallelGroups, device
) -> list[Tensor]:
    """Every sample's `[lengths[i]]` tensor on every rank.

    Args:
        mine: this DP rank's results (sample index -> fp32 tensor); only meaningful on the last PP stage.
        shares: sample indices of every DP rank (the plan all ranks agree on).
        lengths: length of every sample's tensor.
        groups: the process groups.
        device: where collectives run (the CUDA device with NCCL).
    """
    sizes = [sum(lengths[i] for i in share) for share in shares]
    width = max(sizes) if sizes else 0
    local = torch.zeros(width, dtype=torch.float32, device=device)
    if groups.last_stage:
        flat = [mine[i].to(device=device, dtype=torch.float32) for i in shares[groups.dp_rank]]
        if flat:
            local[: sizes[groups.dp_rank]] = torch.cat(flat)
    if groups.pp_size > 1:  # the last stage holds the values: send them to the other stages of this pipeline
        dist.broadcast(local, src=dist.get_global_rank(groups.pp, groups.pp_size - 1), group=groups.pp)
    parts = [torch.empty_like(local) for _ in range(groups.dp_size)]
    dist.all_gather(parts, local, group=groups.dp)
    out: list[Tensor | None] = [None] * len(lengths)
    for rank, share in enumerate(shares):
        offset = 0
        for i in share:
            out[i] = parts[rank][offset : offset + lengths[i]].cpu()
            offset += lengths[i]
    return out  # type: ignore[return-value]


_MAX_FIELDS = ("ratio_max", "tis_weight_max")
_MIN_FIELDS = ("ratio_min",)


def reduce_metrics(
    metrics: PolicyLossMetrics | None, groups: ParallelGroups, device, template: PolicyLossMetrics | None = None
) -> PolicyLossMetrics:
    """Combine each rank's metrics over DP x CP (sums add; ratio_max and tis_weight_max take the max, ratio_min the
    min), then send the result from the last PP stage to the others. Stages without logits pass None; `template`
    (any record of the same options, e.g. from `policy_loss` on empty inputs) gives them the field layout."""
    layout = metrics if metrics is not None else template
    if layout is None:
        raise ValueError("reduce_metrics needs the metrics or a template of their fields")
    names = [f.name for f in fields(PolicyLossMetrics) if getattr(layout, f.name) is not None]
    sums = [n for n in names if n not in _MAX_FIELDS + _MIN_FIELDS]
    maxes = [n for n in _MAX_FIELDS if n in names]  # tis_weight_max only with TIS

    def vector(keys, fill):
        if metrics is None:
            return torch.full((len(keys),), fill, dtype=torch.float64, device=device)
        return torch.stack([getattr(metrics, k).detach().double().reshape(()) for k in keys]).to(device)

    s, hi, lo = vector(sums, 0.0), vector(maxes, -torch.inf), vector(_MIN_FIELDS, torch.inf)
    if groups.last_stage:
        dist.all_reduce(s, group=groups.dp_cp)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=groups.dp_cp)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=groups.dp_cp)
    if groups.pp_size > 1:
        src = dist.get_global_rank(groups.pp, groups.pp_size - 1)
        for t in (s, hi, lo):
            dist.broadcast(t, src=src, group=groups.pp)
    values = dict(zip(sums, s.float().cpu(), strict=True))
    values |= dict(zip(maxes, hi.float().cpu(), strict=True)) | dict(zip(_MIN_FIELDS, lo.float().cpu(), strict=True))
    return PolicyLossMetrics(**{f.name: values.get(f.name) for f in fields(PolicyLossMetrics)})
