"""Contract (issue 18 §4): a job runs with a reward and rows given in Python (`run_job(cfg, reward_fn=...,
dataset=...)`, examples/library.py), the closure reaching the reward workers by value; and with several weighted
`reward.functions`, each logged as `reward/<label>/mean` next to `reward/mean` (their weighted sum)."""

import pytest
import ray

from examples.library import make_rows
from miles_vl.config import ConfigError
from miles_vl.orchestration import run_job
from tests.orchestration.jobs import metrics, tiny_job

IN_MEMORY = ("reward.name=null", "data.synthetic_n=0", "data.in_memory=true", "data.format=geometry3k", "num_steps=1")


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()


def test_run_job_with_an_in_memory_reward_and_dataset(tmp_path):
    seen = 7.0  # captured: the closure must travel by value (it is not importable in a worker)

    def closure_reward(sample, *, scale):
        assert sample.prompt and sample.ground_truth in "0123"  # the whole sample reached the worker
        return seen * scale

    cfg = tiny_job(tmp_path, "lib", *IN_MEMORY, "reward.kwargs.scale=0.5")
    (row,) = metrics(run_job(cfg, reward_fn=closure_reward, dataset=make_rows(8)))
    assert row["reward/mean"] == 3.5 and row["reward/closure_reward/mean"] == 3.5 and row["reward/errors"] == 0


def test_in_memory_inputs_must_match_the_config(tmp_path):
    with pytest.raises(ConfigError, match="run_job got reward_fn= and the config sets reward.name="):
        run_job(tiny_job(tmp_path, "both", "num_steps=1"), reward_fn=lambda s: 1.0)
    with pytest.raises(ConfigError, match="reward.name is null and reward.functions is empty"):
        run_job(tiny_job(tmp_path, "none", *IN_MEMORY), dataset=make_rows(8))


def test_weighted_reward_functions_are_summed_and_logged_each(tmp_path):
    cfg = tiny_job(
        tmp_path,
        "weighted",
        "num_steps=1",
        "reward.name=null",
        "reward.functions=[{name: 'tests.orchestration.rewards:length_reward', weight: 2.0},"
        " {name: 'tests.reward.user_rewards:batched_len', weight: -0.5, kwargs: {bonus: 1.0}, label: blen}]",
    )
    (row,) = metrics(run_job(cfg))
    total = 2.0 * row["reward/length_reward/mean"] - 0.5 * row["reward/blen/mean"]  # the sum of means = mean of sums
    assert row["reward/mean"] == pytest.approx(total) and row["reward/blen/mean"] >= 1.0
