"""Contract: the config picks the rollout engine, the train backend and the reward's options from one table each
(orchestration/factories.py): `reward.kwargs` reach any reward, geo3k's own keys reach geo3k only; an engine's row
gives the weight sync its group opener and timeouts."""

import pytest

from miles_vl.orchestration.factories import ENGINES, TRAIN_BACKENDS, EngineKind, actor_class, launch_hf, reward_options
from miles_vl.reward import resolve_reward
from miles_vl.rollout.sglang import SGLangRolloutHost
from miles_vl.rollout.sglang.weights import open_colocated_sender, open_trainer_group
from miles_vl.rollout.weight_sync import (
    GroupSync,
    NcclWeightSync,
    TensorWeightSync,
    WeightSyncOptions,
    make_weight_sync,
)
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


def open_stand_in_group(engines, **options):
    """A new engine's group opener (never called here: the train actor calls it)."""
    raise AssertionError("not called in this test")


def test_the_engine_row_gives_the_weight_sync_its_group_opener_and_timeouts(tmp_path):
    """Issue 31.3: the trainer side of a broadcast sync comes from the engine's row of the table, not from
    weight_sync.py: sglang's row gives SGLang's `open_trainer_group` with `rollout.sglang.request_timeout_s` and
    `sync_timeout_s` when disaggregated; colocated, and for hf, the weights go through the driver; a new engine's row
    with its own opener is taken as it is."""
    sglang = ("rollout.backend=sglang", "rollout.gpus_per_engine=1")
    timeouts = ("rollout.sglang.request_timeout_s=31", "rollout.sglang.sync_timeout_s=7")
    apart = tiny_job(tmp_path, "x", *sglang, *timeouts, "ray.placement=disaggregate")
    assert ENGINES["sglang"].weight_group(apart) == GroupSync(open_trainer_group, 31, 7)
    assert ENGINES["hf"].weight_group(tiny_job(tmp_path, "x", "ray.placement=disaggregate")) is None
    assert ENGINES["hf"].weight_group(tiny_job(tmp_path, "x", "ray.placement=colocate")) is None

    new = EngineKind(launch_hf, group_sync=lambda cfg: GroupSync(open_stand_in_group, 5.0))
    sync = make_weight_sync(object(), group=new.weight_group(apart), trainer_gpus=False, options=WeightSyncOptions())
    assert isinstance(sync, NcclWeightSync) and sync.group.open_group is open_stand_in_group
    assert sync.backend == "gloo"  # a CPU trainer
    assert isinstance(
        make_weight_sync(object(), group=None, trainer_gpus=False, options=WeightSyncOptions()), TensorWeightSync
    )


@pytest.mark.parametrize("on", [False, True])
def test_the_train_phase_levers_reach_both_backends_options(tmp_path, on):
    """`train.old_logprobs_from_train_forward`, `train.logits_only_where_loss`, `train.vision_once_per_image` reach
    the TrainOptions both backends get; `train.recompute` the megatron layout."""
    from miles_vl.orchestration.factories import parallel_options, train_options
    from tests.rollout.hf.test_engine import SPECIAL

    levers = ("old_logprobs_from_train_forward", "logits_only_where_loss", "vision_once_per_image")
    cfg = tiny_job(tmp_path, "x", *(f"train.{k}={str(on).lower()}" for k in levers), "train.recompute=vision")
    options = train_options(cfg, SPECIAL)
    assert all(getattr(options, k) is on for k in levers)
    assert parallel_options(cfg).recompute == "vision"


def test_a_colocated_sglang_job_syncs_over_ipc_unless_the_switch_says_tensor(tmp_path):
    """Issue 33.1: colocated, sglang's row gives trainer rank 0 the IPC sender (`open_colocated_sender`) with the job's
    checkpoint for the name check, `rollout.sglang.verify_weights_every` and the request timeout; the strategy runs it
    without a broadcast backend. `rollout.sglang.colocated_sync=tensor` keeps the earlier path through the driver."""
    sglang = ("rollout.backend=sglang", "rollout.gpus_per_engine=1", "ray.placement=colocate")
    assert ENGINES["sglang"].weight_group(tiny_job(tmp_path, "x", *sglang)) is None  # the default: tensor
    ipc = ("rollout.sglang.colocated_sync=ipc", "rollout.sglang.verify_weights_every=4")
    cfg = tiny_job(tmp_path, "x", *sglang, *ipc, "rollout.sglang.request_timeout_s=9")
    group = ENGINES["sglang"].weight_group(cfg)
    assert group is not None and group.colocated and group.request_timeout_s == 9
    assert group.open_group.func is open_colocated_sender
    assert group.open_group.keywords == {"model_path": cfg.model.path or None, "verify_every": 4}
    sync = make_weight_sync(object(), group=group, trainer_gpus=True, options=WeightSyncOptions())
    assert isinstance(sync, NcclWeightSync) and sync.backend == "ipc"
    old = tiny_job(tmp_path, "x", *sglang, "rollout.sglang.colocated_sync=tensor")
    assert ENGINES["sglang"].weight_group(old) is None
