"""Per-token KL estimators between the policy and a reference policy, from the sampled tokens' logprobs.

With log-ratio `x = ref_logprob - logprob` on tokens sampled from the policy (Schulman, "Approximating KL
divergence"), each estimates KL(policy || ref):

- `k1`: -x = logprob - ref_logprob (unbiased, high variance, can be negative)
- `k2`: x**2 / 2 (biased, low variance)
- `k3`: exp(x) - x - 1 (unbiased, non-negative)
- `low_var_kl`: k3 with x clamped to [-20, 20] and the result clamped to [-10, 10], exactly as verl's `low_var_kl`
  (verl also maps the name `k3` to this clamped form; here `k3` is the plain formula).

All return `[T]` (same shape as the inputs), differentiable with respect to `logprob`.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

KLEstimator = Literal["k1", "k2", "k3", "low_var_kl"]
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator) -> Tensor:
    """Per-token KL estimate of the policy against the reference.

    Args:
        logprobs: [T] log-probabilities of the sampled tokens under the policy being trained.
        ref_logprobs: [T] log-probabilities of the same tokens under the reference policy.
        estimator: "k1", "k2", "k3" or "low_var_kl".

    Returns:
        [T] the estimate per token (not masked, not reduced).

    Raises:
        ValueError: unknown estimator or mismatched shapes.
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} must have the same shape"
        )
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.exp(log_ratio) - log_ratio - 1
    if estimator == "low_var_kl":
        log_ratio = log_ratio.clamp(-20.0, 20.0)
        return (torch.exp(log_ratio) - log_ratio - 1).clamp(-10.0, 10.0)
    raise ValueError(f"unknown kl_estimator {estimator!r}; known: {list(KL_ESTIMATORS)}")
