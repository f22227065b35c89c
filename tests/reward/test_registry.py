"""Contract: `resolve_reward` finds registered names and `module:function` paths, binds options, and fails early
with a message that names the path and the problem (not found, import failed, attribute missing, not callable,
wrong signature, unknown or invalid option)."""

import asyncio

import pytest

from miles_vl.reward import REWARD_REGISTRY, RewardResolutionError, RewardSample, geo3k_reward, resolve_reward


def test_registered_names():
    assert resolve_reward("geo3k") is geo3k_reward
    assert set(REWARD_REGISTRY) >= {"geo3k", "math"}
    fn = resolve_reward("geo3k", format_weight=0.0, format_pattern=r".*")
    assert fn(RewardSample("\\boxed{2}", "2")).overall == 1.0  # format_weight bound to 0: binary


def test_module_function_path_to_a_test_helper():
    fn = resolve_reward("tests.reward.helpers:exact_match")
    assert fn(RewardSample(" 7 ", "7")) == 1.0
    assert resolve_reward("tests.reward.helpers:Graders.strict")(RewardSample("7", "7")) == 1.0
    assert resolve_reward("tests.reward.helpers:with_bonus", bonus=0.5)(RewardSample("7", "7")) == 1.5
    async_fn = resolve_reward("tests.reward.helpers:async_exact_match")
    assert asyncio.run(async_fn(RewardSample("7", "7"))) == {"overall": 1.0, "accuracy": 1.0}


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("geo4k", {}, r"unknown reward 'geo4k': registered rewards are \[.*'geo3k'"),
        ("tests.reward.helpers:", {}, "is malformed: expected exactly one colon"),
        ("a:b:c", {}, "is malformed"),
        ("tests.reward.no_such_module:f", {}, "module 'tests.reward.no_such_module' not found"),
        ("no_such_top_package.sub:f", {}, "module 'no_such_top_package.sub' not found"),
        ("tests.reward.missing_dependency:f", {}, "imports a missing module .*miles_vl_no_such_dependency"),
        ("tests.reward.broken_import:f", {}, "importing module 'tests.reward.broken_import' raised RuntimeError"),
        ("tests.reward.helpers:nope", {}, r"'tests.reward.helpers' has no attribute 'nope'; callables .*exact_match"),
        ("tests.reward.helpers:Graders.lenient", {}, "'tests.reward.helpers.Graders' has no attribute 'lenient'"),
        ("tests.reward.helpers:NOT_CALLABLE", {}, "resolves to int 42, which is not callable"),
        ("tests.reward.helpers:two_samples", {}, "cannot be called with one sample"),
        ("tests.reward.helpers:no_args", {}, "cannot be called with one sample"),
        ("tests.reward.helpers:exact_match", {"format_weight": 0.1}, "does not take the option 'format_weight'"),
        ("geo3k", {"format_weight": 2.0}, "reward 'geo3k': bad option: format_weight must be in"),
        ("geo3k", {"format_pattern": "[unclosed"}, "reward 'geo3k': bad option: format_pattern .* not a valid"),
        ("geo3k", {"sample": 1}, "cannot be called with one sample"),
        ("tests.reward.helpers:HOLDS_LOCK", {}, "cannot be sent to a worker process .*module level"),
    ],
)
def test_resolution_errors_name_the_problem(name, options, message):
    with pytest.raises(RewardResolutionError, match=message) as info:
        resolve_reward(name, **options)
    assert isinstance(info.value, ValueError)  # config validation catches ValueError
    assert repr(name) in str(info.value) or name in str(info.value)
