"""Contract: `policy_loss` equals a plain per-sequence, per-token reference of PPO clip (asymmetric), dual clip, KL
(each estimator), entropy bonus and TIS (clip/mask) under both reductions; its metrics equal their loop
definitions; zero advantages give zero loss and gradient; and one SGD step moves the taken token's logprob in the
direction of the advantage's sign."""

import itertools
import math

import pytest
import torch

from miles_vl.algo import (
    LossDenominators,
    combine_metrics,
    loss_denominators,
    loss_token_weights,
    policy_loss,
    sequence_loss_tokens,
)
from tests.algo.batches import FlatBatch, random_flat_batch

CLIP_LOW, CLIP_HIGH = 0.2, 0.28


def reference_token_loss(lp, old, adv, *, dual_c, ref, kl_coef, estimator, ent, ent_coef, rollout, tis_mode, cap):
    """One token's loss, by cases (independent of the max/min form in the code)."""
    r = math.exp(lp - old)
    if adv >= 0:
        pg = -adv * min(r, 1 + CLIP_HIGH)  # gains stop above 1 + clip_high
    else:
        pg = -adv * max(r, 1 - CLIP_LOW)  # losses stop below 1 - clip_low
        if dual_c is not None:
            pg = min(pg, -adv * dual_c)  # and are bounded by c
    if tis_mode is not None:
        w = math.exp(old - rollout)
        pg *= min(w, cap) if tis_mode == "clip" else (w if w <= cap else 0.0)
    x = ref - lp
    kl = {
        "k1": -x,
        "k2": 0.5 * x * x,
        "k3": math.exp(x) - x - 1,
        "low_var_kl": min(max(math.exp(max(min(x, 20), -20)) - max(min(x, 20), -20) - 1, -10), 10),
    }[estimator]
    return pg + kl_coef * kl - ent_coef * ent


def reference_loss(b: FlatBatch, reduction: str, **opts) -> float:
    lp, old, ref, rollout = (
        b.logprobs().tolist(),
        b.old_logprobs.tolist(),
        b.ref_logprobs.tolist(),
        b.rollout_logprobs.tolist(),
    )
    ent, adv, mask, ids = b.entropy().tolist(), b.advantages.tolist(), b.loss_mask.tolist(), b.seq_ids.tolist()
    per_seq: dict[int, list[float]] = {}
    for t in range(len(mask)):
        if mask[t]:
            per_seq.setdefault(ids[t], []).append(
                reference_token_loss(lp[t], old[t], adv[t], ref=ref[t], ent=ent[t], rollout=rollout[t], **opts)
            )
    if reduction == "token_mean":
        tokens = [x for losses in per_seq.values() for x in losses]
        return sum(tokens) / len(tokens)
    return sum(sum(losses) / len(losses) for losses in per_seq.values()) / len(per_seq)


def weights_for(b: FlatBatch, reduction: str) -> torch.Tensor:
    counts = sequence_loss_tokens(b.loss_mask, b.seq_ids, b.n_seqs)
    return loss_token_weights(b.loss_mask, b.seq_ids, counts, loss_denominators(counts), reduction=reduction)


def run(b: FlatBatch, reduction: str, *, dual_c, kl_coef, estimator, ent_coef, tis_mode, cap=1.5):
    return policy_loss(
        b.logprobs(),
        b.old_logprobs,
        b.advantages,
        weights_for(b, reduction),
        clip_low=CLIP_LOW,
        clip_high=CLIP_HIGH,
        dual_clip_c=dual_c,
        ref_logprobs=b.ref_logprobs,
        kl_coef=kl_coef,
        kl_estimator=estimator,
        entropy=b.entropy(),
        entropy_coef=ent_coef,
        rollout_logprobs=b.rollout_logprobs,
        tis_mode=tis_mode,
        tis_cap=cap,
    )


CASES = [
    # (dual_c, kl_coef, estimator, ent_coef, tis_mode)
    (None, 0.0, "low_var_kl", 0.0, None),  # plain PPO clip
    (1.5, 0.0, "k1", 0.0, None),  # dual clip
    (None, 0.1, "k1", 0.0, None),
    (None, 0.1, "k2", 0.0, None),
    (None, 0.1, "k3", 0.0, None),
    (None, 0.1, "low_var_kl", 0.0, None),
    (None, 0.0, "k1", 0.01, None),  # entropy bonus
    (None, 0.0, "k1", 0.0, "clip"),
    (1.5, 0.05, "k3", 0.01, "mask"),  # everything at once
]


@pytest.mark.parametrize(("reduction", "case"), list(itertools.product(["token_mean", "seq_mean_token_mean"], CASES)))
def test_loss_matches_reference(reduction, case):
    dual_c, kl_coef, estimator, ent_coef, tis_mode = case
    for seed in range(3):
        b = random_flat_batch(seed, n_seqs=6, zero_adv_seq=2)
        out = run(
            b, reduction, dual_c=dual_c, kl_coef=kl_coef, estimator=estimator, ent_coef=ent_coef, tis_mode=tis_mode
        )
        expected = reference_loss(
            b,
            reduction,
            dual_c=dual_c,
            kl_coef=kl_coef,
            estimator=estimator,
            ent_coef=ent_coef,
            tis_mode=tis_mode,
            cap=1.5,
        )
        assert out.loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
        m = out.metrics
        assert (m.pg_loss + m.kl_loss + m.entropy_loss).item() == pytest.approx(out.loss.item(), rel=1e-5, abs=1e-7)


def test_reductions_differ_and_weight_sequences_as_documented():
    # Two sequences: 1 token with loss 1.0, 3 tokens with loss 0.0 (via advantage -1 at ratio 1: pg = 1).
    mask = torch.tensor([1, 1, 1, 1])
    ids = torch.tensor([0, 1, 1, 1])
    adv = torch.tensor([-1.0, 0.0, 0.0, 0.0])
    lp = torch.zeros(4)
    counts = sequence_loss_tokens(mask, ids, 2)
    den = loss_denominators(counts)
    assert den == LossDenominators(n_seqs=2, n_tokens=4, n_samples=2)
    token = policy_loss(
        lp, lp, adv, loss_token_weights(mask, ids, counts, den, reduction="token_mean"), clip_low=0.2, clip_high=0.2
    )
    seq = policy_loss(
        lp,
        lp,
        adv,
        loss_token_weights(mask, ids, counts, den, reduction="seq_mean_token_mean"),
        clip_low=0.2,
        clip_high=0.2,
    )
    assert token.loss.item() == pytest.approx(1 / 4)  # one token of four
    assert seq.loss.item() == pytest.approx(1 / 2)  # one sequence of two


def test_metrics_match_loop_definitions():
    b = random_flat_batch(7, n_seqs=6)
    out = run(b, "seq_mean_token_mean", dual_c=1.5, kl_coef=0.1, estimator="k3", ent_coef=0.01, tis_mode="clip")
    d = out.metrics.as_dict()
    lp, old = b.logprobs().tolist(), b.old_logprobs.tolist()
    tokens = [t for t in range(len(lp)) if b.loss_mask[t]]
    ratio = [math.exp(lp[t] - old[t]) for t in tokens]
    adv = [float(b.advantages[t]) for t in tokens]
    n = len(tokens)
    low = sum(1 for a, r in zip(adv, ratio, strict=True) if a < 0 and r < 1 - CLIP_LOW) / n
    high = sum(1 for a, r in zip(adv, ratio, strict=True) if a > 0 and r > 1 + CLIP_HIGH) / n
    assert low > 0 and high > 0 and d["dual_clip_frac"] > 0 and d["tis_capped_frac"] > 0  # every branch is hit
    assert d["n_loss_tokens"] == n
    assert d["clip_frac_low"] == pytest.approx(low) and d["clip_frac_high"] == pytest.approx(high)
    assert d["clip_frac"] == pytest.approx(low + high)
    assert d["dual_clip_frac"] == pytest.approx(
        sum(1 for a, r in zip(adv, ratio, strict=True) if a < 0 and r > 1.5) / n
    )
    assert d["ratio_mean"] == pytest.approx(sum(ratio) / n, rel=1e-5)
    assert d["ratio_max"] == pytest.approx(max(ratio), rel=1e-5) and d["ratio_min"] == pytest.approx(
        min(ratio), rel=1e-5
    )
    assert d["approx_kl"] == pytest.approx(sum(old[t] - lp[t] for t in tokens) / n, rel=1e-5, abs=1e-7)
    rollout = b.rollout_logprobs.tolist()
    assert d["train_rollout_logprob_abs_diff"] == pytest.approx(
        sum(abs(old[t] - rollout[t]) for t in tokens) / n, rel=1e-5
    )
    tis = [min(math.exp(old[t] - rollout[t]), 1.5) for t in tokens]
    assert d["tis_weight_mean"] == pytest.approx(sum(tis) / n, rel=1e-5)
    assert d["tis_weight_max"] == pytest.approx(max(tis), rel=1e-5)  # issue 34: the weights' max, logged
    assert d["tis_capped_frac"] == pytest.approx(sum(1 for t in tokens if math.exp(old[t] - rollout[t]) > 1.5) / n)
    ent = b.entropy().tolist()
    assert d["entropy"] == pytest.approx(sum(ent[t] for t in tokens) / n, rel=1e-5)
    assert set(d) >= {"loss", "pg_loss", "kl_loss", "entropy_loss", "ref_kl"}
    assert all(isinstance(v, float) for v in d.values())


def test_optional_metrics_absent_without_their_inputs():
    lp = torch.tensor([-1.0, -2.0])
    d = policy_loss(lp, lp, torch.ones(2), torch.full((2,), 0.5), clip_low=0.2, clip_high=0.2).metrics.as_dict()
    for key in (
        "ref_kl",
        "entropy",
        "tis_weight_mean",
        "tis_weight_max",
        "train_rollout_logprob_abs_diff",
        "dual_clip_frac",
    ):
        assert key not in d
    assert d["ratio_mean"] == 1.0 and d["clip_frac"] == 0.0


def test_zero_advantage_gives_zero_loss_and_gradient():
    b = random_flat_batch(3, n_seqs=4)
    b.advantages = torch.zeros_like(b.advantages)
    for tis_mode, dual_c in ((None, None), ("mask", 3.0)):
        b.logits.grad = None
        out = run(b, "token_mean", dual_c=dual_c, kl_coef=0.0, estimator="k1", ent_coef=0.0, tis_mode=tis_mode)
        out.loss.backward()
        assert out.loss.item() == 0.0
        assert torch.equal(b.logits.grad, torch.zeros_like(b.logits))


def one_token_grad(lp_minus_old: float, adv: float, **kwargs) -> tuple[float, float]:
    """(loss, d loss / d logprob) for a single token with the given log-ratio and advantage."""
    lp = torch.tensor([lp_minus_old], requires_grad=True)
    out = policy_loss(lp, torch.zeros(1), torch.tensor([adv]), torch.ones(1), **kwargs)
    out.loss.backward()
    return out.loss.item(), lp.grad.item()


def test_clip_low_and_clip_high_are_asymmetric():
    kw = {"clip_low": 0.2, "clip_high": 0.28}
    # A > 0: the ceiling is 1.28. Ratio 1.25 still learns, ratio 1.30 is clipped (no gradient).
    loss, grad = one_token_grad(math.log(1.25), 1.0, **kw)
    assert loss == pytest.approx(-1.25) and grad == pytest.approx(-1.25)
    loss, grad = one_token_grad(math.log(1.30), 1.0, **kw)
    assert loss == pytest.approx(-1.28) and grad == 0.0
    # A < 0: the floor is 0.8. Ratio 0.85 still learns, 0.75 is clipped. A symmetric 0.28 would not clip 0.75.
    loss, grad = one_token_grad(math.log(0.85), -1.0, **kw)
    assert loss == pytest.approx(0.85) and grad == pytest.approx(0.85)
    loss, grad = one_token_grad(math.log(0.75), -1.0, **kw)
    assert loss == pytest.approx(0.8) and grad == 0.0
    _, grad = one_token_grad(math.log(0.75), -1.0, clip_low=0.28, clip_high=0.28)
    assert grad != 0.0
    # The clip is one-sided: A > 0 below the floor and A < 0 above the ceiling keep the unclipped ratio.
    assert one_token_grad(math.log(0.5), 1.0, **kw) == pytest.approx((-0.5, -0.5))
    assert one_token_grad(math.log(1.5), -1.0, **kw) == pytest.approx((1.5, 1.5))


def test_dual_clip_bounds_negative_advantage_loss():
    kw = {"clip_low": 0.2, "clip_high": 0.28}
    assert one_token_grad(math.log(5.0), -2.0, **kw) == pytest.approx((10.0, 10.0))  # unbounded without dual clip
    loss, grad = one_token_grad(math.log(5.0), -2.0, dual_clip_c=3.0, **kw)
    assert loss == pytest.approx(6.0) and grad == 0.0  # -A * c, no gradient
    assert one_token_grad(math.log(2.0), -2.0, dual_clip_c=3.0, **kw) == pytest.approx((4.0, 4.0))  # below c
    assert one_token_grad(math.log(5.0), 2.0, dual_clip_c=3.0, **kw) == pytest.approx((-1.28 * 2, 0.0))  # A > 0


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_one_sgd_step_moves_the_taken_token_with_the_advantage(advantage):
    torch.manual_seed(0)
    logits = torch.randn(6, requires_grad=True)  # a one-state policy over 6 tokens
    taken = torch.tensor([2, 2, 4])  # three sampled tokens
    adv = torch.full((3,), advantage)
    adv[2] = 0.0  # the third token carries no signal

    def logprob_of_taken() -> torch.Tensor:
        return torch.log_softmax(logits, -1)[taken]

    before = logprob_of_taken().detach()
    out = policy_loss(
        logprob_of_taken(), before, adv, torch.full((3,), 1 / 3), clip_low=0.2, clip_high=0.28, kl_coef=0.0
    )
    out.loss.backward()
    with torch.no_grad():
        logits -= 0.1 * logits.grad
    after = logprob_of_taken().detach()
    assert math.copysign(1.0, float(after[0] - before[0])) == advantage  # token 2 up for A > 0, down for A < 0


def test_combine_metrics_adds_sums_and_takes_extremes():
    b = random_flat_batch(11, n_seqs=4)
    kw = {"dual_c": None, "kl_coef": 0.1, "estimator": "k2", "ent_coef": 0.0, "tis_mode": "clip"}
    whole = run(b, "token_mean", **kw).metrics
    weights = weights_for(b, "token_mean")
    half = b.loss_mask.numel() // 2
    parts = []
    for sl in (slice(0, half), slice(half, None)):
        parts.append(
            policy_loss(
                b.logprobs()[sl],
                b.old_logprobs[sl],
                b.advantages[sl],
                weights[sl],
                clip_low=CLIP_LOW,
                clip_high=CLIP_HIGH,
                ref_logprobs=b.ref_logprobs[sl],
                kl_coef=0.1,
                kl_estimator="k2",
                entropy=b.entropy()[sl],
                rollout_logprobs=b.rollout_logprobs[sl],
                tis_mode="clip",
                tis_cap=1.5,
            ).metrics
        )
    combined = combine_metrics(parts).as_dict()
    assert "tis_weight_max" in combined  # a max over the parts, not a sum (issue 34)
    for key, value in whole.as_dict().items():
        assert combined[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    with pytest.raises(ValueError, match="set in some parts and None in others"):
        combine_metrics([parts[0], run(b, "token_mean", **kw | {"dual_c": 3.0}).metrics])


def test_empty_shard_metrics():
    empty = policy_loss(torch.zeros(3), torch.zeros(3), torch.ones(3), torch.zeros(3), clip_low=0.2, clip_high=0.2)
    assert empty.loss.item() == 0.0
    d = empty.metrics.as_dict()
    assert d["n_loss_tokens"] == 0.0 and math.isnan(d["ratio_mean"]) and math.isnan(d["ratio_max"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"clip_low": 1.0}, r"clip_low must be in \(0, 1\), found 1.0"),
        ({"clip_high": 0.0}, "clip_high must be > 0"),
        ({"dual_clip_c": 1.0}, "dual_clip_c must be > 1"),
        ({"kl_coef": 0.1}, "kl_coef=0.1 needs ref_logprobs"),
        ({"entropy_coef": 0.1}, "entropy_coef=0.1 needs the per-token entropy"),
        ({"tis_mode": "clip"}, "tis_mode='clip' needs rollout_logprobs"),
        ({"ref_logprobs": torch.zeros(3)}, r"ref_logprobs has shape \(3,\), logprobs \(2,\)"),
    ],
)
def test_argument_errors(kwargs, message):
    args = {"clip_low": 0.2, "clip_high": 0.28} | kwargs
    with pytest.raises(ValueError, match=message):
        policy_loss(torch.zeros(2), torch.zeros(2), torch.ones(2), torch.ones(2), **args)
