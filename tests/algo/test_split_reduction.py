"""Contract: with weights from full-sequence lengths and global-batch totals, the policy losses of CP shards
(zigzag, `miles_vl.packing.zigzag_index`) and micro-batches add up to exactly the unsplit full-batch loss, with the
same gradient and the same combined metrics, under every reduction. A per-shard mean (the classic bug) does not."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_vl.algo import (
    LossDenominators,
    combine_metrics,
    loss_denominators,
    loss_token_weights,
    policy_loss,
    sequence_loss_tokens,
)
from miles_vl.packing import zigzag_index

REDUCTIONS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
MAX_RESPONSE_LEN = 16  # the constant of seq_mean_token_sum_norm (Dr.GRPO); >= every response below
LOSS_KW = {"clip_low": 0.2, "clip_high": 0.28, "dual_clip_c": 3.0, "kl_coef": 0.05, "kl_estimator": "low_var_kl"}


@dataclass
class GlobalBatch:
    """Real tokens of every sequence, concatenated without padding (the unsplit reference layout)."""

    theta: torch.Tensor  # [T] leaf: logprobs = -softplus(theta)
    old: torch.Tensor  # [T]
    ref: torch.Tensor  # [T]
    rollout: torch.Tensor  # [T]
    adv: torch.Tensor  # [T]
    mask: torch.Tensor  # [T]
    seq_ids: torch.Tensor  # [T] global sequence index
    starts: list[int]  # start of each sequence in [T]
    lens: list[int]


def make_batch(lens: list[tuple[int, int]], seed: int) -> GlobalBatch:
    g = torch.Generator().manual_seed(seed)
    mask, ids, adv, starts = [], [], [], []
    for s, (prompt, response) in enumerate(lens):
        starts.append(len(mask))
        mask += [0] * prompt + [1] * response
        ids += [s] * (prompt + response)
        adv += [float(torch.randn((), generator=g))] * (prompt + response)
    t = len(mask)
    theta = torch.randn(t, generator=g, dtype=torch.float64)
    lp = -torch.nn.functional.softplus(theta)
    return GlobalBatch(
        theta=theta.requires_grad_(),
        old=lp + 0.3 * torch.randn(t, generator=g, dtype=torch.float64),
        ref=lp + 0.3 * torch.randn(t, generator=g, dtype=torch.float64),
        rollout=lp + 0.3 * torch.randn(t, generator=g, dtype=torch.float64),
        adv=torch.tensor(adv),
        mask=torch.tensor(mask),
        seq_ids=torch.tensor(ids),
        starts=starts,
        lens=[p + r for p, r in lens],
    )


def loss_on(b: GlobalBatch, src: torch.Tensor, weights: torch.Tensor):
    """policy_loss over tokens `src` of the global batch (-1 = a pad token: any values, weight 0)."""
    keep = src >= 0
    at = src.clamp(min=0)

    def take(x: torch.Tensor) -> torch.Tensor:
        return torch.where(keep, x[at], torch.zeros((), dtype=x.dtype))

    logprobs = take(-torch.nn.functional.softplus(b.theta))
    return policy_loss(
        logprobs,
        take(b.old),
        take(b.adv),
        weights,
        ref_logprobs=take(b.ref),
        rollout_logprobs=take(b.rollout),
        tis_mode="clip",
        tis_cap=1.5,
        **LOSS_KW,
    )


def unsplit(b: GlobalBatch, reduction: str):
    counts = sequence_loss_tokens(b.mask, b.seq_ids, len(b.lens))
    weights = loss_token_weights(
        b.mask, b.seq_ids, counts, loss_denominators(counts), reduction=reduction, max_response_len=MAX_RESPONSE_LEN
    )
    return loss_on(b, torch.arange(b.mask.numel()), weights)


def packed_row(b: GlobalBatch, seqs: list[int], cp_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One micro-batch as a THD row (DESIGN §4): each sequence right-padded to a multiple of 2*cp_size.

    Returns (src [T_row] index into the global tokens, -1 on pads; seq_ids [T_row] local sequence index;
    cu_seqlens [n+1] int32)."""
    src, local_ids, cu = [], [], [0]
    for local, s in enumerate(seqs):
        n = b.lens[s]
        padded = -(-n // (2 * cp_size)) * (2 * cp_size)
        src += list(range(b.starts[s], b.starts[s] + n)) + [-1] * (padded - n)
        local_ids += [local] * padded
        cu.append(cu[-1] + padded)
    return torch.tensor(src), torch.tensor(local_ids), torch.tensor(cu, dtype=torch.int32)


def split_losses(b: GlobalBatch, micro_batches: list[list[int]], cp_size: int, reduction: str, per_shard_mean=False):
    """Local losses of every (micro-batch, CP rank), weights from full rows and global totals."""
    denominators = loss_denominators(sequence_loss_tokens(b.mask, b.seq_ids, len(b.lens)))
    outs = []
    for seqs in micro_batches:
        src, ids, cu = packed_row(b, seqs, cp_size)
        mask = torch.where(src >= 0, b.mask[src.clamp(min=0)], 0)
        counts = sequence_loss_tokens(mask, ids, len(seqs))  # full-sequence counts, from the full row
        row_weights = loss_token_weights(
            mask, ids, counts, denominators, reduction=reduction, max_response_len=MAX_RESPONSE_LEN
        )
        for rank in range(cp_size):
            idx = zigzag_index(cu, cp_size, rank)
            weights = row_weights[idx]
            # The same weights come out when computed on the shard from the full-sequence counts.
            on_shard = loss_token_weights(
                mask[idx], ids[idx], counts, denominators, reduction=reduction, max_response_len=MAX_RESPONSE_LEN
            )
            assert torch.equal(on_shard, weights)
            if per_shard_mean:  # the bug this design prevents: normalise by the shard's own token count
                weights = mask[idx].double() / max(int(mask[idx].sum()), 1)
            outs.append(loss_on(b, src[idx], weights))
    return outs


def check_split_equals_unsplit(lens, micro_batches, cp_size, reduction, seed=0):
    b = make_batch(lens, seed)
    full = unsplit(b, reduction)
    (full_grad,) = torch.autograd.grad(full.loss, b.theta)
    parts = split_losses(b, micro_batches, cp_size, reduction)
    total = sum(p.loss for p in parts)
    (split_grad,) = torch.autograd.grad(total, b.theta)
    assert total.item() == pytest.approx(full.loss.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(split_grad, full_grad, rtol=1e-5, atol=1e-7)
    combined, whole = combine_metrics([p.metrics for p in parts]).as_dict(), full.metrics.as_dict()
    assert combined.keys() == whole.keys()
    for key in whole:
        assert combined[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), key
    return b, full


LENS = [(3, 5), (2, 11), (6, 1), (1, 7), (4, 9), (2, 2), (5, 13)]  # (prompt, response) per sequence
MICRO_BATCHES = [[0, 1, 2], [3, 4], [5, 6]]


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_cp_and_micro_batch_split_equals_unsplit(reduction, cp_size):
    check_split_equals_unsplit(LENS, MICRO_BATCHES, cp_size, reduction)


@pytest.mark.parametrize("reduction", ["token_mean", "seq_mean_token_mean"])
def test_per_shard_mean_would_be_wrong(reduction):
    b = make_batch(LENS, 0)
    full = unsplit(b, reduction).loss.item()
    naive = sum(p.loss for p in split_losses(b, MICRO_BATCHES, 2, reduction, per_shard_mean=True)).item()
    assert abs(naive - full) > 1e-2  # so the equality above is not an accident of the data


@st.composite
def split_cases(draw):
    n = draw(st.integers(1, 6))
    lens = [(draw(st.integers(0, 4)), draw(st.integers(0, 9))) for _ in range(n)]
    if not any(r for _, r in lens):
        lens[0] = (lens[0][0], 1)  # at least one response token in the global batch
    lens = [(p if p + r else 1, r) for p, r in lens]  # no empty sequences
    order = draw(st.permutations(range(n)))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1))) if n > 1 else []
    micro = [list(order[a:b]) for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
    return lens, micro, draw(st.integers(1, 4)), draw(st.sampled_from(REDUCTIONS))


@settings(max_examples=30, deadline=None)
@given(split_cases(), st.integers(0, 3))
def test_any_split_equals_unsplit(case, seed):
    lens, micro, cp_size, reduction = case
    check_split_equals_unsplit(lens, micro, cp_size, reduction, seed)


def test_weights_helper_by_hand():
    # Row: seq 0 = [prompt, r, r], seq 1 = [prompt, r], one alignment pad token of no sequence.
    mask = torch.tensor([0, 1, 1, 0, 1, 0])
    ids = torch.tensor([0, 0, 0, 1, 1, -1])
    counts = sequence_loss_tokens(mask, ids, 2)
    assert counts.tolist() == [2, 1]
    den = loss_denominators(torch.tensor([2, 1, 0, 4]))  # global batch: two more sequences elsewhere, one empty
    assert (den.n_seqs, den.n_tokens) == (3, 7)
    assert loss_token_weights(mask, ids, counts, den, reduction="token_mean").tolist() == pytest.approx(
        [0, 1 / 7, 1 / 7, 0, 1 / 7, 0]
    )
    assert loss_token_weights(mask, ids, counts, den, reduction="seq_mean_token_mean").tolist() == pytest.approx(
        [0, 1 / 6, 1 / 6, 0, 1 / 3, 0]
    )
    # Dr.GRPO: sum over tokens / (4 samples, the empty one included, * max_response_len 10), whatever the lengths
    assert den.n_samples == 4
    weights = loss_token_weights(mask, ids, counts, den, reduction="seq_mean_token_sum_norm", max_response_len=10)
    assert weights.tolist() == pytest.approx([0, 1 / 40, 1 / 40, 0, 1 / 40, 0])


def test_constant_normaliser_needs_the_length():
    mask, ids, counts = torch.ones(2), torch.zeros(2), torch.tensor([2])
    with pytest.raises(ValueError, match="seq_mean_token_sum_norm divides by n_samples \\* max_response_len"):
        loss_token_weights(mask, ids, counts, loss_denominators(counts), reduction="seq_mean_token_sum_norm")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: sequence_loss_tokens(torch.ones(3), torch.zeros(2), 1), "must have one entry per token"),
        (lambda: sequence_loss_tokens(torch.ones(2), torch.tensor([0, 2]), 2), "seq_ids has 2, but there are only 2"),
        (
            lambda: loss_token_weights(
                torch.ones(2), torch.zeros(2), torch.tensor([2]), LossDenominators(1, 2), reduction="sum"
            ),
            "unknown loss_reduction 'sum'",
        ),
        (
            lambda: loss_token_weights(
                torch.ones(2), torch.zeros(2), torch.tensor([0]), LossDenominators(0, 0), reduction="token_mean"
            ),
            "the global batch has no loss tokens",
        ),
        (
            lambda: loss_token_weights(
                torch.ones(2),
                torch.zeros(2),
                torch.tensor([0]),
                LossDenominators(1, 2),
                reduction="seq_mean_token_mean",
            ),
            "must count the whole sequences",
        ),
    ],
)
def test_weight_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()
