"""The sample a train backend learns from, and how a step's rollouts become such samples (group advantages).

    samples, metrics = to_train_samples(prompts, groups, rewards, estimator="grpo", norm_adv_by_std=True)

Duck-typed inputs (so that algo imports neither data nor rollout): a prompt has `prompt_ids` [P], `image_grid_thw`,
`pixel_values`, `video_grid_thw` and `pixel_values_videos` (`rollout.types.PromptLike`; None without images / videos);
a generation has `response_ids` [R] and `logprobs` [R] (and, continued by a partial rollout, `spans`: (start, end,
weight version label) of each span); a reward has `overall`. Groups are one list per prompt,
`n_samples_per_prompt` long.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import FloatTensor, LongTensor, Tensor

from miles_vl.algo.advantages import Estimator, compute_advantages


@dataclass
class TrainSample:
    """One response with its prompt, ready to be packed. `input_ids = prompt_ids + response_ids`."""

    input_ids: LongTensor  # [L]
    prompt_len: int
    advantage: float
    rollout_logprobs: FloatTensor  # [L - prompt_len] the engine's logprobs of the response tokens
    image_grid_thw: LongTensor | None = None  # [n_images, 3]
    video_grid_thw: LongTensor | None = None
    pixel_values: Tensor | None = None  # [n_patches, C*T*P*P]
    pixel_values_videos: Tensor | None = None
    loss_mask: LongTensor | None = None  # [L]; None: every response token
    weight_version: int = 0  # the weights that sampled it: those after this many RL steps (staleness = step - it)
    # partial rollouts: [R] the weights that sampled each response token (a sample continued after a sync; its
    # `rollout_logprobs` are each token's own engine's); None: all of them `weight_version`
    token_versions: LongTensor | None = None

    @property
    def response_len(self) -> int:
        return self.input_ids.numel() - self.prompt_len


def to_train_samples(
    prompts: Sequence,
    groups: Sequence[Sequence],
    rewards: Sequence[Sequence],
    *,
    estimator: Estimator,
    norm_adv_by_std: bool,
    weight_version: int = 0,
    version_of: Callable[[str | None], int] | None = None,
) -> tuple[list[TrainSample], dict[str, float]]:
    """One `TrainSample` per generation, with its group advantage (fp32; zero for a group whose rewards are all
    equal) and `weight_version` (the RL step of the weights the batch began with: no token of it is older; with
    partial rollouts `token_versions` holds each token's own), and the metric `rollout/zero_adv_group_fraction`.
    `version_of`: a span's weight version label -> its RL step, for `token_versions` (partial rollouts)."""
    flat_rewards = torch.tensor([r.overall for rs in rewards for r in rs], dtype=torch.float32)
    adv = compute_advantages(
        flat_rewards,
        len(groups[0]),
        estimator=estimator,
        norm_adv_by_std=norm_adv_by_std,
        token_counts=torch.tensor([g.response_ids.numel() for gs in groups for g in gs]),
    )
    samples, k = [], 0
    for p, gs in zip(prompts, groups, strict=True):
        for g in gs:
            samples.append(
                TrainSample(
                    input_ids=torch.cat([p.prompt_ids, g.response_ids]),
                    prompt_len=p.prompt_ids.numel(),
                    advantage=float(adv.advantages[k]),
                    rollout_logprobs=g.logprobs,
                    image_grid_thw=p.image_grid_thw,
                    pixel_values=p.pixel_values,
                    video_grid_thw=p.video_grid_thw,
                    pixel_values_videos=p.pixel_values_videos,
                    weight_version=weight_version,
                    token_versions=_token_versions(g, version_of),
                )
            )
            k += 1
    return samples, {"rollout/zero_adv_group_fraction": adv.zero_adv_group_fraction}


def _token_versions(generation, version_of: Callable[[str | None], int] | None) -> LongTensor | None:
    """[R] the RL step of the weights that sampled each token of a continued generation (its `spans`); None for one
    sampled with one version."""
    spans = getattr(generation, "spans", ())
    if not spans or version_of is None:
        return None
    versions = torch.empty(generation.response_ids.numel(), dtype=torch.long)
    for start, end, label in spans:
        versions[start:end] = version_of(label)
    return versions
