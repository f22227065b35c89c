"""Ray session and where actors go.

Local runs start Ray with the dashboard off (or bound to 127.0.0.1) and no outside ports; cluster runs join
`ray.address`. Placement:

- colocate: rollout engines and the trainer share the same devices and take turns (the engine releases its
  memory while the trainer runs). On a CPU-only machine every actor takes 0 CPUs of Ray's accounting, since
  the phases never overlap.
- disaggregate: the trainer gets `train.num_gpus` GPUs and the engines `num_engines * gpus_per_engine` more.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

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
    if address:
        ray.init(address=address, log_to_driver=True)
        log.info("joined the Ray cluster at %s", address)
    else:
        ray.init(
            num_cpus=num_cpus,
            include_dashboard=dashboard,
            dashboard_host="127.0.0.1",
            log_to_driver=True,
            configure_logging=False,
        )
        log.info(
            "started a local Ray (%s CPUs, dashboard %s)", num_cpus or "all", "on 127.0.0.1" if dashboard else "off"
        )
    try:
        yield
    finally:
        ray.shutdown()


@dataclass(frozen=True)
class ActorResources:
    num_cpus: float
    num_gpus: float


def actor_resources(role: str, *, placement: str, gpus: int) -> ActorResources:
    """Ray resources of one actor of `role` ("rollout" or "train") holding `gpus` GPUs (0 on CPU).

    Colocated actors ask for half a GPU each so that Ray places them on the same device.
    """
    if role not in ("rollout", "train"):
        raise ValueError(f"role must be 'rollout' or 'train', found {role!r}")
    if gpus == 0:
        return ActorResources(num_cpus=0, num_gpus=0)
    share = 0.5 if placement == "colocate" else 1.0
    return ActorResources(num_cpus=1, num_gpus=gpus * share)
