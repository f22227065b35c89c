"""One rollout engine with its own SGLang server process: launch, wait for health, restart when it dies.

The driver runs one `SGLangRolloutHost` per engine as a Ray actor (`ray.remote(SGLangRolloutHost)`); it implements
`RolloutEngine`. Ray's `CUDA_VISIBLE_DEVICES` for the actor is inherited by the server, which uses those
GPUs from index 0 (`--tp-size` = GPUs of the engine). The host is a plain class: it runs (and is tested) without Ray.

    host = SGLangRolloutHost(ServerSpec(model_path=..., port=30000, tp_size=1), tokens)
    groups = host.generate(prompts, params)      # forwarded to SGLangRolloutEngine (engine.py)
    host.shutdown()

Ports: a spec without a port (rollout.sglang.port: null, the default) gets a free port of the node the host runs on
(`free_port`), so that two jobs on one machine never share one; a given port that is in use there is refused before
the server starts (`check_port_free`). Either way another process may bind the port while SGLang loads its model (it
binds only when it is ready): the health route answers without a key, so once healthy the host makes one call with
its key (`/server_info`), and a 401 there means the server that answers is not the one it started
(`SGLangPortTakenError`).

Access: every server has an API key, the user's (`rollout.sglang.api_key`) or else a random one the host makes for it
(`new_api_key`), so that no other local user can call it. The key reaches the server only through the private
`--config` file (0600, in a 0700 directory of the host's), never its command line or environment; the server's log
gets it as `<redacted>` (`ServerProcess`); every call of the engine sends it, and so do the trainer's NCCL weight calls
(`endpoint`). The file lives only while a server starts: SGLang reads it once, as it parses its arguments
(`prepare_server_args`, before it loads the model), so the host deletes it once the server is healthy (or failed to
start), and with it the directory when nothing else is in it (when the server's log is elsewhere), and writes it
again before a relaunch, in a new directory when the last one went. A host killed without `shutdown` (SIGKILL, a node
lost) so leaves no key on disk, unless it died while its server was starting.

Restarts: before every call, and when a call finds the server gone, the host relaunches it (the same argv but for the
config file's path, the same port and log file), at most `max_restarts` times over its life. A restarted server has
`model_path`'s weights again: when weights had been synced, the engine then refuses to generate until they are synced
again (and an NCCL weight-update group must be formed again), so a crash can cost a sync but never silently yields
samples from stale weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from miles_vl.gpu_env import CUMEM_ENV
from miles_vl.models import SpecialTokens
from miles_vl.rollout.sglang.client import (
    RequestPolicy,
    SGLangClient,
    SGLangError,
    SGLangRequestError,
    SGLangServerDiedError,
    SGLangUnavailableError,
)
from miles_vl.rollout.sglang.engine import EngineOptions, SGLangPrompt, SGLangRolloutEngine
from miles_vl.rollout.sglang.server import (
    LOOPBACK_HOSTS,
    SGLANG_LAUNCH_MODULE,
    ServerProcess,
    ServerSpec,
    build_server_argv,
    build_server_env,
    check_port_free,
    free_port,
    new_api_key,
    pixel_directory,
    pixel_wire_dtype,
    spatial_merge_size,
    wait_until_healthy,
    write_server_config,
)
from miles_vl.rollout.sglang.verify import checkpoint_names
from miles_vl.rollout.sglang.weights import EngineAddress
from miles_vl.rollout.types import Generation, RolloutEngine, SamplingParams
from miles_vl.rollout.weight_sync import SyncReport
from miles_vl.sglang_plugin.marker import marker_problem
from miles_vl.sglang_plugin.wire import PIXEL_DIR_ENV, private_directory_problem

log = logging.getLogger(__name__)

DYING_GRACE_S = 5.0  # how long an unreachable server's process may take to exit and count as dead


class SGLangPluginMissingError(RuntimeError):
    """A server that should run miles_vl's SGLang plugin (`ServerSpec.plugin`) reports no marker of it, or not every
    patch asked for (`miles_vl.sglang_plugin.marker.marker_problem` names what and the likely cause)."""


class SGLangPortTakenError(SGLangError):
    """The server that answers on the port of a server the host just started refuses the host's key (HTTP 401): another
    process (another job's SGLang server) serves that port, not the server the host started."""


class SGLangRolloutHost(RolloutEngine):
    """Owns one SGLang server process and the engine that drives it.

    Args:
        spec: what to launch; without an `api_key`, the server gets a random one, without a `port` a free one of this
            node (module docstring).
        tokens: special token ids (EOS ids stop generation; vision ids are banned when asked).
        options: how the engine sends requests and weights (`EngineOptions`, handed to `SGLangRolloutEngine`; None:
            its defaults); `prompts_per_request` above 1 without the plugin is slower (a warning). The names a
            colocated sync sends are checked against the checkpoint at `spec.model_path` whenever it is a local
            directory.
        startup_timeout_s: how long a (re)start may take to become healthy (rollout.sglang.startup_timeout_s).
        requests: how every call to the server times out and retries (`RequestPolicy`, given to its client); None:
            its defaults.
        max_restarts: relaunches of a dead server over the host's life before giving up.
        log_path: the server's log file (its directory is created); None: a file in the host's private directory.
        python: the interpreter that runs the server.
        launch_module: the module run with `python -m`: `sglang.launch_server` (with miles_vl's plugin where
            `spec.plugin` opts in), or a stand-in that takes SGLang's flags (tests).
        env: extra environment variables for the server process.
        health_poll_s: pause between health polls while starting.
        send_pixel_values: send prompts as their ids and pixel values through a private directory the server reads
            (`SGLangRolloutEngine.pixel_dir`; needs `spec.plugin`, or a stand-in that reads them). False: PNG images,
            which SGLang processes again.
        cpu_tensors_by_name: without a GPU, share CPU weight tensors with the server by shared-memory file name
            (torch's process-wide "file_system" strategy): the server cannot open this process's file descriptors.
        name: how messages name this engine (e.g. "rollout engine 1").
        partial_rollouts: the engine keeps the samples `pause_generation` aborts (`SGLangRolloutEngine`).
    """

    def __init__(
        self,
        spec: ServerSpec,
        tokens: SpecialTokens,
        options: EngineOptions | None = None,
        *,
        startup_timeout_s: float = 600.0,
        requests: RequestPolicy | None = None,
        max_restarts: int = 2,
        log_path: str | Path | None = None,
        python: str = sys.executable,
        launch_module: str = SGLANG_LAUNCH_MODULE,
        env: Mapping[str, str] | None = None,
        health_poll_s: float = 1.0,
        send_pixel_values: bool = False,
        cpu_tensors_by_name: bool = False,
        name: str = "the rollout engine",
        partial_rollouts: bool = False,
    ):
        options = EngineOptions() if options is None else options
        if cpu_tensors_by_name and not torch.cuda.is_available():
            torch.multiprocessing.set_sharing_strategy("file_system")
        if log_path is not None:
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        if not spec.api_key:
            spec = dataclasses.replace(spec, api_key=new_api_key())
        if spec.port is None:  # chosen here, on the node the server runs on
            spec = dataclasses.replace(spec, port=free_port(spec.host))
        self.spec = spec
        self.name = name
        self.startup_timeout_s = startup_timeout_s
        self.max_restarts = max_restarts
        self.health_poll_s = health_poll_s
        self.restarts = 0
        if send_pixel_values and spec.plugin is None and launch_module == SGLANG_LAUNCH_MODULE:
            raise ValueError(
                "send_pixel_values=True needs miles_vl's SGLang plugin to read the pixel files, but spec.plugin is "
                "None (rollout.sglang.launcher: sglang); set rollout.sglang.send_pixel_values=false or launcher: "
                "miles_vl"
            )
        if options.prompts_per_request > 1 and spec.plugin is None:
            log.warning(
                "prompts_per_request=%d without miles_vl's SGLang plugin: SGLang prefills the prompts of a batch one "
                "after another and sends every sample alone; the plugin (rollout.sglang.launcher: miles_vl) sends them "
                "together",
                options.prompts_per_request,
            )
        # 0700: the API-key config while a server starts (`_write_config`), and the server's log when log_path is None
        self._dir: Path | None = Path(tempfile.mkdtemp(prefix="miles_vl_sglang_"))
        self.pixel_dir: Path | None = None
        try:
            self.pixel_dir = pixel_directory() if send_pixel_values else None
            config_file = write_server_config(spec, self._dir)
            argv = build_server_argv(
                spec, python=python, module=launch_module, config_file=None if config_file is None else str(config_file)
            )
            server_env = {**build_server_env(spec), **(env or {})}
            if self.pixel_dir is not None:
                server_env[PIXEL_DIR_ENV] = str(self.pixel_dir)
            self.server = ServerProcess(
                argv,
                env=server_env,
                log_path=log_path if log_path is not None else self._dir / f"sglang_{spec.port}.log",
                redact=(spec.api_key,),
            )
            self.client = SGLangClient(
                spec.url,
                api_key=spec.api_key,
                policy=RequestPolicy() if requests is None else requests,
                liveness=self.server.death_reason,
            )
            self.engine = SGLangRolloutEngine(
                self.client,
                tokens,
                options,
                tp_size=spec.tp_size,
                weight_version=spec.weight_version,
                memory_saver=spec.colocated,
                weights_cpu_backup=spec.weights_cpu_backup,
                known_names=checkpoint_names(spec.model_path),
                deterministic=deterministic_inference(spec.extra_args),
                pixel_dir=None if self.pixel_dir is None else str(self.pixel_dir),
                pixel_dtype=pixel_wire_dtype(spec),
                spatial_merge_size=spatial_merge_size(spec.model_path),
                partial_rollouts=partial_rollouts,
            )
        except BaseException:  # nothing started yet: only the private files to remove
            self._remove_private_files()
            raise
        try:
            self._launch()
        except BaseException:
            self.shutdown()
            raise

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def log_path(self) -> Path:
        return self.server.log_path

    def _launch(self) -> None:
        # a relaunch waits a little for the last server's socket to go; a first start has no such socket
        check_port_free(self.spec.host, self.spec.port, wait_s=5.0 if self.server.starts else 0.0, engine=self.name)
        self._write_config()
        try:
            self.server.start()
            waited = wait_until_healthy(
                self.client, self.server, timeout_s=self.startup_timeout_s, poll_s=self.health_poll_s
            )
        finally:  # read by now: SGLang parses its arguments before it loads the model, long before it is healthy
            self._remove_config()
        info = self._own_server_info()
        log.info("SGLang server %s healthy after %.1fs (pid %s)", self.url, waited, self.server.pid)
        if self.spec.plugin is not None:
            self._check_plugin(info)

    def _own_server_info(self) -> dict[str, Any]:
        """`/server_info`, with this host's key: the first call that needs it, so a 401 means the server answering on
        the port is not the one this host started (whose key it is), but another process's that bound it first."""
        try:
            return self.client.server_info()
        except SGLangRequestError as e:
            if e.status_code != 401:
                raise
            raise SGLangPortTakenError(
                f"{self.name}: the SGLang server answering on {self.url} refuses this engine's API key (HTTP 401 on "
                f"/server_info): port {self.spec.port} is served by another process (another job's SGLang server?), "
                f"not by the server this engine started (pid {self.server.pid}, log {self.server.log_path}). Set "
                "rollout.sglang.port to a range that is free on every node (engine i uses port + i), or leave it "
                "null: each engine's server then takes a free port of its node"
            ) from None

    def _check_plugin(self, info: dict[str, Any]) -> None:
        """Refuse a server that should run miles_vl's plugin but reports no marker of it, or lacks a patch asked for
        (`marker_problem`): it would run, slower or unable to read pixel files, without saying so."""
        problem = marker_problem(
            info, self.spec.plugin.patches(), (self.server.env or os.environ).get("SGLANG_PLUGINS")
        )
        if problem is not None:
            raise SGLangPluginMissingError(f"SGLang server {self.url}: {problem} (log: {self.server.log_path})")

    def _restart(self, why: str) -> None:
        if self.restarts >= self.max_restarts:
            raise SGLangServerDiedError(
                f"SGLang server {self.url} died again after {self.restarts} restart(s) (max_restarts="
                f"{self.max_restarts}): {why}"
            )
        self.restarts += 1
        log.warning("SGLang server %s is down (%s); restart %d/%d", self.url, why, self.restarts, self.max_restarts)
        self.server.stop()
        self._launch()
        self.engine.server_restarted()

    def ensure_running(self) -> None:
        """Relaunch the server if its process has exited (counts against `max_restarts`)."""
        reason = self.server.death_reason()
        if reason is not None:
            self._restart(reason)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Forward to the engine; on a server death, restart and try once more (the engine refuses if weights
        were lost, with a message that says to sync them again)."""
        self.ensure_running()
        try:
            return getattr(self.engine, method)(*args, **kwargs)
        except SGLangServerDiedError as e:
            reason = str(e)
        except SGLangUnavailableError as e:
            # Refused connections from a server whose process has not exited yet (the client's liveness check ran
            # too early): a death all the same, once the process is gone.
            if not self.server.exits_within(DYING_GRACE_S):
                raise
            reason = f"{e}; then {self.server.death_reason()}"
        self._restart(reason)
        return getattr(self.engine, method)(*args, **kwargs)

    # RolloutEngine (the constructor waited for health: `ready` returns at once) -------------------------------------

    def generate(self, prompts: Sequence[SGLangPrompt], params: SamplingParams) -> list[list[Generation]]:
        """`SGLangRolloutEngine.generate` with the restart rule of this module."""
        return self._call("generate", prompts, params)

    def load_weights(
        self, named_tensors: Iterable[tuple[str, Tensor]], *, weight_version: str | None = None
    ) -> SyncReport:
        """`SGLangRolloutEngine.load_weights` (colocated sync). The tensors are kept as a list for the duration of
        the call, so that a sync interrupted by a server death can be sent again in full to the relaunched server."""
        return self._call("load_weights", list(named_tensors), weight_version=weight_version)

    def begin_weight_sync(self) -> None:
        """`SGLangRolloutEngine.begin_weight_sync`: a colocated sync whose buckets arrive one call at a time."""
        self._call("begin_weight_sync")

    def load_weight_bucket(self, named_tensors: Sequence[tuple[str, Tensor]]) -> None:
        """`SGLangRolloutEngine.load_weight_bucket`; raises `EngineStateError` when the server restarted since the
        sync began (begin it again)."""
        self._call("load_weight_bucket", list(named_tensors))

    def finish_weight_sync(self, weight_version: str | None = None) -> SyncReport:
        """`SGLangRolloutEngine.finish_weight_sync`."""
        return self._call("finish_weight_sync", weight_version)

    @property
    def weights_missing(self) -> str | None:
        """Why the server's weights cannot be used now (a restart or release lost them), or None when they can."""
        return self.engine.weights_missing

    def needs_weights(self) -> bool:
        """True when the server cannot generate until weights are synced again (it restarted, or it was released
        without a CPU backup). A dead server is relaunched first (that counts as a restart)."""
        self.ensure_running()
        return self.weights_missing is not None

    def server_restarts(self) -> int:
        return self.restarts

    def endpoint(self) -> EngineAddress:
        """How the trainer reaches this server (its node's address unless the server binds loopback) and the GPUs it
        runs on."""
        import ray

        loopback = self.spec.host in LOOPBACK_HOSTS
        node_ip = ray.util.get_node_ip_address()
        url = self.spec.url if loopback else f"http://{node_ip}:{self.spec.port}"
        env = self.server.env if self.server.env is not None else os.environ
        gpus = env.get("CUDA_VISIBLE_DEVICES")  # the server's TP rank r runs on the r-th (colocated: ipc_sources)
        gpu_ids = tuple(g.strip() for g in gpus.split(",") if g.strip()) if gpus else None
        return EngineAddress(url, self.spec.api_key, self.spec.tp_size, node_ip, loopback, env.get(CUMEM_ENV), gpu_ids)

    def release_memory(self) -> None:
        """`SGLangRolloutEngine.release_memory` (needs `ServerSpec.colocated`)."""
        self._call("release_memory")

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """`SGLangRolloutEngine.resume_memory`; sync weights before the next generate unless they are backed up."""
        self._call("resume_memory", tags)

    def expect_weight_version(self, version: str) -> None:
        """Record an NCCL sync the trainer drove (`DistributedWeightSender.send`) to this engine's server."""
        self.engine.expect_weight_version(version)

    def pause_generation(self) -> int:
        """`SGLangRolloutEngine.pause_generation` (partial rollouts). It runs while a `generate` is in flight: the
        actor runs `generate` in a concurrency group of its own (orchestration/factories.py `launch_sglang`). Not
        under the restart rule: a server that died fails the pause, and the generate in flight recovers it."""
        return self.engine.pause_generation()

    def continue_generation(self) -> None:
        """`SGLangRolloutEngine.continue_generation` (partial rollouts), after the sync."""
        self.engine.continue_generation()

    # -----------------------------------------------------------------------------------------------------------------

    def health(self) -> bool:
        """The process runs and `/health_generate` answers 200."""
        return self.server.is_alive() and self.client.is_healthy()

    def shutdown(self) -> None:
        """Stop the server (its whole process group) and delete the API-key file and the pixel directory; the log
        stays for post-mortems (the private directory is removed when it holds nothing else)."""
        self.server.stop()
        self.client.close()
        self._remove_private_files()

    def _write_config(self) -> None:
        """Write the API-key config that the server's argv names, in a new private directory when the last one was
        removed (`_remove_config`) or is no longer a private directory of this user (`private_directory_problem`: a
        cleaner of /tmp removed it, and another local user may have made one of that name since): never into a
        directory this host did not make."""
        directory = self._dir
        if directory is None or private_directory_problem(directory) is not None:
            directory = self._dir = Path(tempfile.mkdtemp(prefix="miles_vl_sglang_"))
        path = write_server_config(self.spec, directory)
        self.server.argv[self.server.argv.index("--config") + 1] = str(path)

    def _remove_config(self) -> None:
        """Delete the API-key config, and its directory when nothing else (the server's log) is in it."""
        directory = self._dir
        if directory is None:
            return
        for path in directory.glob("*.yaml"):
            path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # not empty: the log stays in it
            directory.rmdir()
            self._dir = None

    def _remove_private_files(self) -> None:
        if self.pixel_dir is not None:
            shutil.rmtree(self.pixel_dir, ignore_errors=True)
        self._remove_config()


def deterministic_inference(extra_args: Sequence[str]) -> bool:
    """Whether these server flags make SGLang 0.5.16 honour `sampling_seed`: `--enable-deterministic-inference`, or
    `--rl-on-policy-target`, which turns it on (`ServerArgs._handle_deterministic_inference`, srt/server_args.py)."""
    return any(
        a == "--enable-deterministic-inference" or a.split("=", 1)[0] == "--rl-on-policy-target" for a in extra_args
    )
