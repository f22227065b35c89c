"""Per-token loss weights that make a loss over split data equal the loss over the whole batch.

The policy loss is a weighted sum over tokens, `loss = sum_t w_t * l_t`, where the weight `w_t` already contains
the loss mask and the global denominator. Because the sum has no local denominator, splitting the tokens any way
(CP ranks, micro-batches, data-parallel ranks) and adding the local sums gives exactly the full-batch loss, and so
exactly the full-batch gradient. The three reductions:

- `token_mean`: every response token of the global batch counts the same.
      loss = sum_{s,t} mask * l / N_tokens            ->  w_t = mask_t / N_tokens
- `seq_mean_token_mean`: average tokens within each sequence, then average sequences (every response counts the
  same, whatever its length; "seq-mean-token-mean" in verl).
      loss = (1 / N_seqs) * sum_s (sum_t mask * l) / n_s   ->  w_t = mask_t / (n_s * N_seqs)
- `seq_mean_token_sum_norm`: sum every token's loss and divide by a constant, the number of samples times the
  longest response the rollout may produce (Dr.GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training": no
  per-response length normalisation, so long and short responses get the same weight per token, and no per-batch
  token count either; verl's "seq-mean-token-sum-norm").
      loss = sum_{s,t} mask * l / (N_samples * max_response_len)   ->  w_t = mask_t / (N_samples * max_response_len)

`n_s` is the number of loss tokens of the WHOLE sequence s (not of a CP shard), `N_tokens` the loss tokens and
`N_seqs` the sequences with at least one loss token over the whole set of sequences whose losses are summed into
one optimizer step (all micro-batches; with data parallelism, all DP ranks when gradients are summed, or one DP
rank's share when they are averaged). Compute the weights on the full packed row and shard them with the tokens
(`weights[zigzag_index(...)]`), or compute them on a shard from the full-sequence counts: both give the same values.

    counts = sequence_loss_tokens(loss_mask, seq_ids, n_seqs)        # per micro-batch, on the full row
    denominators = loss_denominators(torch.cat(all_counts))          # over the global batch
    weights = loss_token_weights(loss_mask, seq_ids, counts, denominators, reduction="token_mean")
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

LossReduction = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
LOSS_REDUCTIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


class LossDenominators(NamedTuple):
    n_seqs: int  # sequences with at least one loss token in the global batch
    n_tokens: int  # loss tokens in the global batch
    n_samples: int = 0  # every sequence of the global batch, with loss tokens or not (seq_mean_token_sum_norm)


def sequence_loss_tokens(loss_mask: Tensor, seq_ids: Tensor, n_seqs: int) -> Tensor:
    """Loss tokens per sequence of one packed row.

    Args:
        loss_mask: [T] 1 (or True) on tokens that carry loss.
        seq_ids: [T] index of each token's sequence in [0, n_seqs); -1 for tokens of no sequence (alignment pad).
        n_seqs: number of sequences in the row.

    Returns:
        LongTensor[n_seqs].

    Raises:
        ValueError: mismatched shapes, or a sequence id >= n_seqs.
    """
    mask, ids = _check_row(loss_mask, seq_ids, n_seqs)
    keep = ids >= 0
    return torch.zeros(n_seqs, dtype=torch.long).index_add_(0, ids[keep], mask[keep].long())


def loss_denominators(seq_loss_tokens: Tensor) -> LossDenominators:
    """Global denominators from the loss-token counts of every sequence in the global batch.

    Args:
        seq_loss_tokens: [N] loss tokens per sequence over all micro-batches (e.g. `torch.cat` of
            `sequence_loss_tokens` of each; all-reduce the two results over DP ranks when gradients are summed).

    Returns:
        LossDenominators(n_seqs, n_tokens, n_samples).
    """
    counts = torch.as_tensor(seq_loss_tokens).reshape(-1)
    return LossDenominators(n_seqs=int((counts > 0).sum()), n_tokens=int(counts.sum()), n_samples=counts.numel())


def loss_token_weights(
    loss_mask: Tensor,
    seq_ids: Tensor,
    seq_loss_tokens: Tensor,
    denominators: LossDenominators,
    *,
    reduction: LossReduction,
    max_response_len: int | None = None,
) -> Tensor:
    """Per-token weights `w_t` such that `sum_t w_t * l_t` over all shards is the full-batch loss.

    Args:
        loss_mask: [T] of the row (or of a shard of it).
        seq_ids: [T] sequence of each token, indexing `seq_loss_tokens`; -1 for tokens of no sequence.
        seq_loss_tokens: [n_seqs] loss tokens of each WHOLE sequence (`sequence_loss_tokens` on the full row).
        denominators: global batch totals (`loss_denominators`).
        reduction: "token_mean", "seq_mean_token_mean" or "seq_mean_token_sum_norm" (module docstring).
        max_response_len: the constant length of `seq_mean_token_sum_norm` (the rollout's response limit); the
            other reductions ignore it.

    Returns:
        FloatTensor[T] fp32; 0 wherever loss_mask is 0.

    Raises:
        ValueError: unknown reduction, empty global batch, seq_mean_token_sum_norm without max_response_len > 0 or
            n_samples > 0, mismatched shapes, or a token whose sequence has no loss
            tokens in `seq_loss_tokens` although its mask is set (the counts are not of the whole sequence).
    """
    counts = torch.as_tensor(seq_loss_tokens).reshape(-1)
    mask, ids = _check_row(loss_mask, seq_ids, counts.numel())
    mask = mask.float()
    if denominators.n_tokens <= 0 or denominators.n_seqs <= 0:
        raise ValueError(f"the global batch has no loss tokens ({denominators}); nothing to train on")
    if reduction == "token_mean":
        return mask / denominators.n_tokens
    if reduction == "seq_mean_token_sum_norm":
        if not max_response_len or max_response_len <= 0 or denominators.n_samples <= 0:
            raise ValueError(
                f"loss_reduction=seq_mean_token_sum_norm divides by n_samples * max_response_len, found n_samples="
                f"{denominators.n_samples} and max_response_len={max_response_len}; pass both (> 0)"
            )
        return mask / (denominators.n_samples * max_response_len)
    if reduction != "seq_mean_token_mean":
        raise ValueError(f"unknown loss_reduction {reduction!r}; known: {list(LOSS_REDUCTIONS)}")
    per_token_count = torch.where(ids >= 0, counts[ids.clamp(min=0)], torch.zeros_like(ids)).float()  # [T]
    if bool(((mask > 0) & (per_token_count <= 0)).any()):
        raise ValueError(
            "a loss token belongs to a sequence with 0 counted loss tokens (or to no sequence): seq_loss_tokens "
            "must count the whole sequences the tokens come from"
        )
    return torch.where(mask > 0, mask / (per_token_count.clamp(min=1) * denominators.n_seqs), torch.zeros_like(mask))


def _check_row(loss_mask: Tensor, seq_ids: Tensor, n_seqs: int) -> tuple[Tensor, Tensor]:
    mask = torch.as_tensor(loss_mask).reshape(-1)
    ids = torch.as_tensor(seq_ids).reshape(-1).long()
    if mask.shape != ids.shape:
        raise ValueError(f"loss_mask [{mask.numel()}] and seq_ids [{ids.numel()}] must have one entry per token")
    if ids.numel() and int(ids.max()) >= n_seqs:
        raise ValueError(f"seq_ids has {int(ids.max())}, but there are only {n_seqs} sequences")
    return mask, ids
