"""Contract of `placement.ray_session` for a local Ray (issue 15.13): Ray's own servers listen on all interfaces
(Ray 2.60 has no loopback setting for them), so a local session must run with Ray's token authentication, which it
does unless RAY_AUTH_MODE turns it off, and then the driver says so loudly; the dashboard is off or on 127.0.0.1;
every worker runs with NVLink multicast off. Issue 30: a job without `ray.address` starts a private Ray (never the
cluster of Ray's world-writable address file) in a 0700 folder removed after it, Ray's token file is 0600, Ray's
workers import installed packages before the working directory, and Ray records the redacted command line."""

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import pytest
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


# ---------------------------------------------------------------------------------------------------------------------
# which Ray a job uses (issue 30.5), what Ray's workers import first (30.7), what Ray records of the command line (30.8)


@pytest.fixture
def ray_tmp(monkeypatch):
    """RAY_TMPDIR for the test, short (a private Ray's unix sockets go under it), holding Ray's address file with a
    planted address of a cluster that is not there; no RAY_ADDRESS."""
    folder = Path(tempfile.mkdtemp(prefix="mvl", dir="/tmp"))
    (folder / "ray").mkdir()
    (folder / "ray" / "ray_current_cluster").write_text(f"{DEAD}\n")
    monkeypatch.setenv("RAY_TMPDIR", str(folder))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


DEAD = "127.0.0.1:1"


def test_a_job_without_ray_address_starts_a_private_ray_in_a_0700_folder(ray_tmp):
    """Issue 30.5: with ray.address unset, ray.init() joined the cluster of Ray's address file (world-writable
    /tmp/ray): a planted dead address was retried for 150 s, or with ray.num_cpus set (as here) the job crashed. Now
    the address file is never read: a private Ray starts at once in a folder of its own, 0700, removed at the end."""
    start = time.monotonic()
    with placement.ray_session(None, num_cpus=1):
        assert time.monotonic() - start < 60
        assert ray.get_runtime_context().gcs_address != DEAD
        (private,) = [p for p in ray_tmp.iterdir() if p.name.startswith("ray-")]
        assert stat.S_IMODE(private.stat().st_mode) == 0o700
        assert list(private.glob("ray/session_2*/sockets"))  # Ray's session lives inside it
    assert not ray.is_initialized()
    assert sorted(str(p.relative_to(ray_tmp)) for p in ray_tmp.rglob("*")) == ["ray", "ray/ray_current_cluster"]
    assert (ray_tmp / "ray" / "ray_current_cluster").read_text() == f"{DEAD}\n"


def test_which_cluster_a_job_joins(monkeypatch, ray_tmp):
    """ray.address wins (`local`: a private Ray); unset, RAY_ADDRESS (what `ray job submit` and a launcher set), else
    a private Ray started with address="local", which makes Ray read neither RAY_ADDRESS nor its address file."""
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: types.SimpleNamespace(gcs_address="10.0.0.2:6379"))
    monkeypatch.setattr(placement, "own_token_file", lambda: None)
    cases = [
        (None, None, "local"),
        (None, "10.0.0.2:6379", "10.0.0.2:6379"),
        (None, "local", "local"),
        ("10.0.0.3:6379", "10.0.0.2:6379", "10.0.0.3:6379"),
        ("local", "10.0.0.2:6379", "local"),
        ("auto", None, "auto"),
    ]
    for address, env, expected in cases:
        if env is None:
            monkeypatch.delenv("RAY_ADDRESS", raising=False)
        else:
            monkeypatch.setenv("RAY_ADDRESS", env)
        with placement.ray_session(address, num_cpus=None):
            pass
        kwargs = calls.pop()
        assert kwargs["address"] == expected, (address, env)
        if expected == "local":
            assert Path(kwargs["_temp_dir"]).parent.parent == ray_tmp
        else:
            assert "_temp_dir" not in kwargs and "num_cpus" not in kwargs
    assert [p.name for p in ray_tmp.iterdir()] == ["ray"]  # every private folder removed


def test_ray_workers_import_installed_packages_before_the_working_directory(tmp_path, monkeypatch, ray_tmp):
    """Issue 30.7: Ray puts the driver's working directory first on its workers' sys.path, so a stray module there
    shadowed an installed package in every actor. Ray's workers now look there last: the installed package is
    imported, and a module that is only in the working directory (a `module:function` extension) still is."""
    (tmp_path / "safetensors.py").write_text("raise ImportError('the stray safetensors.py was imported')\n")
    (tmp_path / "only_here.py").write_text("VALUE = 7\n")
    monkeypatch.chdir(tmp_path)
    with placement.ray_session(None, num_cpus=1):

        @ray.remote(num_cpus=0)
        def imports() -> tuple[str, int]:
            import only_here
            import safetensors

            return safetensors.__file__, only_here.VALUE

        where, value = ray.get(imports.remote())
    assert "site-packages" in where and value == 7


def test_ray_records_the_redacted_command_line(monkeypatch, ray_tmp):
    """Issue 30.8: Ray records the driver's command line as the job's entrypoint (`ray list jobs`, the dashboard),
    read from /proc/self/cmdline, where the CLI cannot redact a secret. It gets `sys.argv`, which the CLI redacted."""
    argv = ["/venv/bin/miles-vl", "train", "job.yaml", "rollout.sglang.api_key=<redacted>"]
    monkeypatch.setattr(sys, "argv", argv)
    with placement.ray_session(None, num_cpus=1):
        entrypoints = [job["Entrypoint"] for job in ray._private.state.state.job_table()]
    assert entrypoints == [subprocess.list2cmdline([sys.executable, *argv])]


def test_rays_token_file_is_0600(tmp_path, monkeypatch, caplog):
    """Issue 30.5: Ray 2.60 writes a missing ~/.ray/auth_token with open(path, "w"): 0644 in a 0755 folder, so any
    local user could read the token of the session. It is written first, 0600 in a 0700 folder; an existing one that
    others can read is made 0600 with a warning; a token in RAY_AUTH_TOKEN writes no file."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    path = placement.own_token_file()
    assert path == tmp_path / ".ray" / "auth_token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    token = path.read_text()
    assert len(token) == 64 and int(token, 16) >= 0
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="miles_vl.orchestration.placement"):
        assert placement.own_token_file() == path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == token  # the same token, closed
    assert "was readable by other users (mode 644)" in caplog.text
    elsewhere = tmp_path / "tokens" / "t"
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(elsewhere))
    assert placement.own_token_file() == elsewhere and stat.S_IMODE(elsewhere.stat().st_mode) == 0o600
    monkeypatch.setenv("RAY_AUTH_TOKEN", "x" * 64)
    (tmp_path / "tokens" / "t").unlink()
    assert placement.own_token_file() is None and not elsewhere.exists()


def test_a_temp_folder_too_long_for_rays_sockets_is_named_before_ray(monkeypatch, tmp_path):
    """A private Ray's unix sockets go under RAY_TMPDIR (else TMPDIR, else /tmp): a path that leaves them no room is
    one problem of `check` (preflight) with the fix, not an OSError from inside Ray."""
    deep = tmp_path / ("d" * 40)
    deep.mkdir()
    monkeypatch.setenv("RAY_TMPDIR", str(deep))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    problem = placement.private_session_problem(None)
    assert problem and f"under the temp folder {deep}" in problem and "set RAY_TMPDIR to a folder of at most" in problem
    assert placement.private_session_problem("10.0.0.2:6379") is None  # joining a cluster: its own folders
    monkeypatch.setenv("RAY_TMPDIR", "/tmp")
    assert placement.private_session_problem(None) is None


# a driver inside `ray job submit` with a runtime environment of its own (issue 35.4)


def job_config(monkeypatch, runtime_env: dict) -> None:
    """What Ray's job manager sets in a `ray job submit --runtime-env-json ...` entrypoint."""
    monkeypatch.setenv(placement.RAY_JOB_CONFIG_ENV, json.dumps({"runtime_env": runtime_env}))


def test_a_ray_jobs_runtime_env_that_sets_the_drivers_keys_alike_is_merged(monkeypatch):
    """Ray merges the job's runtime environment with the driver's and refused the job ("Failed to merge the Job's
    runtime env") whenever both set one key, even to the same value: a job submitted with NCCL_NVLS_ENABLE=0 or
    NCCL_CUMEM_ENABLE in its env_vars could not start. The driver now leaves such keys to the job; every worker sees
    the job's variables and the driver's."""
    for key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "1")  # the entrypoint inherits the job's env_vars
    hook = placement.driver_runtime_env()["worker_process_setup_hook"]
    job_config(
        monkeypatch,
        {
            "env_vars": {"NCCL_NVLS_ENABLE": "0", "NCCL_CUMEM_ENABLE": "1", "MY_JOB_VAR": "x"},
            "worker_process_setup_hook": hook,
        },
    )
    assert placement.job_runtime_env_problem(placement.driver_runtime_env()) is None
    with placement.ray_session(None, num_cpus=1):

        @ray.remote(num_cpus=0)
        def worker_env() -> dict:
            keys = ("NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS", "NCCL_CUMEM_ENABLE", "MY_JOB_VAR")
            return {k: os.environ.get(k) for k in keys}

        assert ray.get(worker_env.remote()) == {
            "NCCL_NVLS_ENABLE": "0",
            "NVSHMEM_DISABLE_NVLS": "1",
            "NCCL_CUMEM_ENABLE": "1",
            "MY_JOB_VAR": "x",
        }
    assert not ray.is_initialized()


def test_a_ray_jobs_runtime_env_that_contradicts_the_driver_is_one_problem(monkeypatch):
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    job_config(monkeypatch, {"env_vars": {"NCCL_NVLS_ENABLE": "1"}, "worker_process_setup_hook": "mine.hook"})
    problem = placement.job_runtime_env_problem(placement.driver_runtime_env())
    assert problem.startswith(
        "the Ray job's runtime environment sets env_vars NCCL_NVLS_ENABLE='1' (miles_vl sets '0')"
    )
    assert "worker_process_setup_hook='mine.hook' (miles_vl sets 'miles_vl.import_path.ray_worker_setup')" in problem
    assert "remove them from `ray job submit --runtime-env-json`" in problem
    with pytest.raises(RuntimeError, match="NCCL_NVLS_ENABLE='1'"):
        with placement.ray_session(None, num_cpus=1):
            pass
    assert not ray.is_initialized()
