"""Group advantages from per-sample rewards: GRPO (with or without std normalisation), RLOO and REINFORCE++-baseline.

Input is one reward per response, group-contiguous: responses `g*n .. g*n+n-1` answer prompt `g`
(n = n_samples_per_prompt). Output is one scalar advantage per response, fp32, which the caller broadcasts over
that response's tokens.

- `grpo`: A = r - mean_group(r), divided by (std_group(r) + eps) when `norm_adv_by_std` (GRPO); without it this is
  Dr.GRPO. std is the unbiased (n-1) one, as in verl.
- `rloo`: A_i = r_i - mean_{j != i} r_j, the leave-one-out baseline (RLOO, Ahmadian et al. 2024), which equals
  n / (n - 1) * (r_i - mean_group(r)); it needs n >= 2.
- `reinforce_pp_baseline`: A = r - mean_group(r), then whitened over the whole batch (subtract the batch mean,
  divide by the unbiased batch std), as verl's `reinforce_plus_plus_baseline`. With `token_counts` the batch
  statistics weight each response by its token count, exactly like verl's token-level `masked_whiten`; without,
  every response counts once. For n_samples_per_prompt == 1 the baseline is 0 (verl), so this is REINFORCE++ with
  batch whitening.

A group whose rewards are all equal carries no signal: its advantages are exactly 0.0 under every estimator (not
the eps-damped ~1e-9 of the plain formula, and not the shifted value batch whitening would give it; its zeros still
count in the batch statistics, as in verl). The fraction of such groups is returned for logging. Under `grpo`
a group of one response is such a group (nothing to compare with), so n_samples_per_prompt == 1 gives all zeros.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

Estimator = Literal["grpo", "rloo", "reinforce_pp_baseline"]


class Advantages(NamedTuple):
    advantages: Tensor  # [N] fp32, one per response
    zero_adv_group_fraction: float  # groups whose rewards were all equal (so their advantages are exactly 0)


def _grouped(rewards: Tensor, n_samples_per_prompt: int) -> Tensor:
    """Checked `[n_groups, n]` fp32 view of the rewards."""
    if n_samples_per_prompt < 1:
        raise ValueError(f"n_samples_per_prompt must be >= 1, found {n_samples_per_prompt}")
    rewards = torch.as_tensor(rewards)
    if rewards.dim() != 1 or rewards.numel() == 0:
        raise ValueError(
            f"rewards must be a non-empty 1-D tensor [n_groups * n_samples_per_prompt], found shape "
            f"{tuple(rewards.shape)}"
        )
    if rewards.numel() % n_samples_per_prompt:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of n_samples_per_prompt={n_samples_per_prompt}; "
            "pass every response of every prompt, group-contiguous"
        )
    rewards = rewards.detach().to(torch.float32)
    bad = (~torch.isfinite(rewards)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(f"reward {i} is {float(rewards[i])}; rewards must be finite (check the reward function)")
    return rewards.view(-1, n_samples_per_prompt)


def grpo_advantages(
    rewards: Tensor, n_samples_per_prompt: int, *, norm_adv_by_std: bool = True, eps: float = 1e-6
) -> Advantages:
    """GRPO (norm_adv_by_std=True) or Dr.GRPO (False) advantages.

    Args:
        rewards: [n_groups * n_samples_per_prompt], group-contiguous.
        n_samples_per_prompt: responses per prompt (group size).
        norm_adv_by_std: divide by the group's unbiased std + eps.
        eps: added to the std.

    Returns:
        Advantages([N] fp32, zero-advantage group fraction).

    Raises:
        ValueError: rewards not 1-D, not divisible into groups, or not finite.
    """
    grouped = _grouped(rewards, n_samples_per_prompt)  # [G, n]
    identical = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)  # [G, 1]
    adv = grouped - grouped.mean(dim=1, keepdim=True)
    if norm_adv_by_std and n_samples_per_prompt > 1:
        adv = adv / (grouped.std(dim=1, keepdim=True) + eps)
    adv = torch.where(identical, torch.zeros_like(adv), adv)
    return Advantages(adv.reshape(-1), identical.float().mean().item())


def rloo_advantages(rewards: Tensor, n_samples_per_prompt: int) -> Advantages:
    """RLOO advantages: each reward minus the mean of the other n - 1 rewards of its group.

    Args:
        rewards: [n_groups * n_samples_per_prompt], group-contiguous.
        n_samples_per_prompt: responses per prompt; must be >= 2 (one response has no others to compare with).

    Returns:
        Advantages([N] fp32, zero-advantage group fraction).

    Raises:
        ValueError: n_samples_per_prompt < 2, or bad rewards (as `grpo_advantages`).
    """
    if n_samples_per_prompt < 2:
        raise ValueError(
            "rloo needs n_samples_per_prompt >= 2 (a leave-one-out baseline of the others), found "
            f"{n_samples_per_prompt}"
        )
    grouped = _grouped(rewards, n_samples_per_prompt)  # [G, n]
    identical = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)  # [G, 1]
    others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (n_samples_per_prompt - 1)  # [G, n]
    adv = torch.where(identical, torch.zeros_like(grouped), grouped - others_mean)
    return Advantages(adv.reshape(-1), identical.float().mean().item())


def reinforce_pp_baseline_advantages(
    rewards: Tensor, n_samples_per_prompt: int, *, token_counts: Tensor | None = None, eps: float = 1e-8
) -> Advantages:
    """REINFORCE++ with a group-mean baseline, then batch whitening (verl's `reinforce_plus_plus_baseline`).

    Args:
        rewards: [n_groups * n_samples_per_prompt], group-contiguous.
        n_samples_per_prompt: responses per prompt; 1 means no baseline (verl).
        token_counts: [N] response tokens of each sample; weights the batch mean/std per token like verl's
            `masked_whiten`. None: every response counts once.
        eps: added to the batch variance before the square root (verl: 1e-8).

    Returns:
        Advantages([N] fp32, zero-advantage group fraction; always 0.0 when n_samples_per_prompt == 1).

    Raises:
        ValueError: bad rewards (as `grpo_advantages`), or token_counts of the wrong shape or with negative counts.
    """
    grouped = _grouped(rewards, n_samples_per_prompt)  # [G, n]
    n_total = grouped.numel()
    if n_samples_per_prompt > 1:
        identical = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)  # [G, 1]
        centred = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)  # [N]
    else:
        identical = torch.zeros(grouped.shape[0], 1, dtype=torch.bool)
        centred = grouped.reshape(-1)
    if token_counts is None:
        weights = torch.ones(n_total)
    else:
        weights = torch.as_tensor(token_counts).detach().to(torch.float32).reshape(-1)
        if weights.numel() != n_total or bool((weights < 0).any()):
            raise ValueError(
                f"token_counts must be [N={n_total}] non-negative counts, found shape {tuple(weights.shape)}"
            )
    total = weights.sum()
    if total <= 1:
        raise ValueError(
            f"batch whitening needs more than one response (token) in the batch, found a total weight of "
            f"{float(total)}; use a larger batch or estimator=grpo"
        )
    mean = (centred * weights).sum() / total
    var = ((centred - mean) ** 2 * weights).sum() / (total - 1)  # unbiased, as verl's masked_var
    adv = (centred - mean) * torch.rsqrt(var + eps)
    adv = torch.where(identical.expand_as(grouped).reshape(-1), torch.zeros_like(adv), adv)
    return Advantages(adv, identical.float().mean().item())


ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_pp_baseline")


def compute_advantages(
    rewards: Tensor,
    n_samples_per_prompt: int,
    *,
    estimator: Estimator = "grpo",
    norm_adv_by_std: bool = True,
    token_counts: Tensor | None = None,
) -> Advantages:
    """Advantages by estimator name (the entry point the driver calls).

    Args:
        rewards: [n_groups * n_samples_per_prompt], group-contiguous.
        n_samples_per_prompt: group size.
        estimator: "grpo", "rloo" or "reinforce_pp_baseline".
        norm_adv_by_std: grpo only: divide by the group std (False = Dr.GRPO).
        token_counts: reinforce_pp_baseline only: [N] response lengths for token-weighted whitening.

    Returns:
        Advantages([N] fp32, zero-advantage group fraction).

    Raises:
        ValueError: unknown estimator (lists the known ones), or bad inputs (see the estimators).
    """
    if estimator == "grpo":
        return grpo_advantages(rewards, n_samples_per_prompt, norm_adv_by_std=norm_adv_by_std)
    if estimator == "rloo":
        return rloo_advantages(rewards, n_samples_per_prompt)
    if estimator == "reinforce_pp_baseline":
        return reinforce_pp_baseline_advantages(rewards, n_samples_per_prompt, token_counts=token_counts)
    raise ValueError(f"unknown advantage estimator {estimator!r}; known: {sorted(ADVANTAGE_ESTIMATORS)}")
