"""Micro-batch planning: split samples into THD micro-batches under a token budget per CP group.

First-fit decreasing over the padded lengths (`ceil(L / 2C) * 2C`): samples are taken longest first and each goes
into the first micro-batch with room. A second budget may ride along (`loss_rows`, `max_loss_rows`: the megatron
trainer's loss positions on one rank, whose logits must stay under a size, with `train.logits_only_where_loss`): a
sample then goes into the first micro-batch with room in both. FFD uses at most 11/9 OPT + 6/9 bins (one budget), and
with RL sample lengths it is usually optimal. The plan reports the padding it costs, so that waste is visible, never
hidden.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from miles_vl.packing.thd import padded_length


@dataclass(frozen=True)
class MicroBatchPlan:
    micro_batches: list[list[int]]  # sample indices per micro-batch, in input order inside each micro-batch
    real_tokens: int  # sum of unpadded lengths
    padded_tokens: int  # sum of row lengths (segment padding included)

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0

    @property
    def num_micro_batches(self) -> int:
        return len(self.micro_batches)


def plan_micro_batches(
    lengths: Sequence[int],
    max_tokens: int,
    *,
    cp_size: int = 1,
    min_micro_batches: int = 1,
    loss_rows: Sequence[int] | None = None,
    max_loss_rows: int | None = None,
) -> MicroBatchPlan:
    """Group samples into micro-batches whose padded THD row fits `max_tokens`.

    Args:
        lengths: token count of every sample.
        max_tokens: budget of one full THD row (one CP group's micro-batch).
        cp_size: C; each sample occupies `ceil(L / 2C) * 2C` tokens.
        min_micro_batches: at least this many micro-batches (e.g. to give every pipeline stage work); the
            emptiest are filled by moving the shortest samples when there are fewer.
        loss_rows: with `max_loss_rows`, what each sample adds to a micro-batch's second budget.
        max_loss_rows: the most `loss_rows` one micro-batch may sum to (both or neither).

    Returns:
        MicroBatchPlan.

    Raises:
        ValueError: a sample longer than the budget, or with more loss rows than `max_loss_rows` (names it), or
            fewer samples than `min_micro_batches`.
    """
    if (loss_rows is None) != (max_loss_rows is None) or (loss_rows is not None and len(loss_rows) != len(lengths)):
        raise ValueError("loss_rows (one per sample) and max_loss_rows go together")
    rows = list(loss_rows) if loss_rows is not None else [0] * len(lengths)
    rows_budget = max_loss_rows if max_loss_rows is not None else 0
    for i, r in enumerate(rows):
        if r > rows_budget:
            raise ValueError(f"sample {i} adds {r} loss rows, more than one micro-batch may hold ({rows_budget})")
    padded = [padded_length(n, cp_size) for n in lengths]
    for i, p in enumerate(padded):
        if p > max_tokens:
            raise ValueError(
                f"sample {i} needs {p} tokens (length {lengths[i]} padded to a multiple of 2*cp_size={2 * cp_size}) "
                f"but the micro-batch budget is {max_tokens}; raise train.micro_batch_max_tokens or lower "
                "data.max_prompt_len / rollout.max_response_len"
            )
    if len(lengths) < min_micro_batches:
        raise ValueError(f"{len(lengths)} samples cannot fill min_micro_batches={min_micro_batches}")
    bins: list[list[int]] = []
    room: list[int] = []  # tokens left in each bin
    rows_room: list[int] = []  # loss rows left in each bin (unused without the second budget: every row is 0)
    for i in sorted(range(len(padded)), key=lambda j: -padded[j]):
        for b, free in enumerate(room):
            if padded[i] <= free and rows[i] <= rows_room[b]:
                bins[b].append(i)
                room[b] -= padded[i]
                rows_room[b] -= rows[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - padded[i])
            rows_room.append(rows_budget - rows[i])
    while len(bins) < min_micro_batches:  # split the fullest bin's shortest sample off into a new bin
        fullest = max(range(len(bins)), key=lambda b: (len(bins[b]) > 1, -room[b]))
        shortest = min(bins[fullest], key=lambda j: padded[j])
        bins[fullest].remove(shortest)
        room[fullest] += padded[shortest]
        rows_room[fullest] += rows[shortest]
        bins.append([shortest])
        room.append(max_tokens - padded[shortest])
        rows_room.append(rows_budget - rows[shortest])
    return MicroBatchPlan(
        micro_batches=[sorted(b) for b in bins],
        real_tokens=sum(lengths),
        padded_tokens=sum(padded),
    )
