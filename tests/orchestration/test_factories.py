"""Contract: the config picks the rollout engine, the train backend and the reward's options from one table each
(orchestration/factories.py): `reward.kwargs` reach any reward, geo3k's own keys reach geo3k only."""

import pytest

from miles_vl.orchestration.factories import ENGINES, TRAIN_BACKENDS, actor_class, reward_options
from miles_vl.reward import resolve_reward
from miles_vl.rollout.sglang import SGLangRolloutHost
from tests.orchestration.jobs import tiny_job


def test_every_backend_name_of_the_schema_has_a_table_entry(tmp_path):
    cfg = tiny_job(tmp_path, "x")
    for field, table in (("rollout", ENGINES), ("train", TRAIN_BACKENDS)):
        names = type(getattr(cfg, field)).model_fields["backend"].annotation.__args__
        assert set(names) == set(table), field


def test_reward_kwargs_reach_any_reward_and_geo3k_keys_only_geo3k(tmp_path):
    geo3k = tiny_job(tmp_path, "x", "reward.name=geo3k", "reward.format_weight=0.3", "reward.kwargs.format_pattern=.*")
    assert reward_options(geo3k) == {"format_weight": 0.3, "format_pattern": ".*"}
    resolve_reward(geo3k.reward.name, **reward_options(geo3k))  # binds and validates
    custom = tiny_job(tmp_path, "x", "reward.format_weight=0.3", "reward.kwargs.scale=2")
    assert custom.reward.name == "tests.orchestration.rewards:length_reward"
    assert reward_options(custom) == {"scale": 2}


def test_the_ray_actor_class_wraps_the_host_without_starting_ray():
    ray = pytest.importorskip("ray")  # a project dependency; only bare GPU images lack it

    actor = actor_class(SGLangRolloutHost)
    assert callable(actor.remote) and callable(actor.options)
    assert callable(actor.options(num_gpus=1, max_restarts=0).remote)  # launch_sglang's per-engine options
    assert not ray.is_initialized()
