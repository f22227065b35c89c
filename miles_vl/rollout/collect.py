"""One step's rollouts, scored: generate, reward, keep the groups a filter accepts (DAPO-style dynamic sampling) and
refill from the data until the batch is full or the rounds run out; then the step's rollout and reward metrics.

    batch = collect(train_set.next_batch, generate, score, want=8, keep=has_reward_variance, max_rounds=3,
                    over_sampling_factor=1.5)
    metrics = rollout_metrics(batch, media_token_ids=(image_id, video_id), dynamic_sampling=True)
    batch = trim_to_whole_batches(batch, global_batch_size=16, n_samples_per_prompt=4)   # a short batch after
                                                                                          # max_rounds

`generate(prompts, round)` and `score(prompts, groups)` are the caller's (the driver's engines and reward pool);
`score_groups` is the usual `score`. A filter sees one prompt's rewards (`n_samples_per_prompt` of them) and says
whether to train on the group.

A short batch (the filter kept fewer than `want` groups after `max_rounds`) trains on what was kept in whole
mini-batches: `trim_to_whole_batches` drops the trailing groups that do not fill one, logs a warning and counts them
(`short_batch_dropped_groups`); when not even one mini-batch is left the step trains on nothing (the driver skips
the train phase and says so).

The step's `reward/*` and `rollout/*` statistics describe everything the step generated, in every round, kept or
not (with a filter, kept groups are the ones whose rewards differ: their mean says little of how the policy does);
`rollout/prompts` counts the groups kept, `rollout/generated_prompts` (with dynamic sampling) the groups generated.
A step that keeps nothing logs the real means of what it generated, and 0 kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from miles_vl.reward import RewardSample
from miles_vl.rollout.types import Generation

if TYPE_CHECKING:
    from miles_vl.reward import RewardPool, RewardResult, RewardStats, WeightedRewards

log = logging.getLogger(__name__)

GroupFilter = Callable[[Sequence["RewardResult"]], bool]


def has_reward_variance(rewards: Sequence[RewardResult]) -> bool:
    """Dynamic sampling's filter: a group whose rewards are all equal has zero advantage, so nothing to learn."""
    return len({r.overall for r in rewards}) > 1


@dataclass
class GeneratedGroup:
    """One prompt's generations and their rewards, kept or not: what the step's metrics describe (the prompt's ids
    only, not its pixels and images, so that a refused group's prompt is not held for the rest of the step)."""

    prompt_ids: torch.Tensor  # [L]
    generations: list[Generation]
    rewards: list[RewardResult]
    label: str | None = None  # the reference answer (for the sample files: orchestration/samples.py)
    index: int = -1  # the prompt's row id


@dataclass
class CollectedBatch:
    """The prompts kept, their generations and rewards (one group per prompt), everything generated, and what
    collecting them took."""

    prompts: list
    groups: list[list[Generation]]
    rewards: list[list[RewardResult]]
    reward_stats: list[RewardStats]  # one per scored round
    dropped: int  # groups the filter refused
    rounds: int
    surplus: int = 0  # groups kept beyond `want` by over-sampling, not trained on
    short_batch_dropped: int = 0  # kept groups dropped because they did not fill a whole mini-batch
    generated: list[GeneratedGroup] = dataclasses.field(default_factory=list)  # every group of every round


def round_prompts(missing: int, *, filtered: bool, over_sampling_factor: float) -> int:
    """How many prompts a round of `collect` asks `next_batch` for when `missing` kept prompts are still wanted (the
    driver prefetches the first round's batch of the next step with it)."""
    return math.ceil(over_sampling_factor * missing) if filtered else missing


def collect(
    next_batch: Callable[[int], list],
    generate: Callable[[list, int], list[list[Generation]]],
    score: Callable[[list, list[list[Generation]]], tuple[list[list[RewardResult]], RewardStats]],
    *,
    want: int,
    keep: GroupFilter | None = None,
    max_rounds: int = 0,
    over_sampling_factor: float = 1.0,
    timer: Callable[[str], contextlib.AbstractContextManager] | None = None,
) -> CollectedBatch:
    """Rounds of `next_batch` -> `generate` -> `score` until `want` prompts are kept: one round without a filter;
    with `keep`, groups it refuses are dropped and refilled, at most `max_rounds` extra rounds, and each round asks
    for ceil(over_sampling_factor * missing) prompts (miles' `--over-sampling-batch-size`); groups kept beyond `want`
    are counted as `surplus` and not returned. The seconds of every round's generation and scoring go to `timer` as
    "rollout" and "reward".

    A filter that keeps no group in any round returns an empty batch (counted in `dropped`; the driver skips that
    step's training), never an error: a run whose policy solves (or fails) every prompt of a step goes on.
    """
    timer = timer or (lambda name: contextlib.nullcontext())
    out = CollectedBatch([], [], [], [], 0, 0)
    while len(out.prompts) < want:
        missing = want - len(out.prompts)
        batch = next_batch(round_prompts(missing, filtered=keep is not None, over_sampling_factor=over_sampling_factor))
        with timer("rollout"):
            groups = generate(batch, out.rounds)
        with timer("reward"):
            rewards, stats = score(batch, groups)
        out.reward_stats.append(stats)
        for p, g, r in zip(batch, groups, rewards, strict=True):
            out.generated.append(GeneratedGroup(p.prompt_ids, g, r, p.label, p.index))
            if keep is not None and not keep(r):
                out.dropped += 1
                continue
            if len(out.prompts) == want:
                out.surplus += 1
                continue
            out.prompts.append(p)
            out.groups.append(g)
            out.rewards.append(r)
        out.rounds += 1
        if keep is None or out.rounds > max_rounds:
            break
    if not out.prompts:  # the step trains on nothing (loop.py skips its train phase); the run goes on
        log.warning(
            "dynamic sampling kept no group in %d rounds (every one of %d groups had equal rewards): this step "
            "trains on nothing; if it repeats, raise rollout.dynamic_sampling.max_rounds or check the reward function",
            out.rounds,
            out.dropped,
        )
    return out


def trim_to_whole_batches(
    batch: CollectedBatch, *, global_batch_size: int, n_samples_per_prompt: int
) -> CollectedBatch:
    """The batch cut to the most leading groups whose samples fill whole mini-batches of `global_batch_size` (a
    multiple of global_batch_size / gcd(global_batch_size, n_samples_per_prompt) groups); the groups cut are counted
    in `short_batch_dropped` and logged. A full batch (as the config checks guarantee) comes back unchanged; a batch
    with fewer samples than one mini-batch comes back empty."""
    step = global_batch_size // math.gcd(global_batch_size, n_samples_per_prompt)  # groups per whole unit
    keep = len(batch.prompts) // step * step
    cut = len(batch.prompts) - keep
    if cut == 0:
        return batch
    log.warning(
        "dynamic sampling kept %d groups (%d samples) after %d rounds, not a multiple of global_batch_size=%d "
        "samples: %d groups dropped, training on %d samples%s",
        len(batch.prompts),
        len(batch.prompts) * n_samples_per_prompt,
        batch.rounds,
        global_batch_size,
        cut,
        keep * n_samples_per_prompt,
        " (none: the train phase is skipped this step)" if keep == 0 else "",
    )
    return dataclasses.replace(
        batch,
        prompts=batch.prompts[:keep],
        groups=batch.groups[:keep],
        rewards=batch.rewards[:keep],
        short_batch_dropped=batch.short_batch_dropped + cut,
    )


def score_groups(
    pool: RewardPool | WeightedRewards, decode: Callable[..., str], prompts: Sequence, groups: list[list[Generation]]
) -> tuple[list[list[RewardResult]], RewardStats]:
    """Every response scored by the reward pool (`decode`: the tokenizer's), as one list of results per prompt. The
    samples carry the prompt text, and the prompt's images when a reward asked for them (`pool.images`)."""
    samples = [
        RewardSample(
            decode(g.response_ids, skip_special_tokens=True),
            p.label,
            {"index": p.index, **p.metadata},
            prompt=p.prompt_text,
            images=tuple(p.images) if pool.images else (),
        )
        for p, gs in zip(prompts, groups, strict=True)
        for g in gs
    ]
    results, stats = pool.score(samples)
    n = len(groups[0]) if groups else 0
    return [results[i * n : (i + 1) * n] for i in range(len(groups))], stats


def vision_blocks(prompt_ids: torch.Tensor, media: torch.Tensor) -> int:
    """The contiguous runs of image / video pad tokens in a prompt `[L]`: one per image and one per video frame group,
    the blocks the vision tower attends within (Qwen3-VL's vision attention does not cross images or frames), so
    `scripts/gpu/summarize_run.py` counts its attention FLOPs per block, not over all of a sample's patches."""
    mask = torch.isin(prompt_ids, media)
    return int(mask[:1].sum()) + int((mask[1:] & ~mask[:-1]).sum())


def rollout_metrics(batch: CollectedBatch, *, media_token_ids: Sequence[int], dynamic_sampling: bool) -> dict[str, Any]:
    """`reward/*` and `rollout/*` metrics of everything a batch generated, kept or not (module docstring), and the
    count of groups kept (`rollout/prompts`); `media_token_ids`: image and video pads."""
    flat = [r for group in batch.generated for r in group.rewards]
    gens = [g for group in batch.generated for g in group.generations]
    media = torch.tensor(list(media_token_ids))
    stats = {
        "reward/mean": mean([r.overall for r in flat]),
        "reward/std": float(torch.tensor([r.overall for r in flat]).std()) if len(flat) > 1 else 0.0,
        "reward/errors": float(sum(s.n_errors for s in batch.reward_stats)),
        "reward/timeouts": float(sum(s.n_timeouts for s in batch.reward_stats)),
        "rollout/prompts": float(len(batch.prompts)),
        "rollout/response_len_mean": mean([g.response_ids.numel() for g in gens]),
        "rollout/truncated_fraction": mean([g.finish_reason == "length" for g in gens]),
        "rollout/response_tokens": float(sum(g.response_ids.numel() for g in gens)),
        "rollout/visual_tokens_per_sample": mean([int(torch.isin(g.prompt_ids, media).sum()) for g in batch.generated]),
        "rollout/vision_blocks_per_sample": mean([vision_blocks(g.prompt_ids, media) for g in batch.generated]),
        # the longest prompt + response: what a long-context run must carry through the trainer
        "rollout/sample_len_max": float(
            max(
                (g.prompt_ids.numel() + r.response_ids.numel() for g in batch.generated for r in g.generations),
                default=0,
            )
        ),
    }
    for part in ("accuracy", "format"):
        values = [getattr(r, part) for r in flat if getattr(r, part) is not None]
        if values:
            stats[f"reward/{part}"] = mean(values)
    for key in dict.fromkeys(k for r in flat for k in r.by_function):  # each function of reward.functions
        name = key if "/" in key else f"{key}/mean"  # `<label>` is its overall, `<label>/accuracy` a part
        stats[f"reward/{name}"] = mean([r.by_function[key] for r in flat if key in r.by_function])
    if dynamic_sampling:
        stats["rollout/dynamic_sampling_drop_rate"] = batch.dropped / max(batch.dropped + len(batch.prompts), 1)
        stats["rollout/surplus_groups"] = float(batch.surplus)
        stats["rollout/generated_prompts"] = float(len(batch.generated))
    return stats


def mean(values) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else 0.0
