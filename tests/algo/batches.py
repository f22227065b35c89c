"""A random packed batch for the loss tests: sequences of prompt + response tokens laid out flat, group-free."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class FlatBatch:
    """Per-token tensors of several sequences concatenated (`[T]`), with per-sequence response spans."""

    seq_ids: torch.Tensor  # [T] sequence of each token
    loss_mask: torch.Tensor  # [T] 1 on response tokens
    logits: torch.Tensor  # [T] leaf; logprobs = -softplus(logits) so they are < 0 and differentiable
    old_logprobs: torch.Tensor  # [T]
    ref_logprobs: torch.Tensor  # [T]
    rollout_logprobs: torch.Tensor  # [T]
    entropy_logits: torch.Tensor  # [T] leaf; entropy = softplus(entropy_logits)
    advantages: torch.Tensor  # [T] the sequence's advantage on every token
    n_seqs: int

    def logprobs(self) -> torch.Tensor:
        return -torch.nn.functional.softplus(self.logits)

    def entropy(self) -> torch.Tensor:
        return torch.nn.functional.softplus(self.entropy_logits)


def random_flat_batch(seed: int, n_seqs: int = 5, zero_adv_seq: int | None = None) -> FlatBatch:
    g = torch.Generator().manual_seed(seed)
    seq_ids, mask, adv = [], [], []
    for s in range(n_seqs):
        prompt = int(torch.randint(1, 5, (1,), generator=g))
        response = int(torch.randint(1, 9, (1,), generator=g))
        a = 0.0 if s == zero_adv_seq else float(torch.randn((), generator=g))
        seq_ids += [s] * (prompt + response)
        mask += [0] * prompt + [1] * response
        adv += [a] * (prompt + response)
    t = len(mask)
    logits = torch.randn(t, generator=g)
    logprobs = -torch.nn.functional.softplus(logits)
    return FlatBatch(
        seq_ids=torch.tensor(seq_ids),
        loss_mask=torch.tensor(mask),
        logits=logits.clone().requires_grad_(),
        # old/ref/rollout near the policy, with some far-off tokens so that every clip branch is hit
        old_logprobs=logprobs + 0.4 * torch.randn(t, generator=g),
        ref_logprobs=logprobs + 0.3 * torch.randn(t, generator=g),
        rollout_logprobs=logprobs + 0.6 * torch.randn(t, generator=g),
        entropy_logits=torch.randn(t, generator=g).requires_grad_(),
        advantages=torch.tensor(adv),
        n_seqs=n_seqs,
    )
