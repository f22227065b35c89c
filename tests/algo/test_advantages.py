"""Contract: GRPO / Dr.GRPO / RLOO / REINFORCE++-baseline advantages equal their formulas (verl's, written out here as
loops), are fp32, and a group whose rewards are all equal gets exactly 0.0 whatever the estimator; the fraction of
such groups is returned."""

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_vl.algo import compute_advantages, grpo_advantages, reinforce_pp_baseline_advantages, rloo_advantages


def grpo_reference(rewards: list[float], n: int, norm: bool, eps: float = 1e-6) -> list[float]:
    out = []
    for g in range(0, len(rewards), n):
        group = rewards[g : g + n]
        mean = sum(group) / n
        std = statistics.stdev(group) if n > 1 else 0.0  # unbiased, as torch.std
        for r in group:
            out.append(0.0 if len(set(group)) == 1 else ((r - mean) / (std + eps) if norm else r - mean))
    return out


def rpp_reference(rewards: list[float], n: int, counts: list[int] | None) -> list[float]:
    centred = []
    for g in range(0, len(rewards), n):
        group = rewards[g : g + n]
        mean = sum(group) / n if n > 1 else 0.0
        centred += [r - mean for r in group]
    weights = counts or [1] * len(rewards)
    total = sum(weights)
    mean = sum(c * w for c, w in zip(centred, weights, strict=True)) / total
    var = sum((c - mean) ** 2 * w for c, w in zip(centred, weights, strict=True)) / (total - 1)
    out = [(c - mean) / math.sqrt(var + 1e-8) for c in centred]
    for g in range(0, len(rewards), n):
        if n > 1 and len(set(rewards[g : g + n])) == 1:
            out[g : g + n] = [0.0] * n
    return out


REWARDS = [1.0, 0.0, 1.0, 0.0, 0.1, 0.1, 0.1, 0.1, 0.9, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]  # 4 groups of 4


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_reference(norm):
    adv, frac = grpo_advantages(torch.tensor(REWARDS), 4, norm_adv_by_std=norm)
    assert adv.dtype == torch.float32 and adv.shape == (16,)
    assert adv.tolist() == pytest.approx(grpo_reference(REWARDS, 4, norm), abs=1e-6)
    assert frac == 0.5  # groups 1 (all 0.1) and 3 (all 1.0)
    assert torch.equal(adv[4:8], torch.zeros(4)) and torch.equal(adv[12:], torch.zeros(4))


def test_dr_grpo_is_the_unscaled_difference():
    adv, _ = compute_advantages(torch.tensor([3.0, 1.0]), 2, estimator="grpo", norm_adv_by_std=False)
    assert adv.tolist() == [1.0, -1.0]
    adv, _ = compute_advantages(torch.tensor([3.0, 1.0]), 2, estimator="grpo", norm_adv_by_std=True)
    assert adv.tolist() == pytest.approx([1 / (math.sqrt(2) + 1e-6), -1 / (math.sqrt(2) + 1e-6)])


@pytest.mark.parametrize("counts", [None, [3, 5, 2, 7, 1, 1, 4, 4, 9, 2, 2, 2, 6, 1, 1, 8]])
def test_reinforce_pp_baseline_matches_reference(counts):
    token_counts = None if counts is None else torch.tensor(counts)
    adv, frac = compute_advantages(
        torch.tensor(REWARDS), 4, estimator="reinforce_pp_baseline", token_counts=token_counts
    )
    assert adv.dtype == torch.float32
    assert adv.tolist() == pytest.approx(rpp_reference(REWARDS, 4, counts), abs=1e-5)
    assert frac == 0.5
    assert torch.equal(adv[4:8], torch.zeros(4))  # whitening would shift these; they stay exactly 0


def rloo_reference(rewards: list[float], n: int) -> list[float]:
    """RLOO written out: r_i minus the plain mean of the other n - 1 rewards of its group."""
    out = []
    for g in range(0, len(rewards), n):
        group = rewards[g : g + n]
        for i, r in enumerate(group):
            others = group[:i] + group[i + 1 :]
            out.append(r - sum(others) / len(others))
    return out


def test_rloo_matches_leave_one_out_reference():
    adv, frac = compute_advantages(torch.tensor(REWARDS), 4, estimator="rloo")
    assert adv.dtype == torch.float32
    assert adv.tolist() == pytest.approx(rloo_reference(REWARDS, 4), abs=1e-6)
    assert frac == 0.5
    assert torch.equal(adv[4:8], torch.zeros(4))
    # group 0 by hand: [1, 0, 1, 0] -> 1 - (0+1+0)/3 = 2/3, 0 - (1+1+0)/3 = -2/3
    assert adv[:4].tolist() == pytest.approx([2 / 3, -2 / 3, 2 / 3, -2 / 3])
    # = n/(n-1) times the Dr.GRPO advantage
    dr, _ = grpo_advantages(torch.tensor(REWARDS), 4, norm_adv_by_std=False)
    assert torch.allclose(adv, dr * 4 / 3)


def test_rloo_needs_two_samples():
    with pytest.raises(ValueError, match="rloo needs n_samples_per_prompt >= 2"):
        rloo_advantages(torch.tensor([1.0, 0.0]), 1)


def test_reinforce_pp_baseline_without_groups_is_whitened_reinforce():
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0]
    adv, frac = reinforce_pp_baseline_advantages(torch.tensor(rewards), 1)
    assert adv.tolist() == pytest.approx(rpp_reference(rewards, 1, None), abs=1e-6)
    assert frac == 0.0 and abs(float(adv.sum())) < 1e-5


def test_grpo_single_sample_groups_are_zero():
    adv, frac = grpo_advantages(torch.tensor([1.0, 0.0, 0.5]), 1)
    assert torch.equal(adv, torch.zeros(3)) and frac == 1.0


@st.composite
def grouped_rewards(draw):
    n = draw(st.integers(1, 8))
    n_groups = draw(st.integers(1, 6))
    values = st.sampled_from([0.0, 0.1, 1 / 3, 0.9, 1.0, -2.5, 1e-7])
    rewards, identical = [], []
    for _ in range(n_groups):
        if draw(st.booleans()):
            rewards += [draw(values)] * n
            identical.append(True)
        else:
            group = draw(st.lists(values, min_size=n, max_size=n))
            rewards += group
            identical.append(len(set(group)) == 1)
    return n, rewards, identical


@settings(max_examples=150, deadline=None)
@given(grouped_rewards(), st.sampled_from(["grpo", "grpo_dr", "rloo", "reinforce_pp_baseline"]))
def test_identical_groups_get_exactly_zero(case, estimator):
    n, rewards, identical = case
    if estimator == "reinforce_pp_baseline" and (n == 1 or len(rewards) < 2):
        return  # no groups (baseline 0) / nothing to whiten: covered by the tests above
    if estimator == "rloo" and n == 1:
        return  # refused: test_rloo_needs_two_samples
    est = "grpo" if estimator.startswith("grpo") else estimator
    adv, frac = compute_advantages(
        torch.tensor(rewards, dtype=torch.float64), n, estimator=est, norm_adv_by_std=estimator == "grpo"
    )
    assert adv.dtype == torch.float32 and adv.shape == (len(rewards),)
    for g, same in enumerate(identical):
        block = adv[g * n : (g + 1) * n]
        if same or n == 1:
            assert torch.equal(block, torch.zeros(n)), block  # exactly 0.0, not ~1e-9
        else:
            assert bool((block != 0).any())
            if est in ("grpo", "rloo"):
                assert abs(float(block.sum())) < 1e-4  # group-centred
    expected_frac = sum(identical) / len(identical) if n > 1 else 1.0
    assert frac == pytest.approx(expected_frac)


@pytest.mark.parametrize(
    ("rewards", "n", "message"),
    [
        ([1.0, 0.0, 1.0], 2, "3 rewards do not split into groups of n_samples_per_prompt=2"),
        ([[1.0, 0.0]], 2, "must be a non-empty 1-D tensor"),
        ([1.0, float("nan")], 2, "reward 1 is nan"),
        ([1.0, 0.0], 0, "n_samples_per_prompt must be >= 1"),
    ],
)
def test_bad_inputs(rewards, n, message):
    with pytest.raises(ValueError, match=message):
        grpo_advantages(torch.tensor(rewards), n)


def test_unknown_estimator():
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'; known: \\['grpo'"):
        compute_advantages(torch.tensor([1.0, 0.0]), 2, estimator="ppo")
