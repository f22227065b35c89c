"""What a job is built from: the tables of rollout engines (picked by `rollout.backend`) and train backends (picked
by `train.backend`), and `Hooks`, through which tests put stand-ins in (production defaults everywhere).

    kind = hooks.engines[cfg.rollout.backend]             # an EngineKind
    actor = kind.launch(cfg, tokens, slot)                # a Ray actor that implements miles_vl.rollout.RolloutEngine
    group = kind.weight_group(cfg)                        # how trainer rank 0 sends to it, or None: the driver
    backend = hooks.train_backends[cfg.train.backend](cfg, tokens)   # in each train rank: a TrainBackend
    run_job(cfg, hooks=Hooks(engines={**ENGINES, "hf": EngineKind(my_launch)}))

The builders here are the only code between the config and the plain arguments of engines and backends (STYLE
§2.5). Adding a rollout engine: its folder under miles_vl/rollout/ (a class that derives from `RolloutEngine`; for a
broadcast weight sync, a module with its group opener), one `EngineKind` here, and its name in `rollout.backend`
(config/schema.py); miles_vl/rollout/weight_sync.py does not change. Adding a train backend: a class that
implements `miles_vl.train.TrainBackend`, one builder here, and its name in `train.backend`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch

from miles_vl.config import ConfigError, JobConfig
from miles_vl.models import SpecialTokens
from miles_vl.models.qwen3_vl.model import build_model
from miles_vl.models.qwen3_vl.tokens import vision_token_ids
from miles_vl.orchestration.placement import GpuSlot, engine_slots
from miles_vl.reward import REWARD_CONFIG_KEYS, RewardResolutionError, WeightedReward, check_reward, resolve_reward
from miles_vl.reward.types import reward_name
from miles_vl.rollout import HFRolloutEngine
from miles_vl.rollout.sglang import (
    SGLANG_LAUNCH_MODULE,
    EngineOptions,
    RequestPolicy,
    ServerSpec,
    SGLangRolloutHost,
)
from miles_vl.rollout.sglang.host import deterministic_inference
from miles_vl.rollout.sglang.weights import open_colocated_sender, open_trainer_group
from miles_vl.rollout.weight_sync import GroupSync, WeightSyncOptions
from miles_vl.sglang_plugin.settings import PluginSettings
from miles_vl.train import LossOptions, OptimizerOptions, TorchTrainBackend, TrainBackend, TrainOptions
from miles_vl.train.megatron.parallel import ParallelOptions


@dataclass(frozen=True)
class EngineSlot:
    """Where engine `index` runs: its Ray actor options, the GPUs its server uses (a colocated engine's actor holds
    only the first in Ray's accounting; None: those Ray gives the actor), the directory for its logs."""

    index: int
    ray_options: dict[str, Any]
    gpu_ids: Sequence[str] | None
    log_dir: Path


def no_problems(cfg: JobConfig) -> list[str]:
    return []


@dataclass(frozen=True)
class EngineKind:
    """One rollout engine of the table.

    Args:
        launch: (cfg, tokens, slot) -> the engine's Ray actor.
        config_problems: what this build cannot do with the config (checked before Ray starts).
        sends_pixels: whether the engine needs the prompts' `pixel_values` (else they stay home: it processes their
            `images` itself).
        group_sync: cfg -> the engine's group path (`weight_sync.GroupSync`: its group opener, run in trainer rank 0,
            and its timeouts); with `ray.placement=disaggregate` trainer rank 0 then broadcasts the weights to the
            engine over NCCL (the engine implements `endpoint` and `expect_weight_version`). None, or colocated: the
            weights go through the driver (`load_weight_bucket`).
        colocated_sync: cfg -> the engine's colocated group path (a `GroupSync` with `colocated=True`, whose sender
            trainer rank 0 runs on its own GPU), or None for this job: the weights go through the driver.
    """

    launch: Callable[[JobConfig, SpecialTokens, EngineSlot], Any]
    config_problems: Callable[[JobConfig], list[str]] = no_problems
    sends_pixels: Callable[[JobConfig], bool] = lambda cfg: True
    group_sync: Callable[[JobConfig], GroupSync] | None = None
    colocated_sync: Callable[[JobConfig], GroupSync | None] | None = None

    def weight_group(self, cfg: JobConfig) -> GroupSync | None:
        """How trainer rank 0 sends to this engine in this job (disaggregated: `group_sync`; colocated:
        `colocated_sync`); None: the weights go through the driver."""
        make = self.group_sync if cfg.ray.placement == "disaggregate" else self.colocated_sync
        return None if make is None else make(cfg)


# ---------------------------------------------------------------------------------------------------------------------
# the policy both roles start from


def torch_dtype(cfg: JobConfig, device: str) -> torch.dtype:
    if cfg.model.dtype == "fp32" or (cfg.model.dtype == "auto" and device == "cpu"):
        return torch.float32
    return torch.bfloat16


def set_threads(cfg: JobConfig) -> None:
    if cfg.ray.num_cpus:
        torch.set_num_threads(cfg.ray.num_cpus)


def build_policy(cfg: JobConfig, tokens: SpecialTokens):
    """The policy model both roles start from, on this process's device (same seed: identical random init on every
    actor)."""
    set_threads(cfg)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return build_model(
        tokens,
        path=cfg.model.path if cfg.model.init == "pretrained" else None,
        tiny=cfg.model.tiny.model_dump(),
        seed=cfg.seed,
        dtype=torch_dtype(cfg, device),
        device=device,
    )


# ---------------------------------------------------------------------------------------------------------------------
# the engines


@functools.cache
def actor_class(cls: type, generate_apart: bool = False):
    """`cls` as a Ray actor class (made once per class; making it does not start Ray). `generate_apart`: calls
    made with `.options(concurrency_group=GENERATE_GROUP)` run in a thread of their own, beside the actor's other
    calls (partial rollouts pause a generate in flight: `RolloutEngines.pause_generation`)."""
    if generate_apart:
        return ray.remote(concurrency_groups={GENERATE_GROUP: 1})(cls)
    return ray.remote(cls)


GENERATE_GROUP = "generate"


def launch_hf(cfg: JobConfig, tokens: SpecialTokens, slot: EngineSlot, *, engine: type = HFRolloutEngine, **kwargs):
    """An hf engine; `engine` and `kwargs`: a stand-in class and its extra arguments (tests)."""
    return (
        actor_class(engine)
        .options(**slot.ray_options)
        .remote(
            functools.partial(build_policy, cfg, tokens),
            tokens,
            ban_vision_tokens=cfg.rollout.ban_vision_tokens,
            **kwargs,
        )
    )


def server_spec(cfg: JobConfig, index: int) -> ServerSpec:
    """What sglang engine `index` launches: the checkpoint at `model.path`, port `rollout.sglang.port + index` (None
    with `port: null`: its host picks a free port of its node), one GPU per TP rank, the processor's pixel range,
    memory saver when colocated."""
    s = cfg.rollout.sglang
    return ServerSpec(
        model_path=cfg.model.path or "",
        port=None if s.port is None else s.port + index,
        host=s.host,
        api_key=s.api_key,
        tp_size=cfg.rollout.gpus_per_engine,
        mem_fraction_static=s.mem_fraction_static,
        colocated=cfg.ray.placement == "colocate",
        random_seed=cfg.seed + index,
        weight_version="base",
        image_min_pixels=cfg.data.min_pixels,
        image_max_pixels=cfg.data.max_pixels,
        vision_cache_mb=s.vision_cache_mb,
        plugin=PluginSettings(vision_graphs=s.vision_cuda_graphs) if s.launcher == "miles_vl" else None,
        extra_args=tuple(s.extra_args),
    )


def sglang_problems(cfg: JobConfig) -> list[str]:
    problems = []
    if cfg.model.init != "pretrained":
        problems.append(
            "rollout.backend=sglang serves the checkpoint at model.path, but model.init=random trains a random model "
            "the server cannot load; set model.init=pretrained (with model.path) or rollout.backend=hf"
        )
    else:
        try:  # what each engine's host will check (extra_args, the key, the last engine's port), before Ray starts
            server_spec(cfg, 0)
            server_spec(cfg, cfg.rollout.num_engines - 1)
        except ValueError as e:
            problems.append(str(e))
    if cfg.rollout.sglang.one_request_per_prompt and deterministic_inference(cfg.rollout.sglang.extra_args):
        problems.append(
            "rollout.sglang.one_request_per_prompt=true with a deterministic server (--enable-deterministic-inference "
            "in rollout.sglang.extra_args): SGLang gives every sample of a request one sampling_seed, so the n samples "
            "of a prompt would be identical; set rollout.sglang.one_request_per_prompt to null or false"
        )
    return problems


def launch_sglang(cfg: JobConfig, tokens: SpecialTokens, slot: EngineSlot, *, launch_module: str | None = None):
    """An sglang engine: its server's log goes to `slot.log_dir/sglang_<index>.log` (on the actor's node);
    `launch_module` is run with `python -m` (tests run a stand-in that takes SGLang's flags); None:
    `sglang.launch_server` (with miles_vl's SGLang plugin where `rollout.sglang.launcher` is miles_vl:
    `server_spec`)."""
    s = cfg.rollout.sglang
    if launch_module is None:
        launch_module = SGLANG_LAUNCH_MODULE
    return (
        actor_class(SGLangRolloutHost, cfg.rollout.partial_rollouts)
        .options(**slot.ray_options)
        .remote(
            server_spec(cfg, slot.index),
            tokens,
            EngineOptions(
                ban_vision_tokens=cfg.rollout.ban_vision_tokens,
                one_request_per_prompt=s.one_request_per_prompt,
                prompts_per_request=s.prompts_per_request,
            ),
            startup_timeout_s=s.startup_timeout_s,
            requests=RequestPolicy(timeout_s=s.request_timeout_s, max_retries=s.max_retries),
            max_restarts=cfg.rollout.max_restarts,
            log_path=str(slot.log_dir / f"sglang_{slot.index}.log"),
            launch_module=launch_module,
            send_pixel_values=s.send_pixel_values,
            env={"CUDA_VISIBLE_DEVICES": ",".join(slot.gpu_ids)} if slot.gpu_ids else None,
            cpu_tensors_by_name=True,
            name=f"rollout engine {slot.index}",
            partial_rollouts=cfg.rollout.partial_rollouts,
        )
    )


def sglang_group_sync(cfg: JobConfig) -> GroupSync:
    """SGLang's NCCL path: `/init_weights_update_group` and friends (rollout/sglang/weights.py), each call within
    `rollout.sglang.request_timeout_s`, each bucket within `rollout.sglang.sync_timeout_s`."""
    s = cfg.rollout.sglang
    return GroupSync(open_trainer_group, request_timeout_s=s.request_timeout_s, sync_timeout_s=s.sync_timeout_s)


def sglang_colocated_sync(cfg: JobConfig) -> GroupSync | None:
    """SGLang's colocated IPC path (`open_colocated_sender`, rollout/sglang/weights.py) unless
    `rollout.sglang.colocated_sync=tensor`: names checked against `model.path`, values every
    `rollout.sglang.verify_weights_every`-th sync."""
    s = cfg.rollout.sglang
    if s.colocated_sync != "ipc":
        return None
    opener = functools.partial(
        open_colocated_sender, model_path=cfg.model.path or None, verify_every=s.verify_weights_every
    )
    return GroupSync(opener, request_timeout_s=s.request_timeout_s, colocated=True)


def check_colocated_group(cfg: JobConfig, group: GroupSync | None, slots: Sequence[GpuSlot] | None) -> None:
    """Refuse a colocated IPC sync (`group.colocated`) to an engine on another node than trainer rank 0, once the
    trainer's GPUs are reserved (`slots`, node-major) and before any actor starts: a CUDA IPC handle opens on its own
    node only. Only then is it known: in a cluster Ray picks the nodes (a private Ray is one node). Left to the
    actor, the sender's own check (`open_colocated_sender`) failed every sync, so each engine was relaunched
    `rollout.max_restarts` times before the job ended.

    Raises:
        ValueError: names the engines, their nodes and the fix (sglang's row is the only one with a colocated group).
    """
    if group is None or not group.colocated or not slots:
        return
    r = cfg.rollout
    here = slots[0].node_ip
    far = {i: s[0].node_ip for i, s in enumerate(engine_slots(slots, r.num_engines, r.gpus_per_engine))}
    far = {i: node for i, node in far.items() if node != here}
    if far:
        raise ValueError(
            f"rollout.sglang.colocated_sync=ipc: colocated engines {sorted(far)} run on {sorted(set(far.values()))}, "
            f"another node than trainer rank 0 ({here}), and a CUDA IPC handle opens on its own node only; set "
            "rollout.sglang.colocated_sync=tensor (the weights then go through Ray's object store)"
        )


ENGINES: Mapping[str, EngineKind] = {
    "hf": EngineKind(launch_hf),
    "sglang": EngineKind(
        launch_sglang,
        sglang_problems,
        sends_pixels=lambda cfg: cfg.rollout.sglang.send_pixel_values,
        group_sync=sglang_group_sync,
        colocated_sync=sglang_colocated_sync,
    ),
}


# ---------------------------------------------------------------------------------------------------------------------
# the train backends (built inside each train rank, after its process group is formed)

TrainBackendBuilder = Callable[[JobConfig, SpecialTokens], TrainBackend]


def train_options(cfg: JobConfig, tokens: SpecialTokens) -> TrainOptions:
    """The optimizer, loss and batching both backends train with."""
    t, a = cfg.train, cfg.algo
    same = ("clip_low", "clip_high", "dual_clip_c", "kl_coef", "kl_estimator", "entropy_coef")  # same names in algo.*
    return TrainOptions(
        optimizer=OptimizerOptions(**t.optimizer.model_dump(exclude={"name"})),
        loss=LossOptions(
            **a.model_dump(include=set(same)),
            tis_mode=a.tis.mode if a.tis.enabled else None,
            tis_cap=a.tis.cap,
            policy_loss_type=a.policy_loss,
            reduction=a.loss_reduction,
            max_response_len=cfg.rollout.max_response_len,
            temperature=cfg.rollout.temperature,
            suppress_token_ids=vision_token_ids(tokens) if cfg.rollout.ban_vision_tokens else (),
        ),
        **t.model_dump(
            include={
                "micro_batch_max_tokens",
                "global_batch_size",
                "ppo_epochs",
                "freeze_vision",
                "old_logprobs_from_train_forward",
                "logits_only_where_loss",
                "vision_once_per_image",
                "pinned_input_copies",
            }
        ),
    )


def parallel_options(cfg: JobConfig) -> ParallelOptions:
    """The megatron model's parallel layout from `train.*` (whose `tp/pp/cp/ep` are the `*_size`s)."""
    t = cfg.train
    return ParallelOptions(
        tp_size=t.tp,
        pp_size=t.pp,
        cp_size=t.cp,
        ep_size=t.ep,
        # the same names in train.*
        **t.model_dump(include={"sp", "recompute", "recompute_layers", "vision_dp_when_cp", "seed"}),
        bf16=cfg.model.dtype != "fp32",
    )


def build_torch(cfg: JobConfig, tokens: SpecialTokens) -> TrainBackend:
    return TorchTrainBackend(build_policy(cfg, tokens), tokens, train_options(cfg, tokens))


def build_megatron(cfg: JobConfig, tokens: SpecialTokens, *, builder: Callable | None = None) -> TrainBackend:
    """This rank's megatron backend (collective); `builder`: a stand-in with `build_megatron_backend`'s signature."""
    if builder is None:
        from miles_vl.train.megatron.build import build_megatron_backend as builder
    return builder(cfg.model.path, tokens, train_options(cfg, tokens), parallel_options(cfg))


TRAIN_BACKENDS: Mapping[str, TrainBackendBuilder] = {"torch": build_torch, "megatron": build_megatron}


def reward_options(cfg: JobConfig) -> dict[str, Any]:
    """The keyword arguments bound to the reward function: the options a registered reward takes from keys of the
    `reward` section (`REWARD_CONFIG_KEYS`: geo3k's format_weight, format_pattern), then `reward.kwargs`, which win."""
    r = cfg.reward
    return {**{k: getattr(r, k) for k in REWARD_CONFIG_KEYS.get(r.name or "", ())}, **r.kwargs}


def build_rewards(cfg: JobConfig, reward_fn: Callable[..., Any] | None = None) -> list[WeightedReward]:
    """The job's reward functions, resolved and checked (before Ray starts): `reward.functions`, or `reward.name` with
    `reward_options`, or `reward_fn` given in Python (with `reward.kwargs` bound; `reward.name` must be null).

    Raises:
        ConfigError: no reward at all, or `reward_fn` together with `reward.name` / `reward.functions`.
        RewardResolutionError: a function that does not resolve; the message names its key.
    """
    r = cfg.reward
    if reward_fn is not None:
        if r.name is not None or r.functions:
            given = f"reward.name={r.name!r}" if r.name is not None else "reward.functions"
            raise ConfigError(
                [
                    f"run_job got reward_fn= and the config sets {given}; use one: set reward.name=null (and no "
                    "reward.functions) to score with reward_fn, or drop reward_fn"
                ]
            )
        label = reward_name(reward_fn).rpartition(".")[2]
        return [WeightedReward(label, 1.0, check_reward(reward_fn, label, **r.kwargs))]
    if r.functions:
        terms = []
        for i, f in enumerate(r.functions):
            try:
                terms.append(WeightedReward(f.metric_label, f.weight, resolve_reward(f.name, **f.kwargs)))
            except RewardResolutionError as err:
                raise RewardResolutionError(f"reward.functions[{i}].name={f.name!r}: {err}") from err
        return terms
    if r.name is None:
        raise ConfigError(
            [
                "reward.name is null and reward.functions is empty: name a reward (reward.name=geo3k), list "
                "reward.functions, or pass run_job(cfg, reward_fn=...)"
            ]
        )
    label = r.name.rpartition(":")[2].rpartition(".")[2]
    return [WeightedReward(label, 1.0, resolve_reward(r.name, **reward_options(cfg)))]


@dataclass(frozen=True)
class Hooks:
    """What a job builds its parts with. Production defaults; tests replace entries (stand-in servers, engines that
    die on cue, a megatron backend on CPU stand-ins)."""

    engines: Mapping[str, EngineKind] = field(default_factory=lambda: ENGINES)
    train_backends: Mapping[str, TrainBackendBuilder] = field(default_factory=lambda: TRAIN_BACKENDS)
    weight_sync: WeightSyncOptions = WeightSyncOptions()
