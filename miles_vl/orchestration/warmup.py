"""Format warm-up: a few supervised steps before RL that teach the answer format and nothing about the images.

    train.format_warmup_steps: 20        # in a job config; 0 (the default) skips it
    train.format_warmup_lr: 3.0e-3       # its own peak lr (null: train.optimizer.lr); RL gets optimizer.lr back

A model trained from scratch never samples `<think></think>\\boxed{...}`, so every reward is 0, every GRPO group has
equal rewards and RL has no gradient. The warm-up fixes that without giving away the task: each target is

    <think></think>\\boxed{a}<|im_end|>      a: the answer of a random training row, drawn independently of the prompt

so the targets carry the format and the distribution of answers, never the answer of the prompt they follow (its
image says nothing about its target). After the warm-up the policy answers in the right format with answers that
ignore the image: chance accuracy, and groups with mixed rewards, from which RL must learn to look at the image.

The vision tower is frozen during the warm-up (`set_vision_trainable`). Its targets are independent of the image, so
all they could teach the tower is to carry nothing the answer could depend on; measured on the tiny CPU job's task
(docs/benchmarks.md, vision learning), a warm-up that trained the tower left GRPO unable to learn the image-only
task in 100 steps, and the same warm-up with the tower frozen let it learn in 30-80.

Each warm-up step is the RL train step itself on these targets with advantage 1: the policy loss at ratio 1 (one
optimizer step per call, so the clip is inactive) is `-sum(logp)/tokens`, plain SFT. The step draws
`rollout.batch_size` training prompts (its own seeded RNG: the data cursor does not move, so the RL data order is
the same with or without a warm-up) and `rollout.n_samples_per_prompt` targets for each. Then the weights go to the
engines and the eval set is scored: that record, logged as step 0, is the start point of the curves.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from miles_vl.algo import TrainSample

if TYPE_CHECKING:
    from miles_vl.config import JobConfig
    from miles_vl.data import PromptDataset
    from miles_vl.models import SpecialTokens
    from miles_vl.orchestration.engines import RolloutEngines
    from miles_vl.orchestration.trainer import Trainer

WARMUP_TEMPLATE = "<think></think>\\boxed{{{answer}}}"  # matches the geo3k reward's default format pattern

log = logging.getLogger(__name__)


class WarmupJob(Protocol):
    """What the warm-up uses of the running job. The driver's `loop.Job` is one; it is named here, not imported,
    because the loop calls the warm-up: imports go one way (loop -> warmup)."""

    cfg: JobConfig
    train_set: PromptDataset
    processor: Any  # the HF processor: its `tokenizer` encodes the targets
    tokens: SpecialTokens
    trainer: Trainer
    rollout: RolloutEngines

    def evaluate(self, step: int) -> dict[str, float]: ...


def warmup_targets(n: int, answer_pool: Sequence[str], rng: random.Random) -> list[str]:
    """`n` format targets whose answers are drawn uniformly from `answer_pool`.

    The function is never shown a prompt, so a target cannot depend on the prompt it will be paired with.

    Args:
        n: targets to draw.
        answer_pool: the answers to draw from (the training rows' labels: their marginal distribution).
        rng: the source of randomness (seeded by the caller).

    Returns:
        `n` strings `<think></think>\\boxed{a}`.

    Raises:
        ValueError: an empty answer pool.
    """
    if not answer_pool:
        raise ValueError("format warm-up needs at least one training answer to draw placeholder answers from")
    return [WARMUP_TEMPLATE.format(answer=rng.choice(answer_pool)) for _ in range(n)]


def warmup_samples(
    prompts: Sequence[Any], targets: Sequence[str], tokenizer: Any, eos_token_id: int
) -> list[TrainSample]:
    """Train samples `prompt + target + EOS` with advantage 1 (SFT through the policy loss).

    Args:
        prompts: `PromptSample`s (prompt_ids [P], pixel_values, image_grid_thw, pixel_values_videos,
            video_grid_thw), one per target.
        targets: response texts, from `warmup_targets`.
        tokenizer: the processor's tokenizer (no special tokens are added to the target).
        eos_token_id: appended to every response, so that generation learns to stop.

    Returns:
        One `TrainSample` per (prompt, target); `rollout_logprobs` are zeros (no engine sampled these responses, so
        the train metric `train_rollout_logprob_abs_diff` of a warm-up step means nothing and is not logged).
    """
    samples = []
    for p, text in zip(prompts, targets, strict=True):
        response = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"] + [eos_token_id])  # [R]
        samples.append(
            TrainSample(
                input_ids=torch.cat([p.prompt_ids, response]),
                prompt_len=p.prompt_ids.numel(),
                advantage=1.0,
                rollout_logprobs=torch.zeros(response.numel()),
                image_grid_thw=p.image_grid_thw,
                pixel_values=p.pixel_values,
                video_grid_thw=p.video_grid_thw,
                pixel_values_videos=p.pixel_values_videos,
            )
        )
    return samples


def format_warmup(job: WarmupJob) -> dict[str, float]:
    """Run `train.format_warmup_steps` warm-up steps, sync the weights, evaluate; returns the step-0 record."""
    cfg = job.cfg
    t0 = time.perf_counter()
    rng = random.Random(f"miles-vl-format-warmup:{cfg.seed}")  # not the data cursor: RL sees the same data order
    rows = job.train_set.rows
    answer_pool = sorted(r.label for r in rows)  # the multiset of answers, in no row's order
    n_prompts, n = min(cfg.rollout.batch_size, len(rows)), cfg.rollout.n_samples_per_prompt
    eos = job.tokens.eos_token_ids[0]
    warmup_lr = cfg.train.format_warmup_lr
    if warmup_lr is not None:
        job.trainer.set_lr(warmup_lr)
    job.trainer.set_vision_trainable(False)  # targets say nothing about the image: teach the tower nothing from them
    log.info(
        "format warm-up: %d supervised steps of %d targets that teach the answer format, not the task (the vision "
        "tower frozen), then the eval set as step 0",
        cfg.train.format_warmup_steps, n_prompts * n,
    )  # fmt: skip
    for _ in range(cfg.train.format_warmup_steps):
        encoded = [job.train_set[i] for i in rng.sample(range(len(rows)), n_prompts)]
        prompts = [p for p in encoded for _ in range(n)]  # n targets per prompt, like an RL batch
        targets = warmup_targets(len(prompts), answer_pool, rng)
        job.trainer.train(warmup_samples(prompts, targets, job.processor.tokenizer, eos))
    job.trainer.set_vision_trainable(True)
    if warmup_lr is not None:
        job.trainer.set_lr(cfg.train.optimizer.lr)  # RL from here on
    log.info("format warm-up: %d steps in %.1f s", cfg.train.format_warmup_steps, time.perf_counter() - t0)
    job.rollout.sync_weights("step-0")  # loop.weight_version(0): the weights RL step 1 starts from
    record = {
        "step": 0,
        "warmup/steps": float(cfg.train.format_warmup_steps),
        "time/warmup_s": time.perf_counter() - t0,
    }
    return record | job.evaluate(-1)
