"""Contract: each KL estimator equals its formula per token (k3 unclamped, low_var_kl clamped as verl), and TIS
weights are min(ratio, cap) (clip) or ratio with tokens above the cap zeroed (mask), without gradient."""

import math

import pytest
import torch

from miles_vl.algo import kl_penalty, tis_weights

LP = [-0.1, -2.0, -0.5, -30.0, -0.01]
REF = [-0.3, -1.0, -0.5, -0.2, -25.0]


def formula(estimator: str, lp: float, ref: float) -> float:
    x = ref - lp
    if estimator == "k1":
        return lp - ref
    if estimator == "k2":
        return 0.5 * x * x
    if estimator == "k3":
        return math.exp(x) - x - 1
    x = min(max(x, -20.0), 20.0)  # low_var_kl
    return min(max(math.exp(x) - x - 1, -10.0), 10.0)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_estimators_match_formulas(estimator):
    lp = torch.tensor(LP, dtype=torch.float64, requires_grad=True)
    out = kl_penalty(lp, torch.tensor(REF, dtype=torch.float64), estimator)
    assert out.shape == (5,)
    assert out.tolist() == pytest.approx([formula(estimator, a, b) for a, b in zip(LP, REF, strict=True)], rel=1e-12)
    out.sum().backward()  # differentiable in the policy logprobs
    assert lp.grad is not None


def test_low_var_kl_is_clamped_and_k3_is_not():
    lp, ref = torch.tensor([-30.0]), torch.tensor([-0.2])  # x = 29.8: k3 is astronomically large
    assert kl_penalty(lp, ref, "low_var_kl").item() == 10.0
    assert kl_penalty(lp, ref, "k3").item() > 1e12
    same = torch.tensor([-1.5, -0.2])
    for estimator in ("k1", "k2", "k3", "low_var_kl"):
        assert torch.equal(kl_penalty(same, same, estimator), torch.zeros(2))  # no divergence, no penalty


def test_kl_errors():
    with pytest.raises(ValueError, match="unknown kl_estimator 'k4'"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "k4")
    with pytest.raises(ValueError, match="must have the same shape"):
        kl_penalty(torch.zeros(2), torch.zeros(3), "k1")


OLD = [-1.0, -1.0, -1.0, -0.2, -3.0]
ROLLOUT = [-1.0, -1.5, -2.0, -0.1, -0.5]  # ratios 1, e^0.5=1.65, e^1=2.72, e^-0.1, e^-2.5


@pytest.mark.parametrize("mode", ["clip", "mask"])
def test_tis_weights_match_formula(mode):
    old = torch.tensor(OLD, requires_grad=True)
    weights, capped = tis_weights(old, torch.tensor(ROLLOUT), mode=mode, cap=2.0)
    ratios = [math.exp(o - r) for o, r in zip(OLD, ROLLOUT, strict=True)]
    if mode == "clip":
        expected = [min(x, 2.0) for x in ratios]
    else:
        expected = [x if x <= 2.0 else 0.0 for x in ratios]
    assert weights.tolist() == pytest.approx(expected, rel=1e-6)
    assert capped.tolist() == [False, False, True, False, False]
    assert not weights.requires_grad


def test_tis_errors():
    with pytest.raises(ValueError, match="unknown TIS mode 'truncate'"):
        tis_weights(torch.zeros(2), torch.zeros(2), mode="truncate", cap=2.0)
    with pytest.raises(ValueError, match="TIS cap must be > 0"):
        tis_weights(torch.zeros(2), torch.zeros(2), mode="clip", cap=0.0)
