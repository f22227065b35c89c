"""RL algorithms: group advantages, the PPO-style policy loss, KL estimators, TIS and split-safe loss weights; the
`TrainSample` a trainer learns from and how rollouts become one (`to_train_samples`).

    adv = compute_advantages(rewards, n_samples_per_prompt, estimator="grpo")       # [N] fp32 + zero-adv fraction
    weights = loss_token_weights(loss_mask, seq_ids, seq_loss_tokens, denominators, reduction="token_mean")
    out = policy_loss(logprobs, old_logprobs, adv_per_token, weights, clip_low=0.2, clip_high=0.28)
    out.loss.backward(); log(out.metrics.as_dict())

Every function takes plain numbers (clip_low, kl_coef, ...), never the config.
"""

from miles_vl.algo.advantages import (
    compute_advantages,
    grpo_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from miles_vl.algo.kl import KLEstimator, kl_penalty
from miles_vl.algo.loss_weights import (
    LossDenominators,
    LossReduction,
    loss_denominators,
    loss_token_weights,
    sequence_loss_tokens,
)
from miles_vl.algo.policy_loss import (
    PolicyLossMetrics,
    PolicyLossType,
    combine_metrics,
    policy_loss,
    sequence_mean_log_ratio,
)
from miles_vl.algo.samples import TrainSample, to_train_samples
from miles_vl.algo.tis import TISMode, tis_weights

__all__ = [
    "KLEstimator",
    "LossDenominators",
    "LossReduction",
    "PolicyLossMetrics",
    "PolicyLossType",
    "TISMode",
    "TrainSample",
    "combine_metrics",
    "compute_advantages",
    "grpo_advantages",
    "kl_penalty",
    "loss_denominators",
    "loss_token_weights",
    "policy_loss",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "sequence_loss_tokens",
    "sequence_mean_log_ratio",
    "tis_weights",
    "to_train_samples",
]
