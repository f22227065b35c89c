"""Ray session and where actors go.

Which Ray a job uses (`ray_session`, `cluster_address`): the cluster `ray.address` names; with it unset, the one the
RAY_ADDRESS environment variable names (how `ray job submit` and a launcher tell the driver where its cluster is);
else a private Ray of its own. Never the one Ray's address file names (`ray_current_cluster` in Ray's temp folder,
/tmp/ray by default: a folder any local user can write, where a planted address made jobs retry it for minutes):
a private Ray starts with `address="local"`, which reads neither. The log says which cluster was joined and why.
Inside `ray job submit`, Ray merges the job's runtime environment with the driver's and refuses a key both set: the
driver leaves to the job what it sets alike and refuses (preflight) what it sets otherwise (`job_runtime_env_problem`).

A private Ray keeps its sockets, logs and spilled objects in a folder of its own, `<RAY_TMPDIR or the system temp
folder>/ray-XXXXXXXX` (mode 0700: Ray makes its own folders world-writable, this one shuts them off), removed when
the job ends. Its dashboard is off (or bound to 127.0.0.1). What listens where (Ray 2.60; Ray has no setting that
binds its own servers to loopback): the GCS, the raylet (node manager and object manager) and every worker process
serve gRPC on random ports of all interfaces, and the runtime-env agent on the node's IP. They take only callers
that present the session's auth token, which Ray turns on for a local session unless RAY_AUTH_MODE says otherwise
(`ray_session` warns loudly when it is "disabled"). The token lives in ~/.ray/auth_token (or RAY_AUTH_TOKEN_PATH):
Ray 2.60 writes it world-readable, so `own_token_file` writes it first, 0600 in a 0700 folder, and makes an
existing one 0600. Keep a multi-user or exposed machine behind a firewall all the same.

Every Ray worker of the job looks up modules with the driver's working directory last (`import_path`), and Ray's
record of the job (its entrypoint) is the driver's `sys.argv`, in which the CLI has redacted secrets. Placement:

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
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from miles_vl.gpu_env import NO_MULTICAST_ENV, nccl_peer_env
from miles_vl.import_path import DRIVER_WORKING_DIR_ENV

log = logging.getLogger(__name__)


@contextlib.contextmanager
def ray_session(address: str | None, *, num_cpus: int | None = None, dashboard: bool = False) -> Iterator[None]:
    """Join the cluster `cluster_address` names, or start a private Ray, for the job's duration (module docstring);
    shut down only what we started, and remove a private Ray's folder."""
    import ray

    if ray.is_initialized():
        yield
        return
    # Workers inherit this: keep Ray's own usage stats off on machines with no outside network.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    runtime_env = driver_runtime_env()
    if problem := job_runtime_env_problem(runtime_env):
        raise RuntimeError(problem)  # preflight says so first, as a config problem
    runtime_env = without_job_settings(runtime_env)
    cluster, source = cluster_address(address)
    if not cluster and (problem := private_session_problem(address)):
        raise RuntimeError(problem)  # preflight says so first, as a config problem
    private = None if cluster else Path(tempfile.mkdtemp(prefix="ray-", dir=temp_root()))
    try:
        with _entrypoint_from_sys_argv():
            if cluster:
                ray.init(address=cluster, log_to_driver=True, runtime_env=runtime_env)
                log.info("joined the Ray cluster at %s (%s)", ray.get_runtime_context().gcs_address, source)
            else:
                _start_private(private, num_cpus, dashboard, runtime_env)
        yield
    finally:
        ray.shutdown()
        if private is not None:
            _remove(private)


def driver_runtime_env() -> dict:
    """The runtime environment every Ray worker of the job gets."""
    return {
        # Every worker of the job (train ranks, engine actors and the SGLang servers they start) keeps NVLink
        # multicast off, also on a cluster whose Ray was started elsewhere: on shared hosts a program that uses it can
        # take the GPUs out of service. And every NCCL peer of an SGLang server (the trainer, in the disaggregated
        # weight sync) runs with the server's NCCL_CUMEM_ENABLE (`gpu_env.nccl_peer_env`), else their first broadcast
        # fails.
        "env_vars": {**NO_MULTICAST_ENV, **nccl_peer_env(), DRIVER_WORKING_DIR_ENV: os.getcwd()},
        # before Ray puts the driver's working directory first on a worker's sys.path (import_path)
        "worker_process_setup_hook": "miles_vl.import_path.ray_worker_setup",
    }


# Set by Ray's job manager in a `ray job submit` entrypoint: the job's config, its runtime environment included.
RAY_JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def _job_runtime_env() -> dict:
    raw = os.environ.get(RAY_JOB_CONFIG_ENV)
    return (json.loads(raw).get("runtime_env") or {}) if raw else {}


def job_runtime_env_problem(runtime_env: dict) -> str | None:
    """Why the runtime environment of the Ray job this driver runs in (`ray job submit --runtime-env-json`) cannot
    hold the driver's (`driver_runtime_env`), or None. Ray merges the two per key and refuses the job when both set
    one; the same value is fine (`without_job_settings` leaves it to the job), another is not: NVLink multicast must
    stay off and the import hook in place."""
    job = _job_runtime_env()
    job_vars = job.get("env_vars") or {}
    clashes = [
        f"env_vars {k}={job_vars[k]!r} (miles_vl sets {v!r})"
        for k, v in runtime_env["env_vars"].items()
        if k in job_vars and str(job_vars[k]) != v
    ]
    clashes += [
        f"{k}={job[k]!r} (miles_vl sets {v!r})"
        for k, v in runtime_env.items()
        if k != "env_vars" and k in job and job[k] != v
    ]
    if not clashes:
        return None
    return (
        f"the Ray job's runtime environment sets {'; '.join(clashes)}, which the driver sets for every worker of the "
        "job: remove them from `ray job submit --runtime-env-json` (or give miles_vl's values)"
    )


def without_job_settings(runtime_env: dict) -> dict:
    """`runtime_env` less what the Ray job this driver runs in already sets (Ray refuses a key set twice, even to the
    same value; `job_runtime_env_problem` has checked that the values agree). Outside a Ray job: `runtime_env`."""
    job = _job_runtime_env()
    if not job:
        return runtime_env
    job_vars = job.get("env_vars") or {}
    out = {k: v for k, v in runtime_env.items() if k != "env_vars" and k not in job}
    out["env_vars"] = {k: v for k, v in runtime_env["env_vars"].items() if k not in job_vars}
    return out


def cluster_address(address: str | None) -> tuple[str | None, str]:
    """The address of the cluster a job joins and where it came from, or `(None, "")` for a private Ray.

    `ray.address` first (`local`: a private Ray); unset, the RAY_ADDRESS environment variable, which the user's own
    launcher or `ray job submit` sets. Ray's address file is never read for an unset `ray.address`; `auto`, given
    in either place, is Ray's own discovery (RAY_ADDRESS, then that file), as documented for a cluster.
    """
    if address:
        return (None, "") if address == "local" else (address, f"ray.address={address}")
    env = os.environ.get("RAY_ADDRESS", "").strip()
    if env and env != "local":
        return env, f"from the RAY_ADDRESS environment variable ({env}); ray.address is unset"
    return None, ""


def temp_root() -> str:
    """Where a private Ray's folder goes: where Ray 2.60 would put its own `ray` folder (RAY_TMPDIR; on Linux TMPDIR;
    else /tmp)."""
    if os.environ.get("RAY_TMPDIR"):
        return os.environ["RAY_TMPDIR"]
    if sys.platform.startswith("linux") and os.environ.get("TMPDIR"):
        return os.environ["TMPDIR"]
    return "/tmp"


# The longest unix socket path Ray 2.60 makes in a private Ray's folder (`<folder>/ray/session_<date>_<time>_<us>_
# <pid>/sockets/plasma_store`, with the longest pid Linux gives), and the limit Ray checks it against (sun_path less
# its NUL, ray._private.utils.validate_socket_filepath).
_SOCKET_TAIL = len("/ray-XXXXXXXX/ray/session_2026-11-26_10-23-32_857069_4194304/sockets/plasma_store")
MAX_SOCKET_PATH = (104 if sys.platform.startswith("darwin") else 108) - 1


def private_session_problem(address: str | None) -> str | None:
    """Why a private Ray could not start here (its temp folder's path leaves no room for Ray's sockets), or None."""
    if cluster_address(address)[0] is not None:
        return None
    root = os.path.abspath(temp_root())
    if not os.path.isdir(root):
        return f"a private Ray (ray.address unset) keeps its files under {root}, which is not a folder: set RAY_TMPDIR"
    room, found = MAX_SOCKET_PATH - _SOCKET_TAIL, len(os.fsencode(root))
    if found <= room:
        return None
    return (
        f"a private Ray (ray.address unset) puts its unix sockets under the temp folder {root} ({found} bytes), "
        f"which leaves no room for them ({MAX_SOCKET_PATH} bytes at most, {_SOCKET_TAIL} of them Ray's): set "
        f"RAY_TMPDIR to a folder of at most {room} bytes (e.g. RAY_TMPDIR=/tmp), or join a cluster (ray.address)"
    )


def _start_private(private: Path, num_cpus: int | None, dashboard: bool, runtime_env: dict) -> None:
    import ray

    if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token":
        log.warning(
            "RAY_AUTH_MODE=%s: the local Ray session's GCS, raylet and worker ports listen on all interfaces "
            "without authentication; anyone who reaches this machine can run code in it. Unset RAY_AUTH_MODE "
            "(token authentication is Ray's default) unless the machine is firewalled.",
            os.environ["RAY_AUTH_MODE"],
        )
    else:
        own_token_file()
    ray.init(
        address="local",  # never RAY_ADDRESS nor Ray's address file (cluster_address decided)
        _temp_dir=str(private / "ray"),  # Ray makes it 0777; `private` (0700) keeps other users out
        num_cpus=num_cpus,
        include_dashboard=dashboard,
        dashboard_host="127.0.0.1",
        log_to_driver=True,
        configure_logging=False,
        runtime_env=runtime_env,
    )
    log.info(
        "started a private Ray in %s (%s CPUs, dashboard %s)",
        private,
        num_cpus or "all",
        "on 127.0.0.1" if dashboard else "off",
    )


def _remove(private: Path) -> None:
    """Remove a private Ray's folder after its shutdown (nothing else: the folder is ours, made by mkdtemp)."""
    failed: list[str] = []
    shutil.rmtree(private, onexc=lambda _fn, path, err: failed.append(f"{path}: {err}"))
    if failed:
        log.warning("could not remove the private Ray's folder %s entirely: %s", private, "; ".join(failed[:3]))


def own_token_file() -> Path | None:
    """Ray's token file for a private session, readable by this user only; None when the token is not a file.

    Ray 2.60 writes a missing token file with `open(path, "w")` (0644 under the usual umask) in a 0755 `~/.ray`:
    any local user could read the token and join the session. So it is written here first, a fresh token of Ray's
    own format, 0600 (created so, never wider for a moment), its folder 0700 when made here. An existing file that
    others can read is made 0600, with a warning.
    """
    from ray._private.authentication.authentication_token_generator import generate_new_authentication_token

    if os.environ.get("RAY_AUTH_TOKEN"):
        return None
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            os.chmod(path, 0o600)
            log.warning(
                "Ray's token file %s was readable by other users (mode %o); made it 0600. Anyone who read it could "
                "join Ray sessions that use it: delete the file to have the next job write a new token",
                path,
                mode,
            )
        return path
    with os.fdopen(fd, "w") as f:
        f.write(generate_new_authentication_token())
    log.info("wrote a new Ray auth token to %s (mode 0600)", path)
    return path


@contextlib.contextmanager
def _entrypoint_from_sys_argv() -> Iterator[None]:
    """Ray 2.60 records the driver's command line as the job's entrypoint (the GCS job table: `ray list jobs`, the
    dashboard's job list) from /proc/self/cmdline, which Python cannot rewrite; the CLI has redacted secrets in
    `sys.argv` (`cli._hide_secret_overrides`), so while `ray.init` runs Ray is given that instead.

    Raises:
        RuntimeError: this Ray has no `ray._private.utils.get_entrypoint_name` (read against 2.60).
    """
    import ray
    import ray._private.utils as ray_utils

    if not callable(getattr(ray_utils, "get_entrypoint_name", None)):
        raise RuntimeError(
            f"ray {ray.__version__} has no ray._private.utils.get_entrypoint_name (miles_vl reads Ray 2.60): the "
            "job's entrypoint could carry a secret of the command line; install ray 2.60.0 (constraints.txt)"
        )
    original = ray_utils.get_entrypoint_name
    ray_utils.get_entrypoint_name = lambda: subprocess.list2cmdline([sys.executable, *sys.argv])
    try:
        yield
    finally:
        ray_utils.get_entrypoint_name = original


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
