"""Contract: GSPO (policy_loss_type="gspo" with seq_mean_token_mean weights) equals the GSPO paper's objective,
written out here per response: s_i = exp(mean_t(logp - old)), loss = mean_i max(-A_i s_i, -A_i clip(s_i)), in value
and gradient; and split over CP-like shards (with the per-response sums all-reduced) it still adds up exactly."""

from __future__ import annotations

import pytest
import torch

from miles_vl.algo import (
    loss_denominators,
    loss_token_weights,
    policy_loss,
    sequence_loss_tokens,
    sequence_mean_log_ratio,
)
from tests.algo.batches import FlatBatch, random_flat_batch

CLIP = {"clip_low": 0.2, "clip_high": 0.28}


def paper_loss(b: FlatBatch) -> torch.Tensor:
    """GSPO's objective (negated), one response at a time, from the token tensors only."""
    lp, total, n = b.logprobs(), 0.0, 0
    for s in range(b.n_seqs):
        on = (b.seq_ids == s) & (b.loss_mask > 0)
        if not bool(on.any()):
            continue
        ratio = torch.exp((lp[on] - b.old_logprobs[on]).mean())  # geometric mean of the token ratios
        adv = float(b.advantages[on][0])
        clipped = ratio.clamp(1 - CLIP["clip_low"], 1 + CLIP["clip_high"])
        total = total + torch.maximum(-adv * ratio, -adv * clipped)
        n += 1
    return total / n


def ours(b: FlatBatch, idx: torch.Tensor, all_reduce=None, policy_loss_type="gspo"):
    counts = sequence_loss_tokens(b.loss_mask, b.seq_ids, b.n_seqs)
    den = loss_denominators(counts)
    w = loss_token_weights(b.loss_mask[idx], b.seq_ids[idx], counts, den, reduction="seq_mean_token_mean")
    lp = b.logprobs()[idx]
    seq = sequence_mean_log_ratio(lp, b.old_logprobs[idx], b.seq_ids[idx], counts, w, all_reduce=all_reduce)
    return policy_loss(
        lp, b.old_logprobs[idx], b.advantages[idx], w, policy_loss_type=policy_loss_type, seq_log_ratio=seq, **CLIP
    )


@pytest.mark.parametrize("seed", range(6))
def test_gspo_equals_the_paper_objective(seed):
    b = random_flat_batch(seed)
    whole = torch.arange(b.loss_mask.numel())
    out = ours(b, whole)
    (grad,) = torch.autograd.grad(out.loss, b.logits)
    ref = paper_loss(b)
    (ref_grad,) = torch.autograd.grad(ref, b.logits)
    assert out.loss.item() == pytest.approx(ref.item(), abs=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)


def test_gspo_clips_whole_responses_and_differs_from_ppo():
    clipped_tokens, ppo_differs = 0.0, False
    for seed in range(6):
        b = random_flat_batch(seed)
        whole = torch.arange(b.loss_mask.numel())
        g = ours(b, whole).metrics
        clipped_tokens += float(g.clip_low_sum + g.clip_high_sum)
        ppo_differs |= (
            abs(float(ours(b, whole, policy_loss_type="ppo").loss.detach()) - float(ours(b, whole).loss.detach()))
            > 1e-4
        )
    assert clipped_tokens > 0 and ppo_differs  # the clip branch is exercised; the ratio is not the token one


@pytest.mark.parametrize("seed", range(4))
def test_gspo_split_over_shards_with_all_reduce_equals_whole(seed):
    """Two interleaved shards (as zigzag CP ranks: every response has tokens on both); each shard's partial sums are
    all-reduced (here: the other shard's partial sums added), and the shard losses add up to the whole loss."""
    b = random_flat_batch(seed)
    t = b.loss_mask.numel()
    shards = [torch.arange(0, t, 2), torch.arange(1, t, 2)]
    counts = sequence_loss_tokens(b.loss_mask, b.seq_ids, b.n_seqs)
    partial = []
    for idx in shards:  # what each rank would contribute to the all-reduce
        d = (b.logprobs()[idx] - b.old_logprobs[idx]).detach() * b.loss_mask[idx]
        partial.append(torch.zeros(b.n_seqs).index_add_(0, b.seq_ids[idx], d))
    total = sum(ours(b, idx, all_reduce=lambda x, r=r: x + partial[1 - r]).loss for r, idx in enumerate(shards))
    (grad,) = torch.autograd.grad(total, b.logits)
    whole = ours(b, torch.arange(t)).loss
    (whole_grad,) = torch.autograd.grad(whole, b.logits)
    assert total.item() == pytest.approx(whole.item(), abs=1e-6)
    torch.testing.assert_close(grad, whole_grad, rtol=1e-5, atol=1e-7)
    assert counts.sum() == b.loss_mask.sum()


def test_gspo_needs_the_sequence_ratio():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="gspo' needs seq_log_ratio"):
        policy_loss(x, x, x, x, policy_loss_type="gspo", **CLIP)
