"""Contract: the config picks the rollout engine, the train backend and the reward's options from one table each
(orchestration/factories.py): `reward.kwargs` reach any reward, geo3k's own keys reach geo3k only; an engine's row
gives the weight sync its group opener and timeouts."""

import pytest

from miles_vl.orchestration.factories import (
    ENGINES,
    TRAIN_BACKENDS,
    EngineKind,
    actor_class,
    check_colocated_group,
    launch_hf,
    reward_options,
)
from miles_vl.orchestration.placement import GpuPlacement, GpuSlot
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
    """`train.old_logprobs_from_train_forward`, `train.logits_only_where_loss`, `train.vision_once_per_image`,
    `train.pinned_input_copies` reach the TrainOptions both backends get; `train.recompute` the megatron layout.
    (`pinned_input_copies` is a megatron key, refused with this torch job: set on the validated config here.)"""
    from miles_vl.orchestration.factories import parallel_options, train_options
    from tests.rollout.hf.test_engine import SPECIAL

    levers = (
        "old_logprobs_from_train_forward",
        "logits_only_where_loss",
        "vision_once_per_image",
        "pinned_input_copies",
    )
    cfg = tiny_job(tmp_path, "x", *(f"train.{k}={str(on).lower()}" for k in levers[:3]), "train.recompute=vision")
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"pinned_input_copies": on})})
    options = train_options(cfg, SPECIAL)
    assert all(getattr(options, k) is on for k in levers)
    assert parallel_options(cfg).recompute == "vision"
    full = cfg.model_copy(update={"train": cfg.train.model_copy(update={"recompute": "full", "recompute_layers": 18})})
    assert (parallel_options(full).recompute, parallel_options(full).recompute_layers) == ("full", 18)


def test_a_colocated_sglang_job_syncs_over_ipc_unless_the_switch_says_tensor(tmp_path):
    """Issue 33.1: colocated, sglang's row gives trainer rank 0 the IPC sender (`open_colocated_sender`) with the job's
    checkpoint for the name check, `rollout.sglang.verify_weights_every` and the request timeout; the strategy runs it
    without a broadcast backend. It is the default since it ran against a real SGLang 0.5.16 (2 x H100, 2026-11-26).
    `rollout.sglang.colocated_sync=tensor` keeps the earlier path through the driver."""
    sglang = ("rollout.backend=sglang", "rollout.gpus_per_engine=1", "ray.placement=colocate")
    default = ENGINES["sglang"].weight_group(tiny_job(tmp_path, "x", *sglang))
    assert default is not None and default.colocated and default.open_group.func is open_colocated_sender
    cfg = tiny_job(
        tmp_path, "x", *sglang, "rollout.sglang.verify_weights_every=4", "rollout.sglang.request_timeout_s=9"
    )
    group = ENGINES["sglang"].weight_group(cfg)
    assert group is not None and group.colocated and group.request_timeout_s == 9
    assert group.open_group.func is open_colocated_sender
    assert group.open_group.keywords == {"model_path": cfg.model.path or None, "verify_every": 4}
    sync = make_weight_sync(object(), group=group, trainer_gpus=True, options=WeightSyncOptions())
    assert isinstance(sync, NcclWeightSync) and sync.backend == "ipc"
    old = tiny_job(tmp_path, "x", *sglang, "rollout.sglang.colocated_sync=tensor")
    assert ENGINES["sglang"].weight_group(old) is None


def _slots(*nodes: str) -> list[GpuSlot]:
    """The trainer's GPU slots, node-major, one per entry of `nodes` (the node of that GPU)."""
    return [GpuSlot(bundle=i, node_ip=node, gpu_id=str(i)) for i, node in enumerate(nodes)]


def test_a_colocated_ipc_sync_to_an_engine_on_another_node_is_refused_naming_the_switch(tmp_path):
    """Issue 33.1: ipc, now the default, hands CUDA IPC handles, which open on their own node only. Two nodes of 2 GPUs,
    2 engines of 2 GPUs: engine 1 sits on the second node, so the job is refused once the GPUs are reserved, naming the
    engine, its node and `rollout.sglang.colocated_sync=tensor`; with tensor, with one node, or disaggregated it is
    not. (Left to the train actor, the sender's own check failed every sync and each engine was relaunched.)"""
    job = ("rollout.backend=sglang", "rollout.num_engines=2", "rollout.gpus_per_engine=2", "ray.placement=colocate")
    cfg = tiny_job(tmp_path, "x", *job)
    two_nodes = _slots("10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2")
    with pytest.raises(ValueError, match=r"engines \[1\] run on \['10.0.0.2'\], another node than trainer rank 0 "
                       r"\(10.0.0.1\).*set rollout.sglang.colocated_sync=tensor"):  # fmt: skip
        check_colocated_group(cfg, ENGINES["sglang"].weight_group(cfg), two_nodes)
    check_colocated_group(cfg, ENGINES["sglang"].weight_group(cfg), _slots(*["10.0.0.1"] * 4))
    check_colocated_group(cfg, ENGINES["sglang"].weight_group(cfg), None)  # no GPUs: a CPU job, one process tree
    tensor = tiny_job(tmp_path, "x", *job, "rollout.sglang.colocated_sync=tensor")
    check_colocated_group(tensor, ENGINES["sglang"].weight_group(tensor), two_nodes)
    apart = tiny_job(tmp_path, "x", *job, "ray.placement=disaggregate")
    check_colocated_group(apart, ENGINES["sglang"].weight_group(apart), two_nodes)


def test_the_driver_refuses_it_before_any_actor_starts(tmp_path, monkeypatch):
    """The check runs in `Job` right after the GPUs are reserved: no train actor is made, and the GPUs are freed."""
    from miles_vl.orchestration import loop

    released = []
    placement = GpuPlacement(group=None, slots=_slots("10.0.0.1", "10.0.0.2"))
    monkeypatch.setattr(placement, "release", lambda: released.append(True))
    monkeypatch.setattr(loop, "reserve_gpus", lambda n: placement)
    monkeypatch.setattr(loop, "Trainer", lambda *a, **k: pytest.fail("a train actor was started"))
    job = ("rollout.backend=sglang", "rollout.num_engines=2", "rollout.gpus_per_engine=1", "ray.placement=colocate")
    megatron = ("train.backend=megatron", "train.num_gpus=2", "model.init=pretrained", f"model.path={tmp_path}")
    cfg = tiny_job(tmp_path, "x", *job, *megatron)
    with pytest.raises(ValueError, match=r"engines \[1\] run on .*colocated_sync=tensor"):
        loop.Job(cfg, tmp_path, tmp_path / "ckpt", None, None, None, None, None)
    assert released == [True]
