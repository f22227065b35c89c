"""Contract: `SGLangRolloutHost` launches its server from `build_server_argv` (here with
`-m tests.rollout.sglang.fake_server` in place of `-m sglang.launch_server`: every flag and the API-key config file
are the real ones), waits for health, checks that a server meant to run miles_vl's SGLang plugin reports its marker,
serves the `RolloutEngine` calls, and relaunches a dead server transparently while no weights were synced; once
weights were synced, a relaunch makes the engine refuse to generate until they are synced again; restarts are
bounded."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import stat
import tempfile
from pathlib import Path

import httpx
import pytest
import torch

from miles_vl.gpu_env import nccl_peer_env
from miles_vl.rollout.sglang import (
    EngineStateError,
    RequestPolicy,
    ServerSpec,
    SGLangPluginMissingError,
    SGLangPortTakenError,
    SGLangRolloutHost,
    SGLangServerDiedError,
)
from miles_vl.rollout.sglang.host import deterministic_inference
from miles_vl.rollout.sglang.server import check_port_free
from miles_vl.rollout.types import SamplingParams
from miles_vl.sglang_plugin.settings import PluginSettings
from tests.rollout.sglang.conftest import MAX_PIXELS, MIN_PIXELS, TOKENS, free_port, make_prompt

REPO_ROOT = Path(__file__).resolve().parents[3]

PARAMS = SamplingParams(n=2, max_new_tokens=5, seed=3)
PLUGIN = PluginSettings()  # the production default (rollout.sglang.launcher: miles_vl)


def host(
    tmp_path, *, extra_args=(), api_key="k3y", colocated=False, plugin=PLUGIN, port=0, **kwargs
) -> SGLangRolloutHost:
    """A host whose server is the stand-in, launched with the argv and config file the host builds for SGLang; `port`
    0: a free port the test picks, None: the host picks one."""
    spec = ServerSpec(
        model_path="/ckpt/m",
        port=free_port() if port == 0 else port,
        api_key=api_key,
        colocated=colocated,
        weight_version="base",
        image_min_pixels=MIN_PIXELS,
        image_max_pixels=MAX_PIXELS,
        extra_args=("--enable-deterministic-inference", *extra_args),  # responses are compared across restarts
        plugin=plugin,
    )
    kwargs.setdefault("max_restarts", 2)
    return SGLangRolloutHost(
        spec,
        TOKENS,
        startup_timeout_s=20,
        requests=RequestPolicy(timeout_s=5, max_retries=1, backoff_s=0.01),
        log_path=kwargs.pop("log_path", tmp_path / "server.log"),
        launch_module="tests.rollout.sglang.fake_server",
        env=kwargs.pop("env", {"PYTHONPATH": str(REPO_ROOT)}),
        health_poll_s=0.05,
        **kwargs,
    )


def kill(h: SGLangRolloutHost) -> None:
    os.kill(h.server.pid, signal.SIGKILL)
    h.server._proc.wait(timeout=5)


def test_the_endpoint_names_the_gpus_its_server_runs_on_in_tp_rank_order(tmp_path, monkeypatch):
    """The colocated IPC sync matches each TP rank's GPU with the trainer rank on it (weights.ipc_sources): the
    server's CUDA_VISIBLE_DEVICES, as the host gave it, in order; None where neither the host nor the environment the
    server inherits sets it."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    h = host(tmp_path, env={"PYTHONPATH": str(REPO_ROOT), "CUDA_VISIBLE_DEVICES": "3,1"})
    try:
        assert h.endpoint().gpu_ids == ("3", "1") and h.server.env["CUDA_VISIBLE_DEVICES"] == "3,1"
    finally:
        h.shutdown()
    h = host(tmp_path)
    try:
        assert h.endpoint().gpu_ids is None
    finally:
        h.shutdown()


def responses(groups) -> list[list[list[int]]]:
    return [[g.response_ids.tolist() for g in gs] for gs in groups]


def test_host_serves_with_the_real_argv_and_api_key(tmp_path):
    h = host(tmp_path)
    try:
        assert "--api-key" not in h.server.argv and "k3y" not in " ".join(h.server.argv)
        groups = h.generate([make_prompt([1, 2], 1), make_prompt([3])], PARAMS)
        assert [len(g) for g in groups] == [2, 2]
        assert h.health() and h.restarts == 0
        assert h.engine.deterministic  # --enable-deterministic-inference in the server's flags: seeds count
        calls = h.client.get_json("/_fake/calls")
        assert {c["path"] for c in calls} >= {"/health_generate", "/generate"}
        assert all(c["auth"] for c in calls)  # the key from the config file is enforced, and the client sends it
        config = Path(h.server.argv[h.server.argv.index("--config") + 1])
        assert not config.exists() and not config.parent.exists()  # read at the start, deleted once healthy
        # the trainer's NCCL group is checked against the cuMem setting the server really runs with (issue 32.1)
        assert h.endpoint().nccl_cumem == h.server.env["NCCL_CUMEM_ENABLE"] == nccl_peer_env()["NCCL_CUMEM_ENABLE"]
    finally:
        h.shutdown()
    assert not h.server.is_alive() and not config.exists()  # the API key does not outlive the server
    assert "fake-sglang" in h.log_path.read_text()


def test_a_dead_server_is_relaunched_transparently_before_any_sync(tmp_path):
    h = host(tmp_path)
    try:
        before = responses(h.generate([make_prompt([4, 5], 1)], PARAMS))
        kill(h)  # died between calls
        assert responses(h.generate([make_prompt([4, 5], 1)], PARAMS)) == before
        assert h.restarts == 1
        h.client.post_json("/_fake/inject", {"path": "/generate", "kind": "exit", "value": 1, "times": 1})
        assert responses(h.generate([make_prompt([4, 5], 1)], PARAMS)) == before  # died during the call
        assert h.restarts == 2
        h.client.post_json("/_fake/inject", {"path": "/generate", "kind": "exit", "value": 1, "times": 1})
        with pytest.raises(SGLangServerDiedError, match=r"died again after 2 restart\(s\) \(max_restarts=2\)"):
            h.generate([make_prompt([4, 5], 1)], PARAMS)
    finally:
        h.shutdown()


def test_refused_connections_from_a_dying_server_count_as_its_death(tmp_path, monkeypatch):
    """The client's liveness check can run between a dying server closing its socket and its process exiting: the
    call then ends in SGLangUnavailableError (connections refused). The host waits a moment for the process; if it
    exits, that is a death (relaunch, try once more); a live but unreachable server's error is raised as it was."""
    from miles_vl.rollout.sglang import SGLangUnavailableError
    from miles_vl.rollout.sglang import host as host_module

    monkeypatch.setattr(host_module, "DYING_GRACE_S", 2.0)  # a killed stand-in exits in ~50 ms; a busy CI: more
    h = host(tmp_path)
    try:
        before = responses(h.generate([make_prompt([4, 5], 1)], PARAMS))
        real = h.engine.generate
        calls = []

        def dies_while_refusing(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                os.kill(h.server.pid, signal.SIGKILL)  # exits, not yet reaped: liveness would still say alive
                raise SGLangUnavailableError("POST /generate failed 2 time(s); last error: ConnectError")
            return real(*args, **kwargs)

        monkeypatch.setattr(h.engine, "generate", dies_while_refusing)
        assert responses(h.generate([make_prompt([4, 5], 1)], PARAMS)) == before
        assert h.restarts == 1 and len(calls) == 2

        def refuses(*args, **kwargs):
            raise SGLangUnavailableError("POST /generate failed 2 time(s); last error: ReadTimeout")

        monkeypatch.setattr(h.engine, "generate", refuses)
        with pytest.raises(SGLangUnavailableError, match="ReadTimeout"):
            h.generate([make_prompt([4, 5], 1)], PARAMS)
        assert h.restarts == 1 and h.server.is_alive()
    finally:
        h.shutdown()


def test_a_relaunch_after_a_sync_refuses_to_generate_until_the_next_sync(tmp_path):
    h = host(tmp_path)
    try:
        h.expect_weight_version("step-3")  # as after an NCCL sync driven by the trainer
        kill(h)
        with pytest.raises(
            EngineStateError, match="restarted and reloaded model_path, losing the synced weights 'step-3'"
        ):
            h.generate([make_prompt([1])], PARAMS)
        assert h.restarts == 1
        h.client.update_weight_version("step-4")  # the trainer re-syncs (weights themselves elided here)
        h.expect_weight_version("step-4")
        assert len(h.generate([make_prompt([1])], PARAMS)) == 1
    finally:
        h.shutdown()


def test_a_server_that_cannot_start_is_reported_with_its_log_and_leaves_no_key(tmp_path, monkeypatch):
    private = _record_private_directories(monkeypatch)
    with pytest.raises(SGLangServerDiedError, match="(?s)died while starting.*scheduled exit"):
        host(tmp_path, api_key="k3y-dead", extra_args=("--fake-startup-delay", "30", "--fake-exit-after", "0.2"))
    assert len(private) == 1 and not private[0].exists()
    assert not _files_holding("k3y-dead", tmp_path)


def _record_private_directories(monkeypatch) -> list[Path]:
    """The private directories hosts make (`tempfile.mkdtemp` with their prefix) from now on, in order; another
    thread's temporary directory meanwhile is not one of them."""
    from miles_vl.rollout.sglang import host as host_module

    made: list[Path] = []
    mkdtemp = host_module.tempfile.mkdtemp

    def record(*args, **kw):
        path = mkdtemp(*args, **kw)
        if kw.get("prefix") == "miles_vl_sglang_":
            made.append(Path(path))
        return path

    monkeypatch.setattr(host_module.tempfile, "mkdtemp", record)
    return made


def _files_holding(secret: str, *roots: Path) -> list[Path]:
    """Files under `roots` and in the hosts' private directories of the temporary directory that contain `secret`."""
    candidates = [p for root in roots for p in root.rglob("*")]
    candidates += Path(tempfile.gettempdir()).glob("miles_vl_sglang_*/*")
    found = []
    for path in candidates:
        with contextlib.suppress(OSError):  # another test's host may remove its files meanwhile
            if path.is_file() and secret.encode() in path.read_bytes():
                found.append(path)
    return found


def test_the_key_file_lives_only_while_a_server_starts(tmp_path, monkeypatch):
    """SGLang reads its --config once, as it parses its arguments, before it loads the model (the stand-in too; the
    real server: tests/gpu/test_sglang_real.py). So the host deletes the file once its server is healthy, with the
    directory when nothing else is in it: a host killed later without `shutdown` (SIGKILL, a lost node) leaves no key
    on disk. A relaunch writes the file again, in a new directory (never one of the old name, which another local user
    may have made since), and the relaunched server enforces the key: it read the new file. With log_path None the
    directory stays for the log, without the key."""
    key = "k3y-relaunch"
    private = _record_private_directories(monkeypatch)
    h = host(tmp_path, api_key=key)
    try:
        assert len(private) == 1 and not private[0].exists() and not _files_holding(key, tmp_path)
        kill(h)
        assert len(h.generate([make_prompt([1])], PARAMS)) == 1 and h.restarts == 1
        assert len(private) == 2 and private[1] != private[0] and not private[1].exists()
        assert Path(h.server.argv[h.server.argv.index("--config") + 1]).parent == private[1]
        assert not _files_holding(key, tmp_path)
        with httpx.Client(base_url=h.url, trust_env=False, timeout=5) as raw:
            assert raw.post("/generate", json={}).status_code == 401
            assert raw.get("/model_info", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    finally:
        h.shutdown()
    h = host(tmp_path / "default-log", api_key=key, log_path=None)
    try:
        directory = private[2]
        assert sorted(p.name for p in directory.iterdir()) == [f"sglang_{h.spec.port}.log"]
        assert not _files_holding(key, tmp_path)
        # the directory is no longer this user's 0700 one (as if a cleaner of /tmp removed it and another account
        # made one of that name): the relaunch writes the key into a new directory of its own, not into that one
        directory.chmod(0o755)
        kill(h)
        assert len(h.generate([make_prompt([1])], PARAMS)) == 1 and h.restarts == 1
        assert len(private) == 4 and not private[3].exists() and not _files_holding(key, tmp_path)
        assert not list(directory.glob("*.yaml"))
    finally:
        h.shutdown()
        assert h.log_path.parent == directory and h.log_path.exists()  # kept for post-mortems, as before
        shutil.rmtree(directory)


def test_a_relaunch_that_fails_leaves_no_key_though_the_host_lives_on(tmp_path, monkeypatch):
    """The config file goes when the server fails to start as when it starts: a relaunch whose server dies while
    starting (here: the stand-in told to exit before it is healthy) raises, and the host, not shut down, holds no
    key on disk."""
    key = "k3y-relaunch-fails"
    private = _record_private_directories(monkeypatch)
    h = host(tmp_path, api_key=key, max_restarts=1)
    try:
        h.server.argv += ["--fake-startup-delay", "30", "--fake-exit-after", "0.2"]  # the next start fails
        kill(h)
        with pytest.raises(SGLangServerDiedError, match="(?s)died while starting.*scheduled exit"):
            h.ensure_running()
        assert len(private) == 2 and not any(p.exists() for p in private)
        assert not _files_holding(key, tmp_path)
    finally:
        h.shutdown()


def test_hosts_without_a_port_take_free_ports_of_their_own(tmp_path):
    """GPU run of 2026-11-26: two jobs on one machine both started their server on port 30000 (the old default of
    rollout.sglang.port). Without a port (rollout.sglang.port: null, the default now) each host picks a free port of its
    own node, and two hosts at once get two ports, each serving its own host's calls."""
    hosts = [host(tmp_path / f"h{i}", api_key=None, port=None) for i in range(2)]
    try:
        ports = [h.spec.port for h in hosts]
        assert None not in ports and ports[0] != ports[1]
        for h, port in zip(hosts, ports, strict=True):
            assert h.url == f"http://127.0.0.1:{port}" and h.server.argv[h.server.argv.index("--port") + 1] == str(port)
            assert len(h.generate([make_prompt([1, 2], 1)], PARAMS)[0]) == 2
    finally:
        for h in hosts:
            h.shutdown()


def test_a_configured_port_in_use_is_refused_before_the_server_starts(tmp_path):
    """A given port that something on the node holds (here a listening socket: another job's server) is an error
    naming the port, the engine and the fix, raised before any server process starts; nothing of the host is left."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"rollout engine 2 on 127.0.0.1:{port}: the port is in use") as info:
            host(tmp_path, port=port, name="rollout engine 2")
    assert "rollout.sglang.port" in str(info.value) and "leave it null" in str(info.value)
    log = tmp_path / "server.log"
    assert not log.exists() or "=== miles_vl: start" not in log.read_text()  # no server was started


@pytest.mark.parametrize("plugin", [PLUGIN, None], ids=["plugin", "sglang"])
def test_another_processs_server_on_the_port_is_named_not_just_refused(tmp_path, monkeypatch, plugin):
    """GPU run of 2026-11-26: the second job's server was still loading its model (SGLang binds its port only then)
    when the first job's server, on the same port, became healthy: the second host's health check (an open route)
    passed on the first job's server, and the job died with `SGLang GET /server_info ... refused with HTTP 401`. Here
    another server with another key binds the port just after the host checked it, while the host's own stand-in is
    still "loading" (--fake-bind-delay). The host's first keyed call gets the 401 and says the port is served by another
    process, naming the port, the engine and the fix (without the plugin too, where no call used the key at start),
    and stops its own server."""
    from miles_vl.rollout.sglang import host as host_module
    from tests.rollout.sglang.fake_server import FakeSGLang

    others: list[FakeSGLang] = []
    started: list[host_module.ServerProcess] = []

    def check_then_lose_the_port(host_, port, **kwargs):
        check_port_free(host_, port, **kwargs)
        others.append(FakeSGLang(port, api_key="another-jobs-key").start())  # binds in the window

    class Recorded(host_module.ServerProcess):
        def start(self):
            started.append(self)
            super().start()

    monkeypatch.setattr(host_module, "check_port_free", check_then_lose_the_port)
    monkeypatch.setattr(host_module, "ServerProcess", Recorded)
    port = free_port()
    try:
        with pytest.raises(SGLangPortTakenError) as info:
            host(tmp_path, port=port, plugin=plugin, extra_args=("--fake-bind-delay", "60"), name="rollout engine 1")
        message = str(info.value)
        assert f"rollout engine 1: the SGLang server answering on http://127.0.0.1:{port} refuses" in message
        assert f"port {port} is served by another process" in message and "HTTP 401" in message
        assert "rollout.sglang.port" in message and "leave it null" in message
        assert [c["path"] for c in others[0].calls][-1] == "/server_info"
        assert len(started) == 1 and not started[0].is_alive()  # its own server was stopped
    finally:
        for other in others:
            other.stop()


def test_which_server_flags_make_the_seed_count():
    """0.5.16 honours sampling_seed with --enable-deterministic-inference, and --rl-on-policy-target turns that on."""
    assert deterministic_inference(("--log-level", "info", "--enable-deterministic-inference"))
    assert deterministic_inference(("--rl-on-policy-target", "fsdp")) and deterministic_inference(
        ("--rl-on-policy-target=fsdp",)
    )
    assert not deterministic_inference(("--log-level", "info")) and not deterministic_inference(())


def test_a_host_that_sends_pixel_values_owns_their_directory(tmp_path):
    """With send_pixel_values the host makes a private directory (0700, in /dev/shm where there is one), names it to
    the server (MILES_VL_SGLANG_PIXEL_DIR: the stand-in process reads the engine's files there, video included) and
    removes it with the server; by default (send_pixel_values: false) PNG images go."""
    from tests.rollout.sglang.conftest import make_video_prompt

    png = host(tmp_path / "png")
    try:
        assert png.pixel_dir is None and png.engine.pixel_dir is None
    finally:
        png.shutdown()
    h = host(tmp_path, send_pixel_values=True)
    try:
        directory = h.pixel_dir
        assert directory is not None and directory.is_dir() and (directory.stat().st_mode & 0o777) == 0o700
        if Path("/dev/shm").is_dir():
            assert directory.parent == Path("/dev/shm")
        assert h.engine.pixel_dir == str(directory) and h.engine.pixel_dtype == torch.float32  # /ckpt/m: unreadable
        groups = h.generate([make_prompt([1, 2], 1, with_images=False), make_video_prompt([3], 2)], PARAMS)
        assert [len(g) for g in groups] == [2, 2] and list(directory.iterdir()) == []
    finally:
        h.shutdown()
    assert not directory.exists()


def test_a_host_that_fails_before_its_server_starts_leaves_no_directories(tmp_path, monkeypatch):
    """The pixel directory and the private one are made before the engine; an engine that cannot be built (here: it
    raises) removes both, as a server that cannot start does (shutdown)."""
    from miles_vl.rollout.sglang import host as host_module

    made = []

    def pixel_directory():
        made.append(Path(host_module.tempfile.mkdtemp(prefix="pixels_", dir=tmp_path)))
        return made[-1]

    def broken_engine(*args, **kwargs):
        raise ValueError("bad engine settings")

    monkeypatch.setattr(host_module, "pixel_directory", pixel_directory)
    monkeypatch.setattr(host_module, "SGLangRolloutEngine", broken_engine)
    private = _record_private_directories(monkeypatch)
    with pytest.raises(ValueError, match="bad engine settings"):
        host(tmp_path, send_pixel_values=True)
    assert len(made) == 1 and not made[0].exists()
    assert private and not any(p.exists() for p in private)


# ---------------------------------------------------------------------------------------------------------------------
# issue 30.4: every server has a key, and every call sends it


def _process_texts(pid: int) -> str:
    """What other local users can read of a process: its command line (and, for its owner, its environment)."""
    return "".join(Path(f"/proc/{pid}/{what}").read_bytes().decode(errors="replace") for what in ("cmdline", "environ"))


def test_every_server_gets_a_key_of_its_own_that_no_argv_or_log_holds(tmp_path, monkeypatch):
    """Issue 30.4: without rollout.sglang.api_key a server had none, so any local account could call /generate, the
    weight routes or /release_memory_occupation. Now each host makes a random key for its server: two servers get
    different keys; a call without the key, or with another server's, is refused with 401 as 0.5.16's middleware
    refuses it (the stand-in enforces it the same way), on every route but /health*; the key is on no command line and
    in no environment of the server, and not in its log although the server logs it (0.5.16's `server_args=` line,
    which the stand-in writes too): only the config file holds it (0600, in the host's 0700 directory), and only while
    the server starts."""
    from miles_vl.rollout.sglang import host as host_module

    written = []
    write = host_module.write_server_config

    def write_server_config(spec, directory):
        path = write(spec, directory)
        modes = stat.S_IMODE(path.stat().st_mode), stat.S_IMODE(path.parent.stat().st_mode)
        written.append((*modes, spec.api_key in path.read_text()))
        return path

    monkeypatch.setattr(host_module, "write_server_config", write_server_config)
    hosts = [host(tmp_path / f"h{i}", api_key=None) for i in range(2)]
    try:
        keys = [h.spec.api_key for h in hosts]
        assert keys[0] != keys[1] and all(len(k) >= 43 for k in keys)  # 32 random bytes each
        assert all(k not in repr(h.spec) + repr(h.endpoint()) for h, k in zip(hosts, keys, strict=True))
        for h, key, other in ((hosts[0], keys[0], keys[1]), (hosts[1], keys[1], keys[0])):
            with httpx.Client(base_url=h.url, trust_env=False, timeout=5) as raw:
                for path in ("/generate", "/update_weights_from_tensor", "/release_memory_occupation", "/flush_cache",
                             "/model_info", "/no_such_route"):  # fmt: skip
                    for headers in ({}, {"Authorization": f"Bearer {other}"}, {"Authorization": key}):
                        answer = raw.post(path, json={}, headers=headers)
                        assert (answer.status_code, answer.json()) == (401, {"error": "Unauthorized"}), (path, headers)
                assert raw.get("/health_generate").status_code == 200 and raw.get("/health").status_code == 200
                assert raw.get("/model_info", headers={"Authorization": f"bearer {key}"}).status_code == 200
            assert key not in " ".join(h.server.argv) and key not in _process_texts(h.server.pid)
            assert not _files_holding(key, tmp_path)  # the config file was read at the start, and is gone
        assert written == [(0o600, 0o700, True)] * 4  # each host: its __init__ and its launch
    finally:
        for h in hosts:
            h.shutdown()
    for h, key in zip(hosts, keys, strict=True):
        log = h.log_path.read_text()
        assert "server_args=ServerArgs(" in log and "api_key='<redacted>'" in log and key not in log
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert files and not any(k.encode() in p.read_bytes() for p in files for k in keys)


def test_the_whole_engine_path_runs_with_the_generated_key(tmp_path):
    """Issue 30.4: every call miles_vl makes to a server carries its key: the host's generate, a colocated weight sync
    (buckets, the weights checker, the version label, the cache flush), memory release and resume, model and server
    info, health; and the trainer's NCCL sync (gloo here) to two servers with keys of their own, through the
    addresses the hosts hand it (`endpoint`). The stand-in refuses a call without the key (401), so a path that
    forgot it fails here; and it records that every call it got was authorized."""
    from miles_vl.rollout.sglang.weights import open_trainer_group

    h = host(tmp_path, api_key=None, colocated=True, max_restarts=0, cpu_tensors_by_name=True)
    other = host(tmp_path / "other", api_key=None)
    try:
        assert h.spec.api_key and other.spec.api_key  # made by the hosts: the stand-ins enforce them
        h.generate([make_prompt([1, 2], 1)], PARAMS)
        h.release_memory()
        h.resume_memory()
        tensors = [("model.layers.0.weight", torch.randn(4, 3)), ("lm_head.weight", torch.randn(6, 4))]
        assert h.load_weights(tensors, weight_version="step-1").weight_version == "step-1"
        h.begin_weight_sync()
        h.load_weight_bucket(tensors[:1])
        h.finish_weight_sync("step-2")
        assert len(h.generate([make_prompt([3])], PARAMS)) == 1
        assert h.client.model_info()["weight_version"] == "step-2" and h.client.server_info() is not None
        assert h.health()
        sender = open_trainer_group(
            [h.endpoint(), other.endpoint()], backend="gloo", max_bucket_bytes=64, request_timeout_s=30, timeout_s=20
        )
        try:
            report = sender.send(iter(tensors), weight_version="step-3")
        finally:
            sender.close()
        assert report.tensors == 2
        for server in (h, other):
            calls = server.client.get_json("/_fake/calls")
            assert all(c["auth"] for c in calls), [c["path"] for c in calls if not c["auth"]]
            assert server.client.model_info()["weight_version"] == "step-3"
        paths = {c["path"] for c in h.client.get_json("/_fake/calls")}
        assert paths >= {
            "/generate", "/release_memory_occupation", "/resume_memory_occupation", "/update_weights_from_tensor",
            "/weights_checker", "/update_weight_version", "/flush_cache", "/init_weights_update_group",
            "/update_weights_from_distributed", "/destroy_weights_update_group", "/server_info", "/health_generate",
        }  # fmt: skip
    finally:
        h.shutdown()
        other.shutdown()


@pytest.mark.parametrize(
    ("extra_args", "env", "cause"),
    [
        (("--fake-stock",), {}, "predates the plugin's entry point"),  # asked for, but the install does not load it
        (("--fake-stock",), {"SGLANG_PLUGINS": "other"}, "SGLANG_PLUGINS='other' in its environment does not name"),
    ],
)
def test_a_server_without_the_plugins_marker_is_refused(tmp_path, extra_args, env, cause):
    """A server that should run miles_vl's plugin but reports no marker in /server_info (an install without the entry
    point, SGLANG_PLUGINS naming other plugins, another release) would run slower or fail on pixel files without
    saying so: the host stops it at start with an error naming the missing marker, the likely cause and the fix, and
    leaves nothing running."""
    with pytest.raises(SGLangPluginMissingError, match="no 'miles_vl_plugin'") as refused:
        host(tmp_path, extra_args=extra_args, env={"PYTHONPATH": str(REPO_ROOT), **env})
    assert cause in str(refused.value) and "rollout.sglang.launcher: sglang" in str(refused.value)
    stock = host(tmp_path / "stock", extra_args=extra_args, plugin=None)  # launcher sglang: no marker expected
    stock.shutdown()


def test_a_server_lacking_a_patch_the_config_asked_for_is_refused():
    """The marker must list every patch the host's settings ask for (vision graphs only when asked)."""
    from miles_vl.sglang_plugin.marker import MARKER_KEY, marker_problem, new_marker

    asked = PluginSettings(vision_graphs=2).patches()
    live = new_marker("0.5.16", "v0_5_16", dict.fromkeys(PluginSettings().patches(), "live"), {})
    problem = marker_problem({MARKER_KEY: live, "version": "0.5.16"}, asked, None)
    assert problem is not None and "lacks the plugin patches ['vision']" in problem
    assert marker_problem({MARKER_KEY: live}, PluginSettings().patches(), None) is None
    off = new_marker("0.5.16", "v0_5_16", dict.fromkeys(asked, "live") | {"vision": "off: --tp-size 2"}, {})
    assert marker_problem({MARKER_KEY: off}, asked, None) is None  # the plugin's own decision, reported
