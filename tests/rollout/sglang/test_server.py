"""Contract: the launch command uses SGLang 0.5.16's flag names and arities and never shows the API key; the
environment disables the vision-embedding cache that weight syncs do not invalidate; a supervised process is
started in its own process group, waited for until healthy, reported with its log when it dies, stopped with all
of its children, and restarted on the same port."""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import signal
import socket
import stat
import sys
import threading
import time

import pytest
import yaml

from miles_vl.rollout.sglang import (
    ServerProcess,
    ServerSpec,
    SGLangServerDiedError,
    SGLangUnavailableError,
    build_server_argv,
    build_server_env,
    wait_until_healthy,
    write_server_config,
)
from miles_vl.rollout.sglang.server import api_key_problem, check_port_free, copy_redacted, new_api_key
from miles_vl.rollout.sglang.server import free_port as free_port_here
from tests.procs import gone_within
from tests.rollout.sglang.conftest import FAKE_SERVER, fake_argv, free_port, quick_client
from tests.rollout.sglang.fake_server import parse_args, sglang_authorizes

# Flags of SGLang 0.5.16's `ServerArgs` (python/sglang/srt/server_args.py) that miles_vl emits or the tests pass,
# read from the wheel: the flag is the field name with dashes (plus `aliases`); `bool` fields are store_true
# (python/sglang/srt/arg_groups/arg_utils.py), every other field takes one value. `--config` is registered by
# ServerArgs.add_cli_args itself.
SGLANG_0_5_16_FLAGS = {
    "--model-path": "value",  # model_path: str, aliases ["--model"]
    "--model": "value",
    "--host": "value",  # host: str = "127.0.0.1"
    "--port": "value",  # port: int = 30000
    "--tp-size": "value",  # tp_size: int, aliases ["--tensor-parallel-size"]
    "--tensor-parallel-size": "value",
    "--mem-fraction-static": "value",  # Optional[float]
    "--config": "value",  # YAML merged into the arguments
    "--enable-memory-saver": "store_true",  # bool
    "--enable-weights-cpu-backup": "store_true",  # bool
    "--random-seed": "value",  # Optional[int]
    "--weight-version": "value",  # str = "default"
    "--mm-process-config": "value",  # Optional[Dict], type_parser=json.loads
    "--enable-deterministic-inference": "store_true",  # bool
    "--mm-feature-transport": "value",  # Optional[Literal["cpu", "cuda_ipc"]] (0.5.17: the same flag)
    "--log-level": "value",  # str = "info"
}


def parse_flags(args: list[str]) -> dict[str, str | bool]:
    """Parse `args` the way SGLang 0.5.16's argparse would, failing on a flag it does not have."""
    out: dict[str, str | bool] = {}
    k = 0
    while k < len(args):
        flag = args[k]
        assert flag in SGLANG_0_5_16_FLAGS, f"{flag} is not an SGLang 0.5.16 server flag"
        if SGLANG_0_5_16_FLAGS[flag] == "store_true":
            out[flag] = True
            k += 1
        else:
            assert k + 1 < len(args) and not args[k + 1].startswith("--"), f"{flag} needs a value"
            out[flag] = args[k + 1]
            k += 2
    return out


def test_default_argv_is_exact():
    argv = build_server_argv(ServerSpec(model_path="/ckpt/qwen3vl", port=30001), python="/py")
    assert argv == [
        "/py", "-m", "sglang.launch_server",
        "--model-path", "/ckpt/qwen3vl", "--host", "127.0.0.1", "--port", "30001", "--tp-size", "1",
        "--weight-version", "base", "--mm-feature-transport", "cpu",
    ]  # fmt: skip


@pytest.mark.parametrize("given", [("--mm-feature-transport", "cuda_ipc"), ("--mm-feature=cuda_ipc",)])
def test_the_feature_transport_is_cpu_unless_extra_args_set_it(given):
    """SGLang 0.5.17 resolves an unset --mm-feature-transport to cuda_ipc, under which its tokenizer, hashing images
    (SGLANG_MM_PRECOMPUTE_HASH=1, build_server_env), killed every server at its warmup (GPU run of 2026-11-26): every
    server gets cpu, the default argv above; a transport the user set in extra_args (in any spelling SGLang's argparse
    reads) is theirs, not repeated after it (argparse would keep the last)."""
    assert build_server_argv(ServerSpec(model_path="m", port=1), python="/py")[-2:] == ["--mm-feature-transport", "cpu"]
    argv = build_server_argv(ServerSpec(model_path="m", port=1, extra_args=given), python="/py")
    assert argv.count("cpu") == 0 and argv[-len(given) :] == list(given)


def test_full_argv_uses_sglang_flags_and_hides_the_api_key(tmp_path):
    spec = ServerSpec(
        model_path="/ckpt",
        port=30002,
        host="0.0.0.0",
        api_key="s3cret-key",
        tp_size=2,
        mem_fraction_static=0.55,
        colocated=True,
        weights_cpu_backup=True,
        random_seed=7,
        weight_version="step-0",
        image_min_pixels=256 * 32 * 32,
        image_max_pixels=1024 * 32 * 32,
        extra_args=("--enable-deterministic-inference", "--log-level", "warning"),
    )
    config = write_server_config(spec, tmp_path)
    argv = build_server_argv(spec, python="/py", config_file=str(config))
    assert argv[:3] == ["/py", "-m", "sglang.launch_server"]
    flags = parse_flags(argv[3:])
    assert flags == {
        "--model-path": "/ckpt",
        "--host": "0.0.0.0",
        "--port": "30002",
        "--tp-size": "2",
        "--mem-fraction-static": "0.55",
        "--config": str(config),
        "--enable-memory-saver": True,
        "--enable-weights-cpu-backup": True,
        "--random-seed": "7",
        "--weight-version": "step-0",
        "--mm-process-config": '{"image":{"min_pixels":262144,"max_pixels":1048576}}',
        "--mm-feature-transport": "cpu",
        "--enable-deterministic-inference": True,
        "--log-level": "warning",
    }
    assert "s3cret-key" not in " ".join(argv) and "--api-key" not in argv
    # The key reaches SGLang through the config file, which 0.5.16 turns into `--api-key <key>`; only we can read it.
    assert yaml.safe_load(config.read_text()) == {"api-key": "s3cret-key"}
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert spec.url == "http://127.0.0.1:30002"  # a wildcard bind is reached over loopback


def test_spec_rejects_unsafe_or_conflicting_settings():
    with pytest.raises(ValueError, match="beyond loopback without an API key"):
        ServerSpec(model_path="m", port=1, host="0.0.0.0")
    with pytest.raises(ValueError, match=r"extra_args sets --port.*rollout\.sglang\.port"):
        ServerSpec(model_path="m", port=1, extra_args=("--port=2",))
    with pytest.raises(ValueError, match=r"--tensor-parallel-size.*gpus_per_engine"):
        ServerSpec(model_path="m", port=1, extra_args=("--tensor-parallel-size", "2"))
    with pytest.raises(TypeError, match="not one string"):
        ServerSpec(model_path="m", port=1, extra_args="--log-level debug")
    with pytest.raises(ValueError, match="private --config file"):
        build_server_argv(ServerSpec(model_path="m", port=1, api_key="k"))
    assert ServerSpec(model_path="m", port=5, host="::1").url == "http://[::1]:5"


def test_env_disables_the_vision_embedding_cache_by_default():
    """Also: every server runs with NVLink multicast off (NCCL, PyTorch, NVSHMEM), unless the caller set those,
    hashes an image once per request in its tokenizer, not once per `n` copy in its scheduler, and exits as soon as a
    scheduler died, without SGLang's 65 s of crash diagnostics (a caller's setting is kept)."""
    env = build_server_env(ServerSpec(model_path="m", port=1), base={"PATH": "/bin"})
    assert env == {
        "PATH": "/bin",
        "SGLANG_VLM_CACHE_SIZE_MB": "0",
        "SGLANG_MM_PRECOMPUTE_HASH": "1",
        "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
        "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0",
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
        "NCCL_CUMEM_ENABLE": "0",  # SGLang 0.5.16's own default, explicit: its NCCL peers read the same (gpu_env)
    }
    assert (
        build_server_env(ServerSpec(model_path="m", port=1), base={"NCCL_NVLS_ENABLE": "1"})["NCCL_NVLS_ENABLE"] == "1"
    )
    assert (
        build_server_env(ServerSpec(model_path="m", port=1), base={"NCCL_CUMEM_ENABLE": "1"})["NCCL_CUMEM_ENABLE"]
        == "1"
    )
    assert (
        build_server_env(ServerSpec(model_path="m", port=1, vision_cache_mb=64), base={})["SGLANG_VLM_CACHE_SIZE_MB"]
        == "64"
    )
    spec = ServerSpec(model_path="m", port=1)
    assert build_server_env(spec, base={"SGLANG_MM_PRECOMPUTE_HASH": "0"})["SGLANG_MM_PRECOMPUTE_HASH"] == "0"
    wanted = {"SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "1"}
    assert build_server_env(spec, base=wanted)["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] == "1"


def test_pixel_values_travel_in_the_dtype_sglang_will_run_the_model_in(tmp_path):
    """0.5.16 runs the model in `--dtype`, else in its text config's dtype (the top level's when the text config has
    none), a float32 checkpoint in float16 (`_get_and_verify_dtype`, `get_hf_text_config`); pixel values go in that
    dtype when it is bf16 or fp16 (the model casts them to it), else in float32, which the launcher casts (written out
    here from the 0.5.16 source, independently of server.py)."""
    import json

    import torch

    from miles_vl.rollout.sglang.server import pixel_wire_dtype, spatial_merge_size

    def dtype_for(config: dict | None, *args: str) -> torch.dtype:
        path = tmp_path / str(len(list(tmp_path.iterdir())))
        path.mkdir()
        if config is not None:
            (path / "config.json").write_text(json.dumps(config))
        return pixel_wire_dtype(ServerSpec(model_path=str(path), port=1, extra_args=args))

    assert dtype_for({"text_config": {"dtype": "bfloat16"}, "dtype": "float32"}) == torch.bfloat16
    assert dtype_for({"text_config": {}, "dtype": "bfloat16"}) == torch.bfloat16  # the top level's
    assert dtype_for({"torch_dtype": "float16"}) == torch.float16
    assert dtype_for({"dtype": "float32"}) == torch.float32  # auto runs it in fp16: the launcher casts fp32
    assert dtype_for(None) == torch.float32  # a hub id or no config: fp32, always exact
    assert dtype_for({"dtype": "bfloat16"}, "--dtype", "float32") == torch.float32
    assert dtype_for({"dtype": "float32"}, "--dtype=half") == torch.float16
    assert dtype_for({"dtype": "bfloat16"}, "--dtype", "auto") == torch.bfloat16
    (tmp_path / "vl").mkdir()
    (tmp_path / "vl" / "config.json").write_text(json.dumps({"vision_config": {"spatial_merge_size": 3}}))
    assert spatial_merge_size(str(tmp_path / "vl")) == 3 and spatial_merge_size(str(tmp_path / "none")) == 2


def test_check_port_free_names_the_port_the_engine_and_the_fix():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ValueError, match=f"rollout engine 3 on 127.0.0.1:{port}.*in use") as info:
            check_port_free("127.0.0.1", port, wait_s=0.2, engine="rollout engine 3")
        assert "set rollout.sglang.port to a range that is free" in str(info.value).lower()
        assert "leave it null" in str(info.value)
    check_port_free("127.0.0.1", port, wait_s=2.0)


def test_free_port_gives_a_port_nothing_holds():
    port = free_port_here("127.0.0.1")
    check_port_free("127.0.0.1", port, wait_s=0)  # bindable now
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert free_port_here("127.0.0.1") != s.getsockname()[1]
    with pytest.raises(ValueError, match="ServerSpec.port is None.*free_port"):
        build_server_argv(ServerSpec(model_path="m", port=None))


def _as_sglang_reads_it(spec: ServerSpec, directory) -> str | None:
    """The API key SGLang's server ends up with for `spec`: the private YAML `write_server_config` writes, merged into
    the argv as 0.5.16 and 0.5.17 merge it and parsed by argparse (the stand-in's `parse_args`, which mirrors both:
    fake_server.merge_config). Raises SystemExit where SGLang's argparse exits."""
    config = write_server_config(spec, directory)
    argv = build_server_argv(spec, python="/py", config_file=str(config))
    return parse_args(argv[3:]).api_key


def test_generated_keys_reach_sglang_whole_even_where_a_urlsafe_token_starts_with_a_dash(tmp_path, monkeypatch, capsys):
    """GPU run of 2026-11-26: `new_api_key` was `secrets.token_urlsafe(32)`, which starts with '-' once in 64 draws;
    SGLang turns the --config YAML into `--api-key <key>` and argparse took the key for a flag: the server exited with
    `argument --api-key: expected one argument`. Every key drawn now survives that path whole: 2,000 fresh draws (with
    token_urlsafe about 31 of them would fail), and the random bytes that make token_urlsafe start with '-'."""
    spec = ServerSpec(model_path="m", port=30000)
    keys = {new_api_key() for _ in range(2000)}
    monkeypatch.setattr(secrets, "token_bytes", lambda n=None: b"\xf8" * (n or 32))  # 111110...: base64 index 62
    dash = secrets.token_urlsafe(32)
    assert dash.startswith("-")
    (tmp_path / "dash.yaml").write_text(f"api-key: {json.dumps(dash)}\n")  # write_server_config's format
    with pytest.raises(SystemExit):  # the GPU run's failure, as SGLang's argparse (mirrored by the stand-in) meets it
        parse_args(["--model-path", "m", "--config", str(tmp_path / "dash.yaml")])
    assert "argument --api-key: expected one argument" in capsys.readouterr().err
    keys.add(new_api_key())  # the same bytes
    assert len(keys) == 2001
    for key in keys:
        assert _as_sglang_reads_it(dataclasses.replace(spec, api_key=key), tmp_path) == key
        assert len(key) >= 43 and api_key_problem(key) is None  # 256 bits


# keys SGLang takes whole, though YAML, argparse or HTTP treat some of their characters specially
ODD_KEYS = ["k\"ey\\w1th'quotes", "a b c", "#not-a-comment", "true", "null", "123", "x: y", "@file", "~/.k"]


def test_a_users_key_reaches_sglang_whole_unless_sglang_cannot_take_it(tmp_path, capsys):
    """A user's rollout.sglang.api_key goes the same way; one SGLang cannot take is refused by `ServerSpec` (and so by
    the config check before Ray, tests/orchestration/test_sglang_loop.py), naming the problem but never the key."""
    for key in ODD_KEYS:
        assert api_key_problem(key) is None, key
        assert _as_sglang_reads_it(ServerSpec(model_path="m", port=30000, api_key=key), tmp_path) == key
        assert sglang_authorizes("/generate", f"Bearer {key}", key)  # SGLang's own comparison takes it
    refused = {
        "-leading-dash": "starts with '-'",
        "--s3cret": "starts with '-'",
        "-1": "starts with '-'",  # argparse would take a negative number, but the rule is one: no leading '-'
        "caf\u00e9": "non-ASCII",
        "tab\there": "control character",
        "new\nline": "control character",
        "del\x7f": "control character",
        " padded": "space",
        "padded ": "space",
    }
    for key, problem in refused.items():
        with pytest.raises(ValueError, match="rollout.sglang.api_key") as info:
            ServerSpec(model_path="m", port=30000, api_key=key)
        message = str(info.value)
        assert problem in message and key not in message and "leave it null" in message, message
    with pytest.raises(TypeError, match="non-ASCII"):  # why non-ASCII is refused: SGLang's check cannot compare it
        sglang_authorizes("/generate", "Bearer caf\u00e9", "caf\u00e9")


def _fake_process(tmp_path, *extra: str) -> tuple[ServerProcess, str]:
    port = free_port()
    argv = fake_argv(build_server_argv(ServerSpec(model_path="m", port=port), python=sys.executable)) + list(extra)
    return ServerProcess(argv, log_path=tmp_path / "server.log", stop_timeout_s=5), f"http://127.0.0.1:{port}"


def test_supervision_start_health_kill_restart(tmp_path):
    process, url = _fake_process(tmp_path, "--fake-startup-delay", "0.4")
    client = quick_client(url, liveness=process.death_reason)
    try:
        process.start()
        waited = wait_until_healthy(client, process, timeout_s=20, poll_s=0.05)
        assert waited >= 0.4  # /health_generate answered 503 while "starting"
        assert process.death_reason() is None and client.model_info()["model_path"] == "m"

        os.kill(process.pid, signal.SIGKILL)
        process._proc.wait(timeout=5)
        reason = process.death_reason()
        assert reason is not None and "killed by signal 9" in reason and "listening on" in reason  # the log tail
        with pytest.raises(SGLangServerDiedError, match="killed by signal 9"):
            client.model_info()  # fails fast: no retries against a dead process

        first_pid = process.pid
        process.restart()
        wait_until_healthy(client, process, timeout_s=20, poll_s=0.05)
        assert process.pid != first_pid and process.starts == 2
        assert client.model_info()["weight_version"] == "base"
    finally:
        process.stop()
    assert not process.is_alive()


def test_death_during_startup_is_reported_with_the_log(tmp_path):
    process, url = _fake_process(tmp_path, "--fake-startup-delay", "30", "--fake-exit-after", "0.3")
    try:
        process.start()
        start = time.monotonic()
        with pytest.raises(SGLangServerDiedError, match=r"(?s)died while starting.*exited with code 3.*scheduled exit"):
            wait_until_healthy(quick_client(url), process, timeout_s=20, poll_s=0.05)
        assert time.monotonic() - start < 10
    finally:
        process.stop()


def test_startup_timeout_is_bounded_and_explained(tmp_path):
    process, url = _fake_process(tmp_path, "--fake-startup-delay", "30")
    try:
        process.start()
        # the stand-in's first line, which the error must quote, once its interpreter is up (seconds on a busy machine)
        deadline = time.monotonic() + 30
        while "listening on" not in process.log_tail() and time.monotonic() < deadline:
            time.sleep(0.05)
        start = time.monotonic()
        with pytest.raises(SGLangUnavailableError, match=r"(?s)not healthy.*startup_timeout_s.*listening on"):
            wait_until_healthy(quick_client(url), process, timeout_s=0.8, poll_s=0.05)
        assert time.monotonic() - start < 5
    finally:
        process.stop()


def test_the_log_never_holds_a_redacted_string(tmp_path):
    """Issue 30.4: SGLang 0.5.16 logs its arguments with the API key (`server_args=ServerArgs(... api_key='...')`), and
    the server's output went straight to its log file. Now it reaches the file through `copy_redacted`: every spelling
    of the key (as is, in repr and JSON quotes) is written `<redacted>`, on stdout and stderr, from the server's
    children too, in a line longer than one read with the key across the reads' boundary, and at the very end of the
    output without a newline; everything else arrives whole, and a death's log tail is complete."""
    from miles_vl.rollout.sglang.server import LOG_READ_BYTES

    key = "k'ey\\w1th\"odd ch4rs"  # repr and JSON escape it differently
    script = f"""
import os, sys, json
key = os.environ["THE_KEY"]  # (not in the argv, which the log's start line shows)
print("server_args=ServerArgs(api_key=" + repr(key) + ")", flush=True)
print(json.dumps({{"api-key": key}}), file=sys.stderr, flush=True)
if os.fork() == 0:
    print("child " + key, flush=True)
    os._exit(0)
os.wait()
sys.stdout.write("x" * ({LOG_READ_BYTES} - 3) + key + "y" * 10 + "\\n")
sys.stdout.write("last " + key)
sys.stdout.flush()
os._exit(5)
"""
    env = dict(os.environ, THE_KEY=key)
    process = ServerProcess([sys.executable, "-c", script], env=env, log_path=tmp_path / "server.log", redact=[key])
    process.start()
    process._proc.wait(timeout=20)
    reason = process.death_reason()
    log = (tmp_path / "server.log").read_text()
    assert "exited with code 5" in reason and "last <redacted>" in reason  # the tail is all there
    assert key not in log and repr(key)[1:-1] not in log and json.dumps(key)[1:-1] not in log
    assert log.count("<redacted>") == 5
    assert "server_args=ServerArgs(api_key='<redacted>')" in log and '{"api-key": "<redacted>"}' in log
    assert "child <redacted>" in log and "x" * (LOG_READ_BYTES - 3) + "<redacted>" + "y" * 10 + "\n" in log
    assert log.endswith("last <redacted>")


def test_stop_ends_the_whole_process_group(tmp_path):
    """SGLang forks scheduler and detokenizer processes: stopping the server must not leave them behind."""
    port = free_port()
    script = f"sleep 60 & echo child=$!; exec {sys.executable} {FAKE_SERVER} --model-path m --port {port}"
    process = ServerProcess(["/bin/sh", "-c", script], log_path=tmp_path / "server.log", stop_timeout_s=5)
    process.start()
    try:
        wait_until_healthy(quick_client(f"http://127.0.0.1:{port}"), process, timeout_s=20, poll_s=0.05)
        child = int(next(line for line in process.log_tail().splitlines() if line.startswith("child="))[6:])
        os.kill(child, 0)  # alive
    finally:
        process.stop()
    assert gone_within(child, 5, poll_s=0.05)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (every write fails with ENOSPC)")
def test_a_log_that_cannot_be_written_never_breaks_the_servers_output(caplog):
    """Found by the review of issue 30.4: a write error of the log copy (a full disk) ended its thread and closed the
    pipe, so every later write of the server met EPIPE (a bare `print` in SGLang would raise). Now the copy warns once
    and keeps draining the pipe to its end."""
    r, w = os.pipe()
    copier = threading.Thread(target=copy_redacted, args=(os.fdopen(r, "rb"), "/dev/full", [b"k3y"]), daemon=True)
    copier.start()
    with os.fdopen(w, "wb") as server_output:  # far more than a pipe's buffer: a stopped reader would block or EPIPE
        for _ in range(256):
            server_output.write(b"x" * 4095 + b"\n")
    copier.join(timeout=30)
    assert not copier.is_alive()
    assert [r.message for r in caplog.records if "cannot be written" in r.message][:1]
