"""Contract: `reward.functions` and the one-function form (`reward.name` + kwargs) are never mixed silently, labels
(the metric names) are distinct, weights keep the total reward within the float32 advantages' range
(`MAX_ABS_TOTAL_REWARD`), and rows in memory are declared (`data.in_memory`) rather than guessed."""

import pytest
import torch

from miles_vl.algo.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from miles_vl.config import ConfigError, load_config
from miles_vl.reward.types import MAX_ABS_REWARD, MAX_ABS_TOTAL_REWARD
from tests.orchestration.jobs import REPO

TINY = REPO / "configs" / "geo3k_tiny_cpu.yaml"
TWO = "reward.functions=[{name: geo3k}, {name: 'pkg.mod:Graders.strict', weight: 0.5}]"


def test_functions_with_labels():
    cfg = load_config(TINY, ["reward.name=null", TWO])
    assert [(f.metric_label, f.weight) for f in cfg.reward.functions] == [("geo3k", 1.0), ("strict", 0.5)]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([TWO], "reward.functions is set together with reward.name; use one form"),
        (["reward.name=null", "reward.kwargs.x=1", TWO], "together with reward.kwargs"),
        (["reward.name=null", "reward.functions=[{name: geo3k}, {name: 'a:geo3k'}]"], "labelled \\['geo3k'\\]"),
        (["data.in_memory=true"], "data.in_memory=true takes the rows from run_job"),
    ],
)
def test_mixed_forms_are_refused_with_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, overrides)


def weights_config(*weights: str) -> list[str]:
    functions = ", ".join(f"{{name: geo3k, label: g{k}, weight: {w}}}" for k, w in enumerate(weights))
    return ["reward.name=null", f"reward.functions=[{functions}]"]


def test_a_weight_that_can_overflow_the_advantages_is_refused():
    """Issue 30.9: a weight of 1e39 passed `miles-vl check` and killed the job at step 1 (1e39 * a score is inf in the
    float32 advantages). Refused at validation, naming the key, what was found and the bound."""
    with pytest.raises(ConfigError) as info:
        load_config(TINY, weights_config("0.5", "1e39"))
    (msg,) = info.value.problems
    assert msg.startswith(
        "'reward.functions': reward.functions.1.weight=1e+39: the weights' magnitudes sum to 1e+39, expected at most "
        "1e+06: each function scores within +-1e+06, and a total reward beyond +-1e+12 can overflow the float32 "
        "advantages (they square rewards); scale the weights down"
    )
    # Negative weights count by magnitude; the bound is on the sum, not on each weight.
    for weights in (("-2e6",), ("999999", "1.5")):
        with pytest.raises(ConfigError, match="the weights' magnitudes sum to"):
            load_config(TINY, weights_config(*weights))


def test_large_weights_within_the_bound_are_accepted():
    assert [f.weight for f in load_config(TINY, weights_config("1e5", "-3")).reward.functions] == [1e5, -3.0]
    at_bound = load_config(TINY, weights_config("999999", "1")).reward.functions  # sum |w| = 1e6: total 1e12
    assert sum(abs(f.weight) for f in at_bound) * MAX_ABS_REWARD == MAX_ABS_TOTAL_REWARD


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS)
def test_totals_at_the_bound_keep_every_estimator_finite(estimator):
    """The bound's derivation (reward/types.py), checked: totals of +-MAX_ABS_TOTAL_REWARD, with a billion tokens of
    batch weight for the whitening, give finite float32 advantages under every estimator; 1e39 does not."""
    b = MAX_ABS_TOTAL_REWARD
    rewards = torch.tensor([b, -b, -b, b, b, b, -b, b], dtype=torch.float64)
    tokens = torch.full((8,), 1.25e8)  # T = 1e9
    adv = compute_advantages(rewards, 4, estimator=estimator, token_counts=tokens if "pp" in estimator else None)
    assert adv.advantages.dtype == torch.float32 and bool(torch.isfinite(adv.advantages).all())
    with pytest.raises(ValueError, match="rewards must be finite"):
        compute_advantages(rewards * 1e27, 4, estimator=estimator)
