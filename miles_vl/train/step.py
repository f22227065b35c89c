"""The RL step, written once over any `TrainBackend` (types.py): the torch backend and the megatron backend.

    metrics = train_step(backend, samples)      # all optimizer steps of one RL step; flat `train/*` metrics

1. check the samples: one rollout logprob per response token, loss only on responses, a sample count that the
   global batch size and the data-parallel size divide;
2. old logprobs of every response token under the current weights (no gradient); their distance to the rollout
   engine's logprobs is `train_rollout_logprob_abs_diff` (~0 in fp32; ~0.01 is healthy in bf16). With
   `old_logprobs_from_train_forward` and one optimizer update per RL step (one mini-batch of all samples, one
   epoch) there is no separate pass: the train forward runs on the same weights and the same micro-batches (the
   plan depends only on the sample lengths), so its detached logprobs ARE the old ones, bit for bit; with several
   updates the later mini-batches run on moved weights and the separate pass runs;
3. reference logprobs when `kl_coef > 0` (the initial weights);
4. for each PPO epoch and each mini-batch of `global_batch_size` samples: the backend back-propagates the policy
   loss micro-batch by micro-batch with the mini-batch's global denominators (each micro-batch's loss is its exact
   share, so gradients accumulate to the mini-batch gradient), then clips and takes one optimizer step. A
   non-finite loss or gradient norm skips that step and is counted.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from miles_vl.algo import combine_metrics
from miles_vl.train.types import MiniBatch, TrainBackend, TrainSample, check_loss_masks

log = logging.getLogger(__name__)
_warned: set[str] = set()


def _warn_once(message: str, *args: object) -> None:
    """A warning about the configuration, once per process and message (the RL step repeats every step)."""
    if message not in _warned:
        _warned.add(message)
        log.warning(message, *args)


def train_step(backend: TrainBackend, samples: Sequence[TrainSample]) -> dict[str, float]:
    """All optimizer steps of one RL step on `samples` (for a distributed backend: the same list on every rank).

    Returns:
        Flat metrics: the policy-loss metrics (means over loss tokens), `train/grad_norm` (mean over optimizer
        steps), `train/lr`, `train/optimizer_steps`, `train/skipped_nonfinite_steps`, `train/tokens`,
        `train/micro_batches` (the packed forward-backward passes of one DP rank over every update; not the old- or
        reference-logprob passes').

    Raises:
        ValueError: no samples, rollout logprobs that do not match the responses, a loss mask on prompt tokens, or a
            sample count that the global batch size (or a global batch size that the DP size) does not divide.
    """
    if not samples:
        raise ValueError("train() got no samples")
    check_loss_masks(samples)
    for i, s in enumerate(samples):
        if s.rollout_logprobs.numel() != s.response_len:
            raise ValueError(
                f"sample {i}: {s.rollout_logprobs.numel()} rollout logprobs for {s.response_len} response tokens"
            )
    options = backend.options
    gbs = options.global_batch_size or len(samples)
    if len(samples) % gbs:
        raise ValueError(f"{len(samples)} samples are not a multiple of global_batch_size={gbs}")
    if gbs % backend.dp_size:
        raise ValueError(
            f"train.global_batch_size={gbs} is not divisible by the data-parallel size {backend.dp_size} "
            "(world / (tp * pp * cp)); every DP rank needs the same number of samples"
        )
    one_update = options.ppo_epochs == 1 and gbs == len(samples)
    if options.old_logprobs_from_train_forward and not one_update:
        _warn_once(
            "train.old_logprobs_from_train_forward is set but this RL step makes %d optimizer updates "
            "(train.global_batch_size=%d of %d samples, train.ppo_epochs=%d), so the separate old-logprob pass runs; "
            "for one update set train.global_batch_size to null (the rollout batch) and train.ppo_epochs to 1",
            options.ppo_epochs * len(samples) // gbs,
            gbs,
            len(samples),
            options.ppo_epochs,
        )
    old = None if options.old_logprobs_from_train_forward and one_update else backend.compute_logprobs(samples)
    ref = backend.compute_ref_logprobs(samples) if options.loss.kl_coef > 0 else None
    parts, grad_norms, n_tokens, skipped, n_micro = [], [], 0, 0, 0
    for _ in range(options.ppo_epochs):
        for start in range(0, len(samples), gbs):
            idx = list(range(start, start + gbs))
            metrics, tokens, finite, micro_batches = backend.accumulate_gradients(MiniBatch(samples, idx, old, ref))
            grad_norm, stepped = backend.optimizer_step(finite)
            if not stepped:
                skipped += 1
                log.warning("non-finite loss or gradient norm (%s): optimizer step skipped", grad_norm)
            parts.append(metrics)
            grad_norms.append(grad_norm)
            n_tokens += tokens
            n_micro += micro_batches
    out = {f"train/{k}": v for k, v in combine_metrics(parts).as_dict().items()}
    out["train/grad_norm"] = sum(grad_norms) / len(grad_norms)
    out["train/lr"] = backend.lr()
    out["train/optimizer_steps"] = float(len(parts))
    out["train/skipped_nonfinite_steps"] = float(skipped)
    out["train/tokens"] = float(n_tokens)
    out["train/micro_batches"] = float(n_micro)
    return out
