"""Contract of `placement.ray_session` for a local Ray (issue 15.13): Ray's own servers listen on all interfaces
(Ray 2.60 has no loopback setting for them), so a local session must run with Ray's token authentication, which it
does unless RAY_AUTH_MODE turns it off, and then the driver says so loudly; the dashboard is off or on 127.0.0.1;
every worker runs with NVLink multicast off."""

import logging
import os

import ray

from miles_vl.orchestration import placement


def test_a_local_session_runs_with_token_authentication(monkeypatch):
    """Also: every worker of the session runs with NVLink multicast off (the job's runtime_env), whatever the
    driver's own environment says: on shared hosts a program that uses it can take the GPUs out of service."""
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    for key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "NCCL_CUMEM_ENABLE"):
        monkeypatch.delenv(key, raising=False)  # not inherited from the driver: the session sets them
    assert not ray.is_initialized()
    with placement.ray_session(None, num_cpus=1):
        assert os.environ.get("RAY_AUTH_MODE") == "token"  # what Ray's processes of this session inherit

        @ray.remote(num_cpus=0)
        def worker_env() -> dict:
            keys = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "NCCL_CUMEM_ENABLE")
            return {k: os.environ.get(k) for k in keys}

        assert ray.get(worker_env.remote()) == {
            "NCCL_NVLS_ENABLE": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1",
            "NCCL_CUMEM_ENABLE": "0",  # what SGLang's servers run with: the trainer, their NCCL peer, must agree
        }
    assert not ray.is_initialized()


def test_turning_authentication_off_is_warned_about(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with caplog.at_level(logging.WARNING, logger="miles_vl.orchestration.placement"):
        with placement.ray_session(None, num_cpus=1, dashboard=True):
            pass
    assert "RAY_AUTH_MODE=disabled" in caplog.text and "without authentication" in caplog.text
    assert calls[0]["dashboard_host"] == "127.0.0.1" and calls[0]["include_dashboard"] is True
