"""The sglang rollout backend in the driver: what each engine launches, its Ray actor, and the trainer's NCCL sender.

    spec = server_spec(cfg, index=i)          # pure: the job config -> ServerSpec of engine i (port = port + i)
    engine = SGLangWorker.options(num_gpus=...).remote(cfg, tokens, i)   # launches the server, waits for health
    engine.generate.remote(prompts, params)   # the same calls as the hf RolloutWorker (engines.py drives both)

One actor per engine hosts one SGLang server process (`SGLangRolloutHost`: launch, health, restarts). The actor's
GPUs are the ones Ray gives it (`rollout.gpus_per_engine`, `--tp-size`); the server binds 127.0.0.1 unless
`rollout.sglang.host` opens it (then `rollout.sglang.api_key` is required and sent with every call).

Weights reach the server in one of two ways (weight_sync.py): colocated, the driver hands the actor the trainer's
buckets and the actor posts them (`/update_weights_from_tensor`); disaggregated, trainer rank 0 joins one NCCL group
with every engine and broadcasts (`TrainerWeightGroup`, which runs inside the train actor and calls the servers
directly over HTTP, so a loopback-bound server must be on the trainer's node).
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import ray
import torch
from torch import Tensor

from miles_vl.config import JobConfig
from miles_vl.model import SpecialTokens
from miles_vl.rollout import Generation, SamplingParams
from miles_vl.rollout.sglang import (
    DistributedWeightSender,
    EngineEndpoint,
    ServerSpec,
    SGLangClient,
    SGLangRolloutHost,
    SyncReport,
)
from miles_vl.rollout.sglang.actor import deterministic_inference
from miles_vl.rollout.sglang.server import LOOPBACK_HOSTS

log = logging.getLogger(__name__)

# Test-only: the module run with `python -m` in place of `sglang.launch_server` (a stand-in server that takes SGLang's
# flags, e.g. tests/rollout/sglang/hf_server.py). The driver reads it and passes it to the actors explicitly.
LAUNCH_MODULE_ENV = "MILES_VL_SGLANG_LAUNCH_MODULE"
SGLANG_LAUNCH_MODULE = "sglang.launch_server"


def server_spec(cfg: JobConfig, index: int) -> ServerSpec:
    """What engine `index` launches: the checkpoint at `model.path`, port `rollout.sglang.port + index`, one GPU per
    TP rank, the processor's pixel range, memory saver when colocated."""
    s = cfg.rollout.sglang
    return ServerSpec(
        model_path=cfg.model.path or "",
        port=s.port + index,
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
        extra_args=tuple(s.extra_args),
    )


def config_problems(cfg: JobConfig) -> list[str]:
    """What this build cannot do with `rollout.backend=sglang` (checked before Ray starts)."""
    problems = []
    if cfg.model.init != "pretrained":
        problems.append(
            "rollout.backend=sglang serves the checkpoint at model.path, but model.init=random trains a random model "
            "the server cannot load; set model.init=pretrained (with model.path) or rollout.backend=hf"
        )
    if cfg.rollout.sglang.one_request_per_prompt and deterministic_inference(cfg.rollout.sglang.extra_args):
        problems.append(
            "rollout.sglang.one_request_per_prompt=true with a deterministic server (--enable-deterministic-inference "
            "in rollout.sglang.extra_args): SGLang gives every sample of a request one sampling_seed, so the n samples "
            "of a prompt would be identical; set rollout.sglang.one_request_per_prompt to null or false"
        )
    return problems


def strip_pixels(prompts: Sequence) -> list:
    """The prompts without `pixel_values`: SGLang re-processes the `images` itself, so the pixels would only cost
    object-store traffic (tens of MB per prompt at geo3k resolutions)."""
    return [dataclasses.replace(p, pixel_values=None) for p in prompts]


# ---------------------------------------------------------------------------------------------------------------------
# the engine actor


@dataclass(frozen=True)
class EngineAddress:
    """How trainer rank 0 reaches one engine's server for the NCCL sync."""

    url: str
    api_key: str | None
    tp_size: int
    node_ip: str
    loopback: bool  # the server binds a loopback address: reachable from its own node only


@ray.remote
class SGLangWorker:
    """One rollout engine: an SGLang server process and the engine that drives it (the calls engines.py makes of
    every rollout actor, plus `endpoint` and `expect_weight_version` for the NCCL sync).

    Args:
        cfg: the job config.
        tokens: special token ids.
        index: engine number (port offset).
        launch_module: module run with `python -m` (tests substitute a stand-in, see LAUNCH_MODULE_ENV).
        log_dir: the server's log goes to `log_dir/sglang_<index>.log` (on the actor's node).
        gpu_ids: the node's GPUs the server runs on (its CUDA_VISIBLE_DEVICES), for a colocated engine whose actor
            holds only the first of them in Ray's accounting; None: the GPUs Ray gave the actor.
    """

    def __init__(
        self,
        cfg: JobConfig,
        tokens: SpecialTokens,
        index: int,
        launch_module: str = SGLANG_LAUNCH_MODULE,
        log_dir: str | None = None,
        gpu_ids: Sequence[str] | None = None,
    ):
        if not torch.cuda.is_available():
            # Without a GPU the weights stay CPU tensors, which torch shares by file descriptor by default: only
            # this process could open those. Share them by shared-memory file name so the server process can.
            torch.multiprocessing.set_sharing_strategy("file_system")
        s = cfg.rollout.sglang
        log_path = None
        if log_dir is not None:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            log_path = Path(log_dir) / f"sglang_{index}.log"
        self.spec = server_spec(cfg, index)
        self.host = SGLangRolloutHost(
            self.spec,
            tokens,
            ban_vision_tokens=cfg.rollout.ban_vision_tokens,
            startup_timeout_s=s.startup_timeout_s,
            request_timeout_s=s.request_timeout_s,
            max_retries=s.max_retries,
            max_restarts=cfg.rollout.max_restarts,
            log_path=log_path,
            launch_module=launch_module,
            one_request_per_prompt=s.one_request_per_prompt,
            env={"CUDA_VISIBLE_DEVICES": ",".join(gpu_ids)} if gpu_ids else None,
        )
        log.info("engine %d: SGLang server at %s (log %s)", index, self.host.url, self.host.log_path)

    def ready(self) -> None:
        """Returns once the server is healthy (the constructor waited for it)."""

    def generate(self, prompts: Sequence, params: SamplingParams) -> list[list[Generation]]:
        return self.host.generate(prompts, params)

    def begin_weight_sync(self) -> None:
        self.host.begin_weight_sync()

    def load_weight_bucket(self, named_tensors: Sequence[tuple[str, Tensor]]) -> None:
        self.host.load_weight_bucket(named_tensors)

    def finish_weight_sync(self, weight_version: str) -> None:
        self.host.finish_weight_sync(weight_version)

    def expect_weight_version(self, weight_version: str) -> None:
        self.host.expect_weight_version(weight_version)

    def release_memory(self) -> None:
        self.host.release_memory()

    def resume_memory(self) -> None:
        self.host.resume_memory()

    def needs_weights(self) -> bool:
        """True when the server cannot generate until weights are synced again (it restarted, or it was released
        without a CPU backup). A dead server is relaunched first (that counts as a restart)."""
        self.host.ensure_running()
        return self.host.weights_missing is not None

    def server_restarts(self) -> int:
        return self.host.restarts

    def endpoint(self) -> EngineAddress:
        loopback = self.spec.host in LOOPBACK_HOSTS
        node_ip = ray.util.get_node_ip_address()
        url = self.spec.url if loopback else f"http://{node_ip}:{self.spec.port}"
        return EngineAddress(url, self.spec.api_key, self.spec.tp_size, node_ip, loopback)

    def shutdown(self) -> None:
        self.host.shutdown()


# ---------------------------------------------------------------------------------------------------------------------
# the trainer's side of the NCCL sync (runs inside the train actor)


class TrainerWeightGroup:
    """Trainer rank 0's weight-update group with every engine (`DistributedWeightSender`), formed on construction.

    Args:
        engines: the engines' addresses, in engine order.
        backend: "nccl" (tensors go to this process's GPU first) or "gloo" (CPU; tests).
        max_bucket_bytes: bound of one bucket (one `/update_weights_from_distributed` call).
        timeout_s: the group's timeout (rendezvous and every broadcast).
        request_timeout_s: per-attempt timeout of the HTTP calls to the servers.

    Raises:
        ValueError: an engine bound to loopback on another node (the trainer could not reach it).
    """

    def __init__(
        self,
        engines: Sequence[EngineAddress],
        *,
        backend: str,
        max_bucket_bytes: int,
        timeout_s: float = 600.0,
        request_timeout_s: float,
    ):
        here = ray.util.get_node_ip_address()
        far = [i for i, e in enumerate(engines) if e.loopback and e.node_ip != here]
        if far:
            raise ValueError(
                f"engines {far} bind 127.0.0.1 on another node than the trainer ({here}), so the NCCL weight sync "
                "cannot reach them; set rollout.sglang.host=0.0.0.0 and rollout.sglang.api_key"
            )
        local = all(e.node_ip == here for e in engines)
        self.backend = backend
        self.sender = DistributedWeightSender(
            [
                EngineEndpoint(SGLangClient(e.url, api_key=e.api_key, timeout_s=request_timeout_s), e.tp_size)
                for e in engines
            ],
            master_address="127.0.0.1" if local else here,
            master_port=_free_port(),
            backend=backend,
            max_bucket_bytes=max_bucket_bytes,
            timeout_s=timeout_s,
        )
        try:
            self.sender.init_group()
        except BaseException:
            self.sender.close()
            raise

    def send(self, named_tensors: Iterable[tuple[str, Tensor]], weight_version: str) -> SyncReport:
        """Broadcast the tensors bucket by bucket, then label and flush every engine."""
        if self.backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
            named_tensors = ((name, t.to(device)) for name, t in named_tensors)
        return self.sender.send(named_tensors, weight_version=weight_version)

    def close(self) -> None:
        self.sender.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
