"""The PPO-style policy loss used by GRPO and friends, on flat packed tokens, with its metrics.

Per response token t (ratio r = exp(logprob - old_logprob), advantage A broadcast from the token's response):

    pg_t      = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))       PPO clip, asymmetric (DAPO clip-higher)
    pg_t      = min(pg_t, -A * dual_clip_c)                 if A < 0          dual clip (bounds the loss of A < 0)
    pg_t      = pg_t * tis_t                                                   truncated IS vs rollout logprobs
    l_t       = pg_t + kl_coef * KL_t(policy || ref) - entropy_coef * entropy_t
    loss      = sum_t w_t * l_t

GSPO (`policy_loss_type="gspo"`, Zheng et al. 2025, "Group Sequence Policy Optimization") replaces the token
ratio by the response's sequence-level ratio, the geometric mean of its token ratios, and clips that:

    s_i       = exp(mean_{t in i} (logprob_t - old_logprob_t))             over the response's loss tokens
    r_t       = exp(logprob_t - sg(logprob_t) + sg(log s_i))   value s_i at every token of response i

The value of r_t is s_i, so the clip decides per response; its gradient is s_i * grad(logprob_t), so with
`seq_mean_token_mean` weights (1 / (|y_i| * N_seqs)) the gradient is GSPO's, (1/N_seqs) sum_i -A_i s_i mean_t grad
logprob_t (verl's `compute_policy_loss_gspo` does the same). `log s_i` comes in as `seq_log_ratio`, per token: a
response may be split over CP ranks, so the caller sums its log ratios over the whole response first
(`sequence_mean_log_ratio`, with an all-reduce over the CP group). Token metrics (clip fractions, ratio mean) then
count each response's ratio once per token.

The weight `w_t` holds the loss mask and the global denominator of the chosen reduction (`loss_weights`), so the
loss of a CP shard or a micro-batch is its exact share of the full-batch loss: summing the local losses over CP
ranks and micro-batches gives the full-batch loss and gradient, with no local mean anywhere. The caller computes
the weights (`loss_token_weights`) from full-sequence lengths and global totals; tokens with w_t = 0 (prompt, pad)
contribute nothing. Every input is a per-token tensor of the same shape (`[T]` for a row, `[1, T/C]` for a shard).

Metrics come back as a `PolicyLossMetrics` record of local sums and extremes, so records of shards and
micro-batches combine exactly (`combine_metrics`: sums add, extremes take max/min); `as_dict()` turns sums into
means over response tokens (the tokens with w_t > 0), whatever the loss reduction.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from miles_vl.algo.kl import KLEstimator, kl_penalty
from miles_vl.algo.tis import TISMode, tis_weights


@dataclass(frozen=True)
class PolicyLossMetrics:
    """Detached 0-dim fp32 tensors of one shard; None where the input that feeds a metric was not given.

    Combine over shards with `combine_metrics` (or all-reduce: SUM for every field but `ratio_max` and
    `tis_weight_max` (MAX) and `ratio_min` (MIN)); `as_dict()` gives the flat means for logging.
    """

    loss: Tensor  # this shard's share of the loss (sum)
    pg_loss: Tensor  # its policy-gradient part (sum)
    kl_loss: Tensor  # its kl_coef * KL part (sum)
    entropy_loss: Tensor  # its -entropy_coef * entropy part (sum)
    n_tokens: Tensor  # response tokens (w_t > 0) in this shard (sum)
    clip_low_sum: Tensor  # tokens with A < 0 and r < 1 - clip_low: clipped, no gradient (sum)
    clip_high_sum: Tensor  # tokens with A > 0 and r > 1 + clip_high: clipped, no gradient (sum)
    ratio_sum: Tensor  # sum of r (sum)
    ratio_max: Tensor  # max of r; -inf on a shard without response tokens (max)
    ratio_min: Tensor  # min of r; +inf on a shard without response tokens (min)
    approx_kl_sum: Tensor  # sum of old_logprob - logprob, the k1 estimate of KL(old || new) (sum)
    dual_clip_sum: Tensor | None = None  # tokens with A < 0 and r > dual_clip_c (sum)
    ref_kl_sum: Tensor | None = None  # sum of the KL estimator against the reference (sum)
    entropy_sum: Tensor | None = None  # sum of the per-token entropy (sum)
    tis_weight_sum: Tensor | None = None  # sum of the TIS weights (sum)
    tis_weight_max: Tensor | None = None  # max of the TIS weights; -inf on a shard without response tokens (max)
    tis_capped_sum: Tensor | None = None  # tokens whose IS ratio exceeded the cap (sum)
    rollout_abs_diff_sum: Tensor | None = None  # sum of |old_logprob - rollout_logprob| (sum)

    def as_dict(self) -> dict[str, float]:
        """Flat float metrics: the loss parts as given, token statistics as means over response tokens."""
        n = float(self.n_tokens)

        def mean(total: Tensor) -> float:
            return float(total) / n if n > 0 else math.nan

        out = {
            "loss": float(self.loss),
            "pg_loss": float(self.pg_loss),
            "kl_loss": float(self.kl_loss),
            "entropy_loss": float(self.entropy_loss),
            "n_loss_tokens": n,
            "clip_frac": mean(self.clip_low_sum + self.clip_high_sum),
            "clip_frac_low": mean(self.clip_low_sum),
            "clip_frac_high": mean(self.clip_high_sum),
            "ratio_mean": mean(self.ratio_sum),
            "ratio_max": float(self.ratio_max) if n > 0 else math.nan,
            "ratio_min": float(self.ratio_min) if n > 0 else math.nan,
            "approx_kl": mean(self.approx_kl_sum),
        }
        optional = {
            "dual_clip_frac": self.dual_clip_sum,
            "ref_kl": self.ref_kl_sum,
            "entropy": self.entropy_sum,
            "tis_weight_mean": self.tis_weight_sum,
            "tis_capped_frac": self.tis_capped_sum,
            "train_rollout_logprob_abs_diff": self.rollout_abs_diff_sum,
        }
        out.update({key: mean(value) for key, value in optional.items() if value is not None})
        if self.tis_weight_max is not None:
            out["tis_weight_max"] = float(self.tis_weight_max) if n > 0 else math.nan
        return out


PolicyLossType = Literal["ppo", "gspo"]
POLICY_LOSS_TYPES = ("ppo", "gspo")


def sequence_mean_log_ratio(
    logprobs: Tensor,
    old_logprobs: Tensor,
    token_seq: Tensor,
    seq_loss_tokens: Tensor,
    token_weights: Tensor | None = None,
    *,
    all_reduce: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """GSPO's `log s_i` = mean of (logprob - old_logprob) over the loss tokens of each WHOLE response, per token.

    Args:
        logprobs: [T] this shard's label logprobs (read detached).
        old_logprobs: [T] the same under the old policy.
        token_seq: [T] each token's sequence, indexing `seq_loss_tokens`.
        seq_loss_tokens: [n_seqs] loss tokens of each whole sequence (`sequence_loss_tokens` on the full row).
        token_weights: [T] only tokens with weight > 0 count; None: every token given.
        all_reduce: sums the [n_seqs] fp32 partial sums over the shards of the row (the CP group); None: the shard
            is the whole row.

    Returns:
        [T] fp32, detached: each token's response mean log ratio.
    """
    diff = (logprobs.detach().float() - old_logprobs.detach().float()).clamp(-20.0, 20.0)
    if token_weights is not None:
        diff = torch.where(token_weights > 0, diff, torch.zeros_like(diff))
    ids = token_seq.long().to(diff.device)
    counts = torch.as_tensor(seq_loss_tokens).to(diff.device).float()
    sums = torch.zeros(counts.numel(), dtype=torch.float32, device=diff.device).index_add_(0, ids, diff)
    if all_reduce is not None:
        sums = all_reduce(sums)
    return (sums / counts.clamp(min=1.0))[ids]


class PolicyLossOutput(NamedTuple):
    loss: Tensor  # 0-dim, differentiable: this shard's share of the full-batch loss
    metrics: PolicyLossMetrics


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    token_weights: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip_c: float | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "low_var_kl",
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    rollout_logprobs: Tensor | None = None,
    tis_mode: TISMode | None = None,
    tis_cap: float = 2.0,
    policy_loss_type: PolicyLossType = "ppo",
    seq_log_ratio: Tensor | None = None,
) -> PolicyLossOutput:
    """The policy loss of one shard of packed tokens (module docstring for the formula).

    Args:
        logprobs: [T] logprobs of the taken tokens under the policy being trained (carries the gradient).
        old_logprobs: [T] the same under the policy that the ratio is taken against (before this update).
        advantages: [T] each token's response advantage.
        token_weights: [T] loss weights with mask and global denominator (`loss_token_weights`); 0 = no loss.
        clip_low: lower clip range, ratio floor 1 - clip_low (0 < clip_low < 1).
        clip_high: upper clip range, ratio ceiling 1 + clip_high (> 0).
        dual_clip_c: dual-clip bound (> 1) for A < 0; None = off.
        ref_logprobs: [T] reference-policy logprobs; needed when kl_coef > 0, logged as `ref_kl` when given.
        kl_coef: weight of the KL penalty in the loss.
        kl_estimator: "k1", "k2", "k3" or "low_var_kl" (`miles_vl.algo.kl`).
        entropy: [T] per-token entropy of the policy (differentiable); needed when entropy_coef > 0.
        entropy_coef: weight of the entropy bonus (subtracted from the loss).
        rollout_logprobs: [T] the rollout engine's logprobs; needed for TIS, logged as
            `train_rollout_logprob_abs_diff` when given.
        tis_mode: "clip", "mask" or None (off) (`miles_vl.algo.tis`).
        tis_cap: TIS upper bound on the importance ratio.
        policy_loss_type: "ppo" (token ratio) or "gspo" (sequence ratio; module docstring).
        seq_log_ratio: [T] gspo: each token's response mean log ratio (`sequence_mean_log_ratio`).

    Returns:
        PolicyLossOutput(loss 0-dim fp32 with gradient, metrics PolicyLossMetrics).

    Raises:
        ValueError: out-of-range clip/coef arguments, shapes that differ, or a term switched on without its input
            (the message names the argument to pass).
    """
    _check_args(clip_low, clip_high, dual_clip_c, kl_coef, entropy_coef)
    inputs = {"old_logprobs": old_logprobs, "advantages": advantages, "token_weights": token_weights}
    inputs |= {"ref_logprobs": ref_logprobs, "entropy": entropy, "rollout_logprobs": rollout_logprobs}
    inputs |= {"seq_log_ratio": seq_log_ratio}
    for key, value in inputs.items():
        if value is not None and value.shape != logprobs.shape:
            raise ValueError(
                f"{key} has shape {tuple(value.shape)}, logprobs {tuple(logprobs.shape)}; pass one "
                "value per token for both"
            )
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs; compute them or set algo.kl_coef=0")
    if entropy_coef > 0 and entropy is None:
        raise ValueError(f"entropy_coef={entropy_coef} needs the per-token entropy; pass it or set entropy_coef=0")
    if policy_loss_type not in POLICY_LOSS_TYPES:
        raise ValueError(f"unknown policy_loss_type {policy_loss_type!r}; known: {list(POLICY_LOSS_TYPES)}")
    if policy_loss_type == "gspo" and seq_log_ratio is None:
        raise ValueError(
            "policy_loss_type='gspo' needs seq_log_ratio (sequence_mean_log_ratio of each token's response)"
        )
    if tis_mode is not None and rollout_logprobs is None:
        raise ValueError(f"tis_mode={tis_mode!r} needs rollout_logprobs; pass them or disable algo.tis")

    logprobs = logprobs.float()
    old = old_logprobs.detach().float()
    adv = advantages.detach().float()
    w = token_weights.detach().float()
    on = w > 0  # response tokens
    on_f = on.float()

    if policy_loss_type == "gspo":  # value log s_i, gradient that of logprob_t
        log_ratio = (logprobs - logprobs.detach() + seq_log_ratio.detach().float()).clamp(-20.0, 20.0)
    else:
        log_ratio = (logprobs - old).clamp(-20.0, 20.0)  # as verl: keeps exp finite for wild early updates
    ratio = torch.exp(log_ratio)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high))
    dual = None
    if dual_clip_c is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * dual_clip_c), pg)
        dual = (adv < 0) & (ratio.detach() > dual_clip_c)
    tis = capped = None
    if tis_mode is not None:
        tis, capped = tis_weights(old, rollout_logprobs, mode=tis_mode, cap=tis_cap)
        pg = pg * tis
    pg_loss = (pg * w).sum()

    ref_kl = None
    kl_loss = logprobs.new_zeros(())
    if ref_logprobs is not None:
        ref_kl = kl_penalty(logprobs, ref_logprobs.detach().float(), kl_estimator)
        if kl_coef > 0:
            kl_loss = kl_coef * (ref_kl * w).sum()
    entropy_loss = logprobs.new_zeros(())
    if entropy is not None and entropy_coef > 0:
        entropy_loss = -entropy_coef * (entropy.float() * w).sum()
    loss = pg_loss + kl_loss + entropy_loss

    r = ratio.detach()

    def tok_sum(x: Tensor) -> Tensor:
        return (x.detach().float() * on_f).sum()

    metrics = PolicyLossMetrics(
        loss=loss.detach(),
        pg_loss=pg_loss.detach(),
        kl_loss=kl_loss.detach(),
        entropy_loss=entropy_loss.detach(),
        n_tokens=on_f.sum(),
        clip_low_sum=tok_sum((adv < 0) & (r < 1.0 - clip_low)),
        clip_high_sum=tok_sum((adv > 0) & (r > 1.0 + clip_high)),
        ratio_sum=tok_sum(r),
        ratio_max=torch.where(on, r, torch.full_like(r, -math.inf)).max() if r.numel() else r.new_tensor(-math.inf),
        ratio_min=torch.where(on, r, torch.full_like(r, math.inf)).min() if r.numel() else r.new_tensor(math.inf),
        approx_kl_sum=tok_sum(old - logprobs),
        dual_clip_sum=None if dual is None else tok_sum(dual),
        ref_kl_sum=None if ref_kl is None else tok_sum(ref_kl),
        entropy_sum=None if entropy is None else tok_sum(entropy),
        tis_weight_sum=None if tis is None else tok_sum(tis),
        tis_weight_max=None if tis is None else _masked_max(tis, on),
        tis_capped_sum=None if capped is None else tok_sum(capped),
        rollout_abs_diff_sum=None if rollout_logprobs is None else tok_sum((old - rollout_logprobs.float()).abs()),
    )
    return PolicyLossOutput(loss, metrics)


def combine_metrics(parts: Sequence[PolicyLossMetrics]) -> PolicyLossMetrics:
    """Metrics of the union of shards / micro-batches: sums add, `ratio_max`/`ratio_min` take max/min.

    Args:
        parts: records from `policy_loss` calls with the same options (so the same fields are None).

    Returns:
        One PolicyLossMetrics.

    Raises:
        ValueError: no parts, or parts where a field is None in some and set in others.
    """
    if not parts:
        raise ValueError("combine_metrics needs at least one PolicyLossMetrics")
    combined = {}
    for f in fields(PolicyLossMetrics):
        values = [getattr(p, f.name) for p in parts]
        if all(v is None for v in values):
            combined[f.name] = None
            continue
        if any(v is None for v in values):
            raise ValueError(f"metric {f.name} is set in some parts and None in others; combine like with like")
        stacked = torch.stack([v.to(values[0].device) for v in values])
        reduce = {"ratio_max": torch.amax, "tis_weight_max": torch.amax, "ratio_min": torch.amin}.get(f.name, torch.sum)
        combined[f.name] = reduce(stacked, dim=0)
    return PolicyLossMetrics(**combined)


def _masked_max(x: Tensor, on: Tensor) -> Tensor:
    """Max of `x` [T] where `on` [T] bool; -inf where nothing is on (the MAX reduction's identity)."""
    x = x.detach().float()
    return torch.where(on, x, torch.full_like(x, -math.inf)).max() if x.numel() else x.new_tensor(-math.inf)


def _check_args(
    clip_low: float, clip_high: float, dual_clip_c: float | None, kl_coef: float, entropy_coef: float
) -> None:
    if not 0.0 < clip_low < 1.0:
        raise ValueError(f"clip_low must be in (0, 1), found {clip_low}; the ratio floor is 1 - clip_low")
    if not clip_high > 0.0:
        raise ValueError(f"clip_high must be > 0, found {clip_high}")
    if dual_clip_c is not None and not dual_clip_c > 1.0:
        raise ValueError(f"dual_clip_c must be > 1 (e.g. 3.0) or None, found {dual_clip_c}")
    if kl_coef < 0 or entropy_coef < 0:
        raise ValueError(f"kl_coef and entropy_coef must be >= 0, found {kl_coef} and {entropy_coef}")
