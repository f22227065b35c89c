"""Truncated importance sampling (TIS) against the rollout engine's logprobs.

The rollout engine (SGLang, bf16 kernels) and the trainer compute slightly different probabilities for the same
tokens, so the samples are off-policy with respect to the trainer's `old_logprobs`. TIS reweights each token's
policy-gradient term by the importance ratio `w = exp(old_logprob - rollout_logprob)`, bounded by `cap`:

- `clip` (TIS): w = min(w, cap). Tokens above the cap keep weight `cap`.
- `mask` (masked IS, MIS): w = w where w <= cap, else 0. Tokens above the cap drop out of the loss.

The weights are constants (no gradient): they correct the sampling distribution, they are not optimised.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

TISMode = Literal["clip", "mask"]


def tis_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, *, mode: TISMode, cap: float) -> tuple[Tensor, Tensor]:
    """Per-token importance weights and which tokens the cap changed.

    Args:
        old_logprobs: [T] trainer logprobs of the sampled tokens before the update.
        rollout_logprobs: [T] the rollout engine's logprobs of the same tokens.
        mode: "clip" or "mask".
        cap: upper bound on the ratio, > 0.

    Returns:
        (weights [T] fp32 detached, capped [T] bool: True where the ratio exceeded `cap`).

    Raises:
        ValueError: unknown mode, cap <= 0, or mismatched shapes.
    """
    if old_logprobs.shape != rollout_logprobs.shape:
        raise ValueError(
            f"old_logprobs {tuple(old_logprobs.shape)} and rollout_logprobs {tuple(rollout_logprobs.shape)} must "
            "have the same shape"
        )
    if not cap > 0:
        raise ValueError(f"TIS cap must be > 0, found {cap}; fix algo.tis.cap")
    ratio = torch.exp((old_logprobs.detach() - rollout_logprobs.detach()).float().clamp(-20.0, 20.0))
    capped = ratio > cap
    if mode == "clip":
        return ratio.clamp(max=cap), capped
    if mode == "mask":
        return torch.where(capped, torch.zeros_like(ratio), ratio), capped
    raise ValueError(f"unknown TIS mode {mode!r}; known: ['clip', 'mask']")
