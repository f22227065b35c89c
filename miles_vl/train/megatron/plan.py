"""Which samples each data-parallel (DP) rank processes, cut into micro-batches under the token budget.

Every rank of the train group receives the same full list of samples and computes the same plan, so no collective
is needed to agree on it, and global loss denominators are known everywhere (see `batch.py`).

- `split_for_data_parallel`: samples -> DP ranks, equal counts (+-1 when they do not divide), balanced tokens:
  longest first, each to the emptiest rank (by tokens) that still has room.
- `forward_only_max_tokens`: the token budget of the forward-only logprob pass, whose logits cover every position.
- `plan_data_parallel`: each DP rank's micro-batches (`miles_vl.packing.plan_micro_batches`), with the SAME number
  of micro-batches on every DP rank: megatron's collectives across DP (MoE expert-parallel all-to-all) and the
  pipeline schedule run once per micro-batch, so a rank with fewer would hang the others. A rank with fewer
  samples than micro-batches repeats a sample in `dummy` micro-batches whose results are discarded (forward only;
  the train step never needs them because its sample count divides by the DP size).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from miles_vl.packing import padded_length, plan_micro_batches


@dataclass(frozen=True)
class MicroBatchSpec:
    samples: list[int]  # indices into the caller's sample list, in row order
    dummy: bool = False  # only there to keep micro-batch counts equal across DP ranks; its results are dropped


def split_for_data_parallel(lengths: Sequence[int], dp_size: int) -> list[list[int]]:
    """Sample indices per DP rank (each list in input order): counts differ by at most one, tokens balanced.

    Raises:
        ValueError: dp_size < 1.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, found {dp_size}")
    n = len(lengths)
    capacity = [n // dp_size + (1 if r < n % dp_size else 0) for r in range(dp_size)]
    ranks: list[list[int]] = [[] for _ in range(dp_size)]
    tokens = [0] * dp_size
    for i in sorted(range(n), key=lambda j: (-lengths[j], j)):
        r = min((r for r in range(dp_size) if len(ranks[r]) < capacity[r]), key=lambda r: (tokens[r], r))
        ranks[r].append(i)
        tokens[r] += lengths[i]
    return [sorted(r) for r in ranks]


def plan_data_parallel(
    lengths: Sequence[int],
    *,
    dp_size: int,
    max_tokens: int,
    cp_size: int = 1,
    loss_rows: Sequence[int] | None = None,
    max_loss_rows: int | None = None,
) -> list[list[MicroBatchSpec]]:
    """Micro-batches of every DP rank (`[dp_rank][k]`), all ranks with the same count.

    Args:
        lengths: token count of every sample.
        dp_size: data-parallel size.
        max_tokens: budget of one full THD row (one CP group's micro-batch).
        cp_size: context-parallel size (samples are padded to multiples of 2 * cp_size).
        loss_rows, max_loss_rows: a second budget per micro-batch (`plan_micro_batches`): each sample's loss
            positions on one rank at most, and the most a rank's train logits may have rows
            (`train.logits_only_where_loss`); both or neither.

    Raises:
        ValueError: no samples, or a sample longer than the budget or with more loss rows than `max_loss_rows` (from
            `plan_micro_batches`, which numbers the sample within its DP rank's share).
    """
    if not lengths:
        raise ValueError("plan_data_parallel needs at least one sample")
    shares = split_for_data_parallel(lengths, dp_size)

    def plan(share: list[int], min_micro_batches: int = 1):
        rows = None if loss_rows is None else [loss_rows[i] for i in share]
        return plan_micro_batches(
            [lengths[i] for i in share],
            max_tokens,
            cp_size=cp_size,
            min_micro_batches=min_micro_batches,
            loss_rows=rows,
            max_loss_rows=max_loss_rows,
        )

    plans = [plan(share).num_micro_batches if share else 0 for share in shares]
    count = max(plans)
    out = []
    for share in shares:
        if not share:
            out.append([MicroBatchSpec([0], dummy=True) for _ in range(count)])
            continue
        real = min(count, len(share))
        specs = [MicroBatchSpec([share[j] for j in mb]) for mb in plan(share, real).micro_batches]
        specs += [MicroBatchSpec([share[0]], dummy=True) for _ in range(count - len(specs))]
        out.append(specs)
    return out


def forward_only_max_tokens(max_tokens: int, lengths: Sequence[int], *, cp_size: int, max_rows: int) -> int:
    """The token budget of a forward-only (logprob) pass's micro-batches when the train forward's logits cover the
    loss positions only (`train.logits_only_where_loss`), so that `max_tokens` may pass what full logits may hold:
    the pass forms `[T/C, V/TP]` logits, so its micro-batches stay within `max_rows` rows a rank (`cp_size *
    max_rows` tokens), or within the longest sample's row where that is longer: a sample alone forms those logits
    anyway (forward-only logits of 2.49e9 elements ran, issue 32; the train forward is what fails past 2^31).

    Args:
        max_tokens: `train.micro_batch_max_tokens`.
        lengths: the pass's samples' token counts.
        cp_size: C (samples are padded to multiples of 2C).
        max_rows: the most rows a rank's logits may have (`step.max_train_logits_rows`).
    """
    longest = max((padded_length(n, cp_size) for n in lengths), default=0)
    return min(max_tokens, max(cp_size * max_rows, longest))
