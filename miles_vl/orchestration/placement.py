"""Ray session and where actors go.

Local runs start Ray with the dashboard off (or bound to 127.0.0.1); cluster runs join `ray.address`. What listens
where in a local session (Ray 2.60; Ray has no setting that binds its own servers to loopback): the GCS, the raylet
(node manager and object manager) and every worker process serve gRPC on random ports of all interfaces, and the
runtime-env agent on the node's IP. They take only callers that present the session's auth token, which Ray turns
on for a local session unless RAY_AUTH_MODE says otherwise (`ray_session` warns loudly when it is "disabled"); the
token lives in ~/.ray/auth_token. Keep a multi-user or exposed machine behind a firewall all the same. Placement:

- colocate: rollout engines and the trainer share the same devices and take turns (the engine releases its
  memory while the trainer runs). On a CPU-only machine every actor takes 0 CPUs of Ray's accounting, since
  the phases never overlap.
- disaggregate: the trainer gets `train.num_gpus` GPUs and the engines `num_engines * gpus_per_engine` more.

With GPUs, the trainer's devices are one placement group of `train.num_gpus` single-GPU bundles (`reserve_gpus`),
ordered by node and GPU id so that consecutive train ranks (megatron's TP groups) share a node:

    slots = reserve_gpus(8)                                    # GpuSlot(bundle, node_ip, gpu_id) x 8, node-major
    train rank r          -> slots[r]                          # half the bundle's GPU when colocated, all otherwise
    colocated engine i    -> slots[i*g : (i+1)*g]              # its actor sits in the first; its server sees all g
                                                               # (CUDA_VISIBLE_DEVICES), which must share a node
    disaggregated engines -> g GPUs each, outside the group
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from miles_vl.gpu_env import NO_MULTICAST_ENV, nccl_peer_env

log = logging.getLogger(__name__)


@contextlib.contextmanager
def ray_session(address: str | None, *, num_cpus: int | None = None, dashboard: bool = False) -> Iterator[None]:
    """Start or join Ray for the job's duration (shut down only what we started)."""
    import ray

    if ray.is_initialized():
        yield
        return
    # Workers inherit this: keep Ray's own usage stats off on machines with no outside network.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Every worker of the job (train ranks, engine actors and the SGLang servers they start) keeps NVLink multicast
    # off, also on a cluster whose Ray was started elsewhere: on shared hosts a program that uses it can take the
    # GPUs out of service. And every NCCL peer of an SGLang server (the trainer, in the disaggregated weight sync) runs
    # with the server's NCCL_CUMEM_ENABLE (`nccl_peer_env`), else their first broadcast fails.
    runtime_env = {"env_vars": {**NO_MULTICAST_ENV, **nccl_peer_env()}}
    if address:
        ray.init(address=address, log_to_driver=True, runtime_env=runtime_env)
        log.info("joined the Ray cluster at %s", address)
    else:
        if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token":
            log.warning(
                "RAY_AUTH_MODE=%s: the local Ray session's GCS, raylet and worker ports listen on all interfaces "
                "without authentication; anyone who reaches this machine can run code in it. Unset RAY_AUTH_MODE "
                "(token authentication is Ray's default) unless the machine is firewalled.",
                os.environ["RAY_AUTH_MODE"],
            )
        ray.init(
            num_cpus=num_cpus,
            include_dashboard=dashboard,
            dashboard_host="127.0.0.1",
            log_to_driver=True,
            configure_logging=False,
            runtime_env=runtime_env,
        )
        log.info(
            "started a local Ray (%s CPUs, dashboard %s)", num_cpus or "all", "on 127.0.0.1" if dashboard else "off"
        )
    try:
        yield
    finally:
        ray.shutdown()


# A colocated train rank and the engine actor in the same slot each take this share of its GPU in Ray's accounting.
COLOCATED_GPU_SHARE = 0.5


def cpu_only_options() -> dict:
    """Ray options of any actor of a CPU-only run: none of Ray's CPUs (the phases never overlap)."""
    return dict(num_cpus=0, num_gpus=0)


# ---------------------------------------------------------------------------------------------------------------------
# the trainer's GPUs


@dataclass(frozen=True)
class GpuSlot:
    """One bundle of the trainer's placement group: one GPU on one node."""

    bundle: int  # index of the bundle in the placement group
    node_ip: str
    gpu_id: str  # Ray's id of the GPU on its node: an entry of that node's CUDA_VISIBLE_DEVICES


@dataclass
class GpuPlacement:
    """The trainer's placement group and its slots, node-major (`reserve_gpus`)."""

    group: object  # ray.util.placement_group.PlacementGroup
    slots: list[GpuSlot]

    def strategy(self, slot: GpuSlot):
        """Ray's scheduling strategy that puts an actor into `slot`'s bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self.group, placement_group_bundle_index=slot.bundle)

    def release(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(self.group)


def reserve_gpus(n: int, timeout_s: float = 600.0) -> GpuPlacement:
    """A placement group of `n` bundles of one GPU each, and where each landed.

    Raises:
        RuntimeError: the cluster does not have `n` free GPUs within `timeout_s` (the message gives what it has).
    """
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if n < 1:
        raise ValueError(f"reserve_gpus needs n >= 1, found {n}")
    # GPU only: the actors in it take 0 CPUs, so a local Ray with few CPUs (ray.num_cpus) still fits the group
    group = placement_group([{"GPU": 1}] * n, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(group)
        raise RuntimeError(
            f"could not reserve {n} GPUs (train.num_gpus) in {timeout_s:.0f} s: the Ray cluster has "
            f"{ray.cluster_resources().get('GPU', 0):g} GPUs, {ray.available_resources().get('GPU', 0):g} free; "
            "lower train.num_gpus or add nodes"
        )
    probes = [
        _probe_class()
        .options(
            num_cpus=0,
            num_gpus=0.01,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=i),
        )
        .remote()
        for i in range(n)
    ]
    try:
        where = ray.get([p.where.remote() for p in probes])
    finally:
        for p in probes:
            ray.kill(p)
    slots = [GpuSlot(bundle=i, node_ip=ip, gpu_id=gpu) for i, (ip, gpu) in enumerate(where)]
    return GpuPlacement(group, sorted(slots, key=_node_major))


def engine_slots(slots: Sequence[GpuSlot], num_engines: int, gpus_per_engine: int) -> list[list[GpuSlot]]:
    """The trainer's slots each colocated engine takes: engine i gets `slots[i*g:(i+1)*g]`, all on one node.

    Raises:
        ValueError: the engines need more GPUs than the trainer has, or an engine's GPUs span nodes.
    """
    need = num_engines * gpus_per_engine
    if need > len(slots):
        raise ValueError(
            f"colocated engines need rollout.num_engines * rollout.gpus_per_engine = {need} GPUs, but the trainer has "
            f"{len(slots)} (train.num_gpus); lower the engine count or set ray.placement=disaggregate"
        )
    out = [list(slots[i * gpus_per_engine : (i + 1) * gpus_per_engine]) for i in range(num_engines)]
    for i, group in enumerate(out):
        nodes = sorted({s.node_ip for s in group})
        if len(nodes) > 1:
            raise ValueError(
                f"colocated engine {i} would span nodes {nodes} with rollout.gpus_per_engine={gpus_per_engine}: an "
                "SGLang server runs on one node; pick a rollout.gpus_per_engine that divides the GPUs per node"
            )
    return out


def _node_major(slot: GpuSlot) -> tuple:
    gpu = int(slot.gpu_id) if slot.gpu_id.isdigit() else slot.gpu_id  # ids may be UUIDs on some clusters
    return (slot.node_ip, isinstance(gpu, str), gpu)


@functools.cache
def _probe_class():
    """An actor that says where it runs (made on first use: this module imports without Ray)."""
    import ray

    @ray.remote
    class Probe:
        def where(self) -> tuple[str, str]:
            ids = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
            if not ids:
                raise RuntimeError("an actor in a GPU bundle of the trainer's placement group was given no GPU id")
            return ray.util.get_node_ip_address(), str(ids[0])

    return Probe
