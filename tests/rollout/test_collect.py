"""Contract of dynamic sampling's collection: each round over-samples ceil(factor * missing) prompts, groups beyond
`want` are surplus, and a short batch is cut to whole mini-batches of whole groups, counting what was cut."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from miles_vl.reward import RewardResult
from miles_vl.rollout.collect import collect, has_reward_variance, trim_to_whole_batches


class Prompt(int):
    """A prompt that is its index (tests compare prompts with ints) and has ids: one image token (7) per 3 of index."""

    @property
    def prompt_ids(self) -> torch.Tensor:
        return torch.tensor([1] + [7] * (self // 3))

    label = "A"

    @property
    def index(self) -> int:
        return int(self)


def fake_run(flat: set[int]):
    """Prompts are ints from a counter; prompts in `flat` get equal rewards (dropped by the filter)."""
    cursor, asked = [0], []

    def next_batch(k):
        asked.append(k)
        out = [Prompt(i) for i in range(cursor[0], cursor[0] + k)]
        cursor[0] += k
        return out

    def generate(prompts, round_):
        return [[SimpleNamespace(response_ids=torch.tensor([1]), finish_reason="stop")] * 2 for _ in prompts]

    def score(prompts, groups):
        reward = lambda p, j: RewardResult(overall=1.0 if p in flat else float(j))  # noqa: E731
        return [[reward(p, j) for j in range(2)] for p in prompts], SimpleNamespace(n_errors=0, n_timeouts=0)

    return next_batch, generate, score, asked


def test_over_sampling_asks_factor_times_the_missing_prompts():
    next_batch, generate, score, asked = fake_run(flat={0, 1, 2})
    out = collect(next_batch, generate, score, want=4, keep=has_reward_variance, max_rounds=3, over_sampling_factor=1.5)
    # round 1: ceil(1.5*4)=6 prompts 0..5, keeps 3..5 (3); round 2: ceil(1.5*1)=2 prompts 6,7: keeps 6, 7 is surplus
    assert asked == [6, 2]
    assert out.prompts == [3, 4, 5, 6] and out.dropped == 3 and out.surplus == 1 and out.rounds == 2


def test_short_batch_is_cut_to_whole_mini_batches():
    next_batch, generate, score, _ = fake_run(flat={0, 2, 4, 6, 8})
    out = collect(next_batch, generate, score, want=4, keep=has_reward_variance, max_rounds=1)
    assert out.prompts == [1, 3, 5]  # round 1: 0..3 keeps 1, 3; round 2: 4, 5 keeps 5; then max_rounds is reached
    # n=2, global_batch_size=4: whole mini-batches hold 2 groups -> keep 2 groups, cut 1
    cut = trim_to_whole_batches(out, global_batch_size=4, n_samples_per_prompt=2)
    assert cut.prompts == [1, 3] and len(cut.groups) == len(cut.rewards) == 2 and cut.short_batch_dropped == 1
    # n=4, global_batch_size=6: lcm 12 samples = 3 groups -> all three kept
    assert trim_to_whole_batches(out, global_batch_size=6, n_samples_per_prompt=4).short_batch_dropped == 0
    # fewer samples than one mini-batch: nothing left
    none = trim_to_whole_batches(out, global_batch_size=8, n_samples_per_prompt=2)
    assert none.prompts == [] and none.short_batch_dropped == 3


def test_a_filter_that_keeps_nothing_is_an_empty_step_not_an_error(caplog):
    """Every group with equal rewards in every round (a policy that solves or fails all): an empty batch with every
    group counted as dropped, a warning naming the fix, and the metrics of an empty step (the driver then skips its
    train phase, `train/skipped_steps`); the run goes on."""
    from miles_vl.rollout.collect import rollout_metrics

    next_batch, generate, score, asked = fake_run(flat=set(range(100)))
    with caplog.at_level("WARNING"):
        out = collect(next_batch, generate, score, want=4, keep=has_reward_variance, max_rounds=2)
    assert out.prompts == [] and out.groups == [] and out.rewards == [] and out.dropped == 12 and out.rounds == 3
    assert asked == [4, 4, 4]
    assert "kept no group in 3 rounds" in caplog.text and "rollout.dynamic_sampling.max_rounds" in caplog.text
    trimmed = trim_to_whole_batches(out, global_batch_size=4, n_samples_per_prompt=2)
    assert trimmed.prompts == [] and trimmed.short_batch_dropped == 0
    stats = rollout_metrics(trimmed, media_token_ids=[7], dynamic_sampling=True)
    assert stats["rollout/prompts"] == 0.0 and stats["rollout/dynamic_sampling_drop_rate"] == 1.0


def test_a_step_that_keeps_nothing_logs_what_it_generated():
    """Issue 30.14: dynamic sampling that kept no group logged `reward/mean` and `rollout/response_len_mean` as 0.0
    (means over the kept groups: none). The reward and rollout statistics are those of every generated sample, in
    every round; the kept count, 0, is `rollout/prompts`."""
    from miles_vl.rollout.collect import rollout_metrics

    seen: list = []  # (prompt, response length, reward) of every generated sample

    def generate(prompts, round_):  # responses of 1 + (p + j) % 5 tokens, the last one cut at the length limit
        return [
            [SimpleNamespace(response_ids=torch.ones(1 + (p + j) % 5), finish_reason="length" if j else "stop")
             for j in range(2)]
            for p in prompts
        ]  # fmt: skip

    def score(prompts, groups):  # equal within a group (the filter drops every one), different across groups
        rewards = [[RewardResult(overall=p / 10)] * 2 for p in prompts]
        for p, gs, rs in zip(prompts, groups, rewards, strict=True):
            seen.extend((p, g.response_ids.numel(), r.overall) for g, r in zip(gs, rs, strict=True))
        return rewards, SimpleNamespace(n_errors=0, n_timeouts=0)

    next_batch, _, _, _ = fake_run(flat=set())
    out = collect(next_batch, generate, score, want=4, keep=has_reward_variance, max_rounds=2)
    stats = rollout_metrics(out, media_token_ids=[7], dynamic_sampling=True)
    assert out.prompts == [] and len(seen) == 3 * 4 * 2  # 3 rounds of 4 prompts, 2 samples each: none kept
    assert stats["rollout/prompts"] == 0.0 and stats["rollout/generated_prompts"] == 12.0
    assert stats["reward/mean"] == sum(r for _, _, r in seen) / len(seen) != 0.0  # prompts 0..11: 0.55
    assert stats["rollout/response_len_mean"] == sum(n for _, n, _ in seen) / len(seen) != 0.0
    assert stats["rollout/response_tokens"] == sum(n for _, n, _ in seen)
    assert stats["rollout/truncated_fraction"] == 0.5
    assert stats["rollout/visual_tokens_per_sample"] == sum(p // 3 for p in range(12)) / 12  # 1.5
    assert stats["rollout/vision_blocks_per_sample"] == 9 / 12  # prompts 3..11 have one run of image tokens
    assert (
        stats["rollout/sample_len_max"] == max(1 + p // 3 + n for p, n, _ in seen) == 9
    )  # prompt 9: 4 ids + 5 response tokens


@pytest.mark.parametrize(
    "ids, blocks",
    [
        ([1, 2, 3], 0),
        ([7, 7, 1], 1),  # a run at the start
        ([1, 7, 7, 7, 2], 1),
        ([1, 7, 7, 2, 8, 8, 3, 7], 3),  # two images and a video frame group (8), the last run at the end
        ([7, 8, 1], 1),  # image and video pads touching: one run (a processor never writes this)
    ],
)
def test_vision_blocks_are_the_runs_of_media_tokens(ids, blocks):
    """The vision tower's attention blocks of a prompt, for the MFU's vision attention term (summarize_run.py)."""
    from miles_vl.rollout.collect import vision_blocks

    assert vision_blocks(torch.tensor(ids), torch.tensor([7, 8])) == blocks
