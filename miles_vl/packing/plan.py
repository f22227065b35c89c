"""Micro-batch planning: split samples into THD micro-batches under a token budget per CP group.

First-fit decreasing over the padded lengths (`ceil(L / 2C) * 2C`): samples are taken longest first and each goes
into the first micro-batch with room. FFD uses at most 11/9 OPT + 6/9 bins, and with RL sample lengths it is
usually optimal. The plan reports the padding it costs, so that waste is visible, never hidden.
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
    lengths: Sequence[int], max_tokens: int, *, cp_size: int = 1, min_micro_batches: int = 1
) -> MicroBatchPlan:
    """Group samples into micro-batches whose padded THD row fits `max_tokens`.

    Args:
        lengths: token count of every sample.
        max_tokens: budget of one full THD row (one CP group's micro-batch).
        cp_size: C; each sample occupies `ceil(L / 2C) * 2C` tokens.
        min_micro_batches: at least this many micro-batches (e.g. to give every pipeline stage work); the
            emptiest are filled by moving the shortest samples when there are fewer.

    Returns:
        MicroBatchPlan.

    Raises:
        ValueError: a sample longer than the budget (names it), or fewer samples than `min_micro_batches`.
    """
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
    room: list[int] = []
    for i in sorted(range(len(padded)), key=lambda j: -padded[j]):
        for b, free in enumerate(room):
            if padded[i] <= free:
                bins[b].append(i)
                room[b] -= padded[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - padded[i])
    while len(bins) < min_micro_batches:  # split the fullest bin's shortest sample off into a new bin
        fullest = max(range(len(bins)), key=lambda b: (len(bins[b]) > 1, -room[b]))
        shortest = min(bins[fullest], key=lambda j: padded[j])
        bins[fullest].remove(shortest)
        room[fullest] += padded[shortest]
        bins.append([shortest])
        room.append(max_tokens - padded[shortest])
    return MicroBatchPlan(
        micro_batches=[sorted(b) for b in bins],
        real_tokens=sum(lengths),
        padded_tokens=sum(padded),
    )
