"""Contract: `SGLangRolloutHost` launches its server from `build_server_argv` (here with
`-m tests.rollout.sglang.fake_server` in place of `-m sglang.launch_server`: every flag and the API-key config file
are the real ones), waits for health, serves the `RolloutEngine` calls, and relaunches a dead server transparently
while no weights were synced; once weights were synced, a relaunch makes the engine refuse to generate until they
are synced again; restarts are bounded."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from miles_vl.gpu_env import nccl_peer_env
from miles_vl.rollout.sglang import EngineStateError, ServerSpec, SGLangRolloutHost, SGLangServerDiedError
from miles_vl.rollout.sglang.host import deterministic_inference
from miles_vl.rollout.types import SamplingParams
from tests.rollout.sglang.conftest import MAX_PIXELS, MIN_PIXELS, TOKENS, free_port, make_prompt

REPO_ROOT = Path(__file__).resolve().parents[3]

PARAMS = SamplingParams(n=2, max_new_tokens=5, seed=3)


def host(tmp_path, *, extra_args=(), **kwargs) -> SGLangRolloutHost:
    """A host whose server is the stand-in, launched with the argv and config file the host builds for SGLang."""
    spec = ServerSpec(
        model_path="/ckpt/m",
        port=free_port(),
        api_key="k3y",
        weight_version="base",
        image_min_pixels=MIN_PIXELS,
        image_max_pixels=MAX_PIXELS,
        extra_args=("--enable-deterministic-inference", *extra_args),  # responses are compared across restarts
    )
    kwargs.setdefault("max_restarts", 2)
    return SGLangRolloutHost(
        spec,
        TOKENS,
        startup_timeout_s=20,
        request_timeout_s=5,
        max_retries=1,
        retry_backoff_s=0.01,
        log_path=tmp_path / "server.log",
        launch_module="tests.rollout.sglang.fake_server",
        env={"PYTHONPATH": str(REPO_ROOT)},
        health_poll_s=0.05,
        **kwargs,
    )


def kill(h: SGLangRolloutHost) -> None:
    os.kill(h.server.pid, signal.SIGKILL)
    h.server._proc.wait(timeout=5)


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
        assert config.exists()
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

    monkeypatch.setattr(host_module, "DYING_GRACE_S", 0.5)
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


def test_a_server_that_cannot_start_is_reported_with_its_log(tmp_path):
    with pytest.raises(SGLangServerDiedError, match="(?s)died while starting.*scheduled exit"):
        host(tmp_path, extra_args=("--fake-startup-delay", "30", "--fake-exit-after", "0.2"))


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
    removes it with the server; by default only miles_vl's launcher gets pixel values."""
    from tests.rollout.sglang.conftest import make_video_prompt

    png = host(tmp_path / "png")  # a stand-in module, not miles_vl's launcher
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

    private = []
    mkdtemp = host_module.tempfile.mkdtemp
    monkeypatch.setattr(host_module, "pixel_directory", pixel_directory)
    monkeypatch.setattr(host_module, "SGLangRolloutEngine", broken_engine)
    monkeypatch.setattr(host_module.tempfile, "mkdtemp", lambda **kw: private.append(mkdtemp(**kw)) or private[-1])
    with pytest.raises(ValueError, match="bad engine settings"):
        host(tmp_path, send_pixel_values=True)
    assert len(made) == 1 and not made[0].exists()
    assert private and not any(Path(p).exists() for p in private)
