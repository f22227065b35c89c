"""Contract: the config picks the rollout engine, the train backend and the reward's options from one table each
(orchestration/factories.py): `reward.kwargs` reach any reward, geo3k's own keys reach geo3k only."""

from miles_vl.orchestration.factories import ENGINES, TRAIN_BACKENDS, reward_options
from miles_vl.reward import resolve_reward
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
