"""Launching and supervising one SGLang server process: the command line, its environment, health, restarts.

`build_server_argv` is a pure function of a `ServerSpec`: tests check the exact argv. The flag names are those of
SGLang 0.5.16, whose `ServerArgs` dataclass (`python/sglang/srt/server_args.py`) derives each flag from a field
name (`tp_size` -> `--tp-size`; booleans are `store_true`) through `python/sglang/srt/arg_groups/arg_utils.py`;
the entry point is `python -m sglang.launch_server` (`python/sglang/launch_server.py`).

Decisions (each one is also in docs/sglang.md):

- Every server has an API key, so that no other local user can call it (0.5.16 guards every route but `/health*` and
  `/metrics*` with it, `python/sglang/srt/utils/auth.py`): `rollout.sglang.api_key` when set, else a fresh random one
  per server (`new_api_key`, made by the host). The key never goes on the command line (any local user can read
  `/proc/<pid>/cmdline`) nor into the environment: it is written to a private YAML file (0600, in a 0700 directory)
  passed with `--config`, which 0.5.16 merges into the arguments (`python/sglang/srt/server_args_config_parser.py`).
  0.5.16 logs its arguments, the key among them (`server_args=ServerArgs(... api_key=...)`,
  `srt/entrypoints/engine.py:798`), so the server's output reaches its log file through `ServerProcess`, which
  writes every spelling of the key as `<redacted>`.
- The server binds 127.0.0.1 unless the spec opens it, and an open server needs an API key (same rule as
  `rollout.sglang` in the config schema).
- `SGLANG_VLM_CACHE_SIZE_MB=0` by default. 0.5.16 caches vision-tower embeddings by image hash
  (`python/sglang/srt/managers/mm_utils.py`, `embedding_cache`, 100 MB by default) and `/flush_cache` does not
  clear that cache (`Scheduler.flush_cache` in `python/sglang/srt/managers/scheduler.py` resets the radix tree and
  memory pools only), so after a weight sync the same image would reuse embeddings of the old vision tower. Set
  `vision_cache_mb > 0` only when the vision tower is frozen.
- `SGLANG_MM_PRECOMPUTE_HASH=1` by default. Without it, 0.5.16 hashes each request's pixel values (a SHA-256 of
  4.8 MB for a 196-token image) in the scheduler process, once for every one of the `n` copies of a request with
  `sampling_params.n` (each copy is materialized afresh: `MultimodalInputs.from_processor_output` ->
  `MultimodalDataItem.set_pad_value`, `srt/managers/schedule_batch.py:299`, `:576`); with it the tokenizer hashes once
  per request before the copies are made (`srt/managers/tokenizer_manager.py:966-974`) and the copies carry the hash.
- `SGLANG_PYSPY_DUMP_BEFORE_CRASH=0` and `SGLANG_CUDA_COREDUMP_BEFORE_CRASH=0` by default. When a scheduler dies,
  0.5.16 and 0.5.17 run crash diagnostics in the launching process before it exits (`TokenizerManager.
  dump_requests_before_crash`): 5 s of settling, a py-spy dump, then 60 s of waiting for CUDA coredumps (which need
  `CUDA_ENABLE_USER_TRIGGERED_COREDUMP=1`, unset here). The server's requests hang meanwhile and the host relaunches it
  65 s late (GPU runs of 2026-11-26, the deterministic server's log); a caller that wants the dumps sets them.
- Colocated engines get `--enable-memory-saver` so that `/release_memory_occupation` frees the GPU for the trainer.
- Pixel values for a server run by miles_vl's launcher go through a private directory (`pixel_directory`, in
  /dev/shm: memory, not disk), named to the server in `MILES_VL_SGLANG_PIXEL_DIR`; they are written in the server
  model's dtype when it is bf16 or fp16 (`pixel_wire_dtype`), as the model casts them to it anyway, else in fp32.

`ServerProcess` runs the command in its own session (process group), so stopping it also stops the scheduler and
detokenizer processes SGLang forks; its log goes to a file whose tail is quoted when the server dies.
`wait_until_healthy` polls `/health_generate` until it answers 200, the process dies, or the startup timeout ends.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import torch

from miles_vl.gpu_env import NO_MULTICAST_ENV, nccl_peer_env
from miles_vl.models.hub import cached_model_dir
from miles_vl.rollout.sglang.client import SGLangClient, SGLangServerDiedError, SGLangUnavailableError
from miles_vl.sglang_plugin.settings import SETTINGS_ENV, PluginSettings

log = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# What `python -m` runs: SGLang's own entry point. miles_vl's patches come as SGLang's plugin (miles_vl/sglang_plugin/,
# opted in by `ServerSpec.plugin`; rollout.sglang.launcher).
SGLANG_LAUNCH_MODULE = "sglang.launch_server"

# Flags that miles_vl sets from the spec; `extra_args` may not set them again (argparse would silently keep the
# last one). Values: the spec field (and config key) that owns the flag.
OWNED_FLAGS: dict[str, str] = {
    "--model-path": "model_path (model.path)",
    "--model": "model_path (model.path)",
    "--host": "host (rollout.sglang.host)",
    "--port": "port (rollout.sglang.port)",
    "--tp-size": "tp_size (rollout.gpus_per_engine)",
    "--tensor-parallel-size": "tp_size (rollout.gpus_per_engine)",
    "--mem-fraction-static": "mem_fraction_static (rollout.sglang.mem_fraction_static)",
    "--api-key": "api_key (rollout.sglang.api_key)",
    "--config": "api_key (rollout.sglang.api_key, written to a private --config file)",
    "--enable-memory-saver": "colocated (ray.placement)",
    "--enable-weights-cpu-backup": "weights_cpu_backup",
    "--random-seed": "random_seed (seed)",
    "--weight-version": "weight_version",
    "--mm-process-config": "image_min_pixels / image_max_pixels (data.min_pixels / data.max_pixels)",
}


# Every server gets `--mm-feature-transport cpu` unless `extra_args` sets the flag: SGLang 0.5.17 resolves it, unset,
# to cuda_ipc on one CUDA node (0.5.16: cpu), and with `SGLANG_MM_PRECOMPUTE_HASH=1` (build_server_env) its tokenizer
# then hashes each image after moving it into its CUDA IPC pool, opening the pool's handle in the process that made it:
# every server, SGLang's own one too, died in its warmup request ("CUDA error: invalid device context", GPU run of
# 2026-11-26). The plugin needs cpu as well (miles_vl/sglang_plugin/v0_5_17/transport.py refuses anything else).
MM_TRANSPORT_FLAG = "--mm-feature-transport"


def _abbreviates(arg: str, flag: str) -> bool:
    return arg.startswith("--") and len(arg) > 2 and flag.startswith(arg)


def _require_port(spec: ServerSpec) -> None:
    if spec.port is None:
        raise ValueError(
            "ServerSpec.port is None (a free port, picked where the server runs): replace it with "
            "free_port(spec.host) first, as SGLangRolloutHost does"
        )


def new_api_key() -> str:
    """A fresh random API key for one server: 256 bits as 64 hex digits, which SGLang takes as they are
    (`api_key_problem`). Not `secrets.token_urlsafe`: its alphabet has '-', one key in 64 started with it, and SGLang
    then exited at start with `argument --api-key: expected one argument` (GPU run of 2026-11-26)."""
    return secrets.token_hex(32)


def api_key_problem(key: str) -> str | None:
    """Why SGLang cannot take `key` as its API key, or None. Never repeats the key (it is a secret).

    The key reaches SGLang through the `--config` YAML (`write_server_config`), and SGLang 0.5.16 and 0.5.17 alike turn
    that file into argv: `ConfigArgumentMerger._convert_config_to_args` (srt/server_args_config_parser.py, called by
    `prepare_server_args` in srt/server_args.py) makes `["--api-key", str(value)]`, which `argparse` then parses. So:
    - argparse reads a value that starts with '-' as a flag (unless it holds a space or looks like a negative
      number): `--api-key` is left without its value and the server exits at start;
    - SGLang compares keys with `secrets.compare_digest` (srt/utils/auth.py), which refuses non-ASCII strings, and the
      key travels as an HTTP header (`Authorization: Bearer <key>`), which carries no control characters and loses
      spaces at either end.
    """
    if key.startswith("-"):
        return (
            "it starts with '-', which SGLang's argument parser reads as a flag: the server would exit at start with "
            "'argument --api-key: expected one argument'"
        )
    if not key.isascii():
        return "it holds a non-ASCII character, which SGLang's key check (secrets.compare_digest) refuses"
    if not key.isprintable():
        return "it holds a control character (a tab, a newline, ...), which an HTTP header cannot carry"
    if key != key.strip(" "):
        return "it starts or ends with a space, which HTTP drops from the header that carries the key"
    return None


@dataclass(frozen=True)
class ServerSpec:
    """Everything needed to launch one SGLang server for one rollout engine.

    Args:
        model_path: HF checkpoint directory the server loads at start (and again after a restart).
        port: HTTP port; None: a free port the host picks on the node where the server runs (`free_port`), the
            default of rollout.sglang.port. `url`, `build_server_argv` and `write_server_config` need it picked.
        host: bind address; anything but loopback requires `api_key`.
        api_key: bearer token the server demands on every route but `/health*` and `/metrics*`; None: the host makes
            a random one (`new_api_key`), so that a server always has one. Not shown by `repr`; one that SGLang
            cannot take (`api_key_problem`) is refused.
        tp_size: tensor-parallel size = GPUs of this engine (the GPUs Ray gave the actor, from index 0).
        mem_fraction_static: share of GPU memory for weights + KV cache; None lets SGLang choose.
        colocated: the engine shares its GPUs with the trainer: adds `--enable-memory-saver`.
        weights_cpu_backup: keep a CPU copy of the weights across release/resume (`--enable-weights-cpu-backup`);
            without it, resumed weights are undefined until the next weight sync.
        random_seed: the server's `--random-seed`.
        weight_version: the label `meta_info.weight_version` carries until the first sync.
        image_min_pixels: the server's image processor `min_pixels` (must equal the one that built the prompt ids).
        image_max_pixels: likewise `max_pixels`.
        vision_cache_mb: `SGLANG_VLM_CACHE_SIZE_MB`; 0 (default) disables the vision-embedding cache that weight
            syncs do not invalidate (see the module docstring). Only > 0 when the vision tower is frozen.
        plugin: the settings of miles_vl's SGLang plugin for this server (`miles_vl.sglang_plugin`, opted in through
            `MILES_VL_SGLANG_PLUGIN`); None: SGLang's own server, without the plugin (rollout.sglang.launcher: sglang).
        extra_args: passed verbatim after ours; may not repeat a flag of `OWNED_FLAGS`.
    """

    model_path: str
    port: int | None
    host: str = "127.0.0.1"
    api_key: str | None = field(default=None, repr=False)
    tp_size: int = 1
    mem_fraction_static: float | None = None
    colocated: bool = False
    weights_cpu_backup: bool = False
    random_seed: int | None = None
    weight_version: str = "base"
    image_min_pixels: int | None = None
    image_max_pixels: int | None = None
    vision_cache_mb: int = 0
    plugin: PluginSettings | None = None
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("ServerSpec.model_path is empty: set model.path to the HF checkpoint SGLang should load")
        if self.port is not None and not 0 < self.port < 65536:
            raise ValueError(
                f"ServerSpec.port={self.port} is not a TCP port; set rollout.sglang.port so that port + engine index "
                "stays in 1..65535, or leave it null (each engine's server then takes a free port)"
            )
        problem = api_key_problem(self.api_key) if self.api_key else None
        if problem is not None:
            raise ValueError(
                f"rollout.sglang.api_key (value <redacted>) cannot be SGLang's API key: {problem}. Choose a key of "
                "printable ASCII that does not start with '-' (e.g. `python -c 'import secrets; "
                "print(secrets.token_hex(32))'`), or leave it null: each server then gets a random key of its own"
            )
        if self.host not in LOOPBACK_HOSTS and not self.api_key:
            raise ValueError(
                f"ServerSpec.host={self.host!r} opens the server beyond loopback without an API key: "
                "set rollout.sglang.api_key or bind 127.0.0.1"
            )
        if self.tp_size < 1:
            raise ValueError(f"ServerSpec.tp_size={self.tp_size}; an engine needs >= 1 GPU (rollout.gpus_per_engine)")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static <= 1:
            raise ValueError(f"ServerSpec.mem_fraction_static={self.mem_fraction_static} is outside (0, 1]")
        if self.vision_cache_mb < 0:
            raise ValueError(f"ServerSpec.vision_cache_mb={self.vision_cache_mb} < 0; use 0 to disable the cache")
        if isinstance(self.extra_args, str):
            raise TypeError("ServerSpec.extra_args must be a sequence of strings, not one string; split it")
        object.__setattr__(self, "extra_args", tuple(self.extra_args))
        for arg in self.extra_args:
            flag = arg.split("=", 1)[0]
            # SGLang's argparse takes any unique prefix of a flag (`--hos` is `--host`): a prefix of an owned flag
            # sets it too (or is ambiguous, which SGLang refuses anyway)
            owned = flag if flag in OWNED_FLAGS else next((f for f in OWNED_FLAGS if _abbreviates(flag, f)), None)
            if owned is not None:
                alias = "" if owned == flag else f" (a prefix of {owned}, which SGLang's argparse reads as that flag)"
                raise ValueError(
                    f"rollout.sglang.extra_args sets {flag}{alias}, which miles_vl sets itself from "
                    f"{OWNED_FLAGS[owned]}; remove it from extra_args"
                )
            # flags that would take the key's protection away
            if _abbreviates(flag, "--admin-api-key"):
                raise ValueError(
                    f"rollout.sglang.extra_args sets {flag}: a second key on the command line, where other local "
                    "users can read it, and the one SGLang 0.5.16 then demands instead of the API key on the weight, "
                    "memory and cache routes miles_vl calls (AuthLevel.ADMIN_OPTIONAL); remove it from extra_args"
                )
            if _abbreviates(flag, "--tokenizer-worker-num") and _flag_value(self.extra_args, flag) != "1":
                raise ValueError(
                    f"rollout.sglang.extra_args sets {flag} {_flag_value(self.extra_args, flag)}: with more than one "
                    "tokenizer worker SGLang 0.5.16 checks no API key and refuses to start with one, and every "
                    "miles_vl server has one (rollout.sglang.api_key, or a random key of its own); remove it from "
                    "extra_args"
                )

    @property
    def url(self) -> str:
        """Where a client on this machine reaches the server (a wildcard bind is reached over loopback)."""
        _require_port(self)
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    @property
    def mm_process_config(self) -> dict | None:
        image = {}
        if self.image_min_pixels is not None:
            image["min_pixels"] = self.image_min_pixels
        if self.image_max_pixels is not None:
            image["max_pixels"] = self.image_max_pixels
        return {"image": image} if image else None


def build_server_argv(
    spec: ServerSpec,
    *,
    python: str = sys.executable,
    module: str = SGLANG_LAUNCH_MODULE,
    config_file: str | None = None,
) -> list[str]:
    """The command that starts SGLang 0.5.16 for `spec` (pure: no I/O).

    Args:
        spec: what to launch.
        python: interpreter that has `sglang` installed.
        module: the entry module run with `python -m` (tests run a stand-in that takes the same flags).
        config_file: the private YAML written by `write_server_config`; required when `spec.api_key` is set.

    Returns:
        argv, e.g. `[python, "-m", "sglang.launch_server", "--model-path", ..., "--host", "127.0.0.1", ...]`.

    Raises:
        ValueError: an API key without a config file.
    """
    _require_port(spec)
    if spec.api_key and config_file is None:
        raise ValueError(
            "the API key goes to SGLang in a private --config file, never on the command line (other local users "
            "can read it there): pass config_file=write_server_config(spec, directory)"
        )
    argv = [python, "-m", module, "--model-path", spec.model_path]
    argv += ["--host", spec.host, "--port", str(spec.port), "--tp-size", str(spec.tp_size)]
    if spec.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", repr(spec.mem_fraction_static)]
    if config_file is not None:
        argv += ["--config", str(config_file)]
    if spec.colocated:
        argv.append("--enable-memory-saver")
    if spec.weights_cpu_backup:
        argv.append("--enable-weights-cpu-backup")
    if spec.random_seed is not None:
        argv += ["--random-seed", str(spec.random_seed)]
    argv += ["--weight-version", spec.weight_version]
    if spec.mm_process_config is not None:
        argv += ["--mm-process-config", json.dumps(spec.mm_process_config, separators=(",", ":"))]
    if not any(_abbreviates(arg.split("=", 1)[0], MM_TRANSPORT_FLAG) for arg in spec.extra_args):
        argv += [MM_TRANSPORT_FLAG, "cpu"]  # the user's own choice in extra_args stands (MM_TRANSPORT_FLAG)
    return argv + list(spec.extra_args)


# SGLang 0.5.16's names for --dtype (`_STR_DTYPE_TO_TORCH_DTYPE`, srt/configs/model_config.py)
SGLANG_DTYPES = {
    "half": torch.float16,
    "float16": torch.float16,
    "float": torch.float32,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
}


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    for k, arg in enumerate(args):
        if arg == flag and k + 1 < len(args):
            return args[k + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _checkpoint_config(model_path: str) -> dict | None:
    path = (cached_model_dir(model_path) or Path(model_path)) / "config.json"  # a hub id: its cached snapshot
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def pixel_wire_dtype(spec: ServerSpec) -> torch.dtype:
    """The dtype the engine writes pixel values in for this server: bfloat16 or float16 when SGLang 0.5.16 will run
    the model in that dtype, as it decides it (`_get_and_verify_dtype`, srt/configs/model_config.py:1600): `--dtype` in
    `extra_args`, else the checkpoint's text config's `dtype` (the top level's when it has none, `get_hf_text_config`,
    srt/utils/hf_transformers/common.py:345). The model casts pixel values to its dtype, so sending them in it changes
    nothing it sees and halves the bytes. Float32 otherwise (a float32 checkpoint, which `auto` runs in float16, or a
    config that cannot be read): the launcher casts those as the model would."""
    flag = _flag_value(spec.extra_args, "--dtype")
    if flag is not None and flag != "auto":
        dtype = SGLANG_DTYPES.get(flag, torch.float32)
    else:
        config = _checkpoint_config(spec.model_path) or {}
        text = config.get("text_config") or {}
        name = text.get("dtype") or text.get("torch_dtype") or config.get("dtype") or config.get("torch_dtype")
        dtype = SGLANG_DTYPES.get(name, torch.float32) if isinstance(name, str) else torch.float32
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32


def spatial_merge_size(model_path: str) -> int:
    """The checkpoint's `vision_config.spatial_merge_size` (2, Qwen3-VL's, when unreadable)."""
    config = _checkpoint_config(model_path) or {}
    return int((config.get("vision_config") or {}).get("spatial_merge_size", 2))


def pixel_directory() -> Path:
    """A new private (0700) directory for pixel values handed to a server: in /dev/shm when there is one."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="miles_vl_pixels_", dir=base))


# SGLang's crash diagnostics in the launching process after a scheduler died (module docstring): off unless set
CRASH_DIAGNOSTICS_ENV = ("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH")


def build_server_env(spec: ServerSpec, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The server's environment: `base` (default: ours) plus the settings miles_vl needs (pure).

    Returns:
        A new dict; `SGLANG_VLM_CACHE_SIZE_MB` is `spec.vision_cache_mb` (see the module docstring for why 0),
        `MILES_VL_SGLANG_PLUGIN` holds `spec.plugin` (absent without one, whatever `base` had),
        `SGLANG_MM_PRECOMPUTE_HASH` is 1, `CRASH_DIAGNOSTICS_ENV` are 0 and `NCCL_CUMEM_ENABLE` is 0 unless `base`
        sets them (`nccl_peer_env`).
    """
    env = dict(os.environ if base is None else base)
    env["SGLANG_VLM_CACHE_SIZE_MB"] = str(spec.vision_cache_mb)
    env.pop(SETTINGS_ENV, None)  # an opt-in inherited from our own environment is not this server's
    if spec.plugin is not None:
        env[SETTINGS_ENV] = spec.plugin.to_env()
    env.setdefault("SGLANG_MM_PRECOMPUTE_HASH", "1")  # hash once per request, not once per `n` copy (docstring)
    for key in CRASH_DIAGNOSTICS_ENV:  # a dead scheduler's server exits at once, not 65 s later (docstring)
        env.setdefault(key, "0")
    for key, value in NO_MULTICAST_ENV.items():  # NVLink multicast off unless the caller decided otherwise
        env.setdefault(key, value)
    env.update(nccl_peer_env(env))  # the value its NCCL peers (the trainer) run with, explicit
    return env


def write_server_config(spec: ServerSpec, directory: str | Path) -> Path | None:
    """Write the private `--config` YAML holding the API key (mode 0600); None when the spec has no key.

    SGLang's config merger turns `api-key: <key>` into `--api-key <key>` inside the server process, which argparse then
    reads (`api_key_problem` says which keys survive that; `ServerSpec` refuses the others).
    """
    if not spec.api_key:
        return None
    _require_port(spec)
    path = Path(directory) / f"sglang_{spec.port}.yaml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)  # never through a link
    with os.fdopen(fd, "w") as f:
        f.write(f"api-key: {json.dumps(spec.api_key)}\n")  # a JSON string is a valid YAML scalar
    return path


def free_port(host: str) -> int:
    """A TCP port that nothing on this node holds now, for a server that will bind `host`: the kernel's choice for a
    bind to port 0 (as Ray and SGLang pick theirs), made on the node where the server runs.

    Nothing holds the port for the server until it binds it, which SGLang does only once its model has loaded
    (minutes): another process may take it meanwhile. The host then finds that out: its own server exits, or another
    process's server answers with a key that is not ours (`SGLangPortTakenError`).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(host: str, port: int, *, wait_s: float = 5.0, engine: str = "an engine") -> None:
    """Raise unless `host:port` can be bound (waits up to `wait_s` for a just-stopped server to let go of it).

    Args:
        host: the server's bind address.
        port: its port.
        wait_s: how long a port in use may take to come free (a relaunch: the last server's socket).
        engine: how the message names the engine (e.g. "rollout engine 1").

    Raises:
        ValueError: naming the port, the engine and the fix.
    """
    deadline = time.monotonic() + wait_s
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    while True:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # what uvicorn does: TIME_WAIT is no conflict
            try:
                s.bind((host, port))
                return
            except OSError as e:
                if time.monotonic() >= deadline:
                    raise ValueError(
                        f"cannot start the SGLang server of {engine} on {host}:{port}: the port is in use on this "
                        f"node ({e}), by another process (another job's SGLang server?). Set rollout.sglang.port to a "
                        "range that is free on every node (engine i uses port + i), or leave it null: each engine's "
                        "server then takes a free port of its node"
                    ) from e
        time.sleep(0.1)


REDACTED = b"<redacted>"
LOG_READ_BYTES = 1 << 16  # the most of one line the log copy holds at once
LOG_DRAIN_S = 2.0  # how long a dead server's last output may take to reach its log file


def secret_spellings(secret: str) -> tuple[bytes, ...]:
    """How a log line can spell `secret`: as it is, and between the quotes of Python's repr and of JSON (the same
    for a key of `new_api_key`; a user's key may hold characters they escape)."""
    return tuple({secret.encode(), repr(secret)[1:-1].encode(), json.dumps(secret)[1:-1].encode()})


def copy_redacted(source: BinaryIO, log_path: str | Path, hidden: Sequence[bytes]) -> None:
    """Append what `source` yields until its end to `log_path`, each of `hidden` written as `<redacted>` (in the order
    given: the longest first, where one contains another).

    Read a line at a time, at most `LOG_READ_BYTES` of it: a read that did not end a line keeps its last
    `len(secret) - 1` bytes for the next, so a secret split between two reads is still found."""
    keep = max((len(s) for s in hidden), default=1) - 1
    pending = b""
    writing = True
    with source, open(log_path, "ab", buffering=0) as out:  # unbuffered: each line is written as it comes
        while True:
            chunk = source.readline(LOG_READ_BYTES)
            data = pending + chunk
            for secret in hidden:
                data = data.replace(secret, REDACTED)
            pending = b""
            if chunk and not chunk.endswith(b"\n") and keep:
                data, pending = data[:-keep], data[-keep:]
            if writing:
                try:
                    out.write(data)
                except OSError as e:  # a full or failing disk: keep draining, or the server's writes meet EPIPE
                    writing = False
                    log.warning(
                        "the log %s of an SGLang server cannot be written (%s); its output is dropped", log_path, e
                    )
            if not chunk:
                return


class ServerProcess:
    """One supervised server process (SGLang, or in tests a stand-in speaking its HTTP API).

    Its stdout and stderr (those of every process it starts, too) reach the log file through a pipe and a thread of
    this process (`copy_redacted`) that writes each of `redact` as `<redacted>`: SGLang 0.5.16 logs its arguments,
    the API key among them.

    Args:
        argv: the command (e.g. `build_server_argv(spec, ...)`).
        env: its environment (e.g. `build_server_env(spec)`); None inherits ours.
        log_path: where stdout and stderr go (appended across restarts); None: a new temporary file.
        stop_timeout_s: grace between SIGTERM and SIGKILL of the process group.
        redact: strings never written to the log (`secret_spellings` of each is replaced).
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        log_path: str | Path | None = None,
        stop_timeout_s: float = 30.0,
        redact: Sequence[str] = (),
    ):
        if not argv:
            raise ValueError("ServerProcess needs a command; argv is empty")
        self.argv = list(argv)
        self.env = None if env is None else dict(env)
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="sglang_", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self.stop_timeout_s = stop_timeout_s
        self.starts = 0
        spellings = {b for secret in redact if secret for b in secret_spellings(secret)}
        self._redact = tuple(sorted(spellings, key=len, reverse=True))  # a spelling inside another: the longer first
        self._proc: subprocess.Popen | None = None
        self._copy: threading.Thread | None = None  # the log copy of the current (or last) process

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> None:
        """Start the process in a new session (its own process group)."""
        if self.is_alive():
            raise RuntimeError(f"server process {self.pid} is already running; stop() it first")
        self._drain()  # the last process's output first
        self.starts += 1
        with open(self.log_path, "ab") as out:
            out.write(f"\n=== miles_vl: start #{self.starts}: {' '.join(self.argv)}\n".encode())
        self._proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._copy = threading.Thread(
            target=copy_redacted,
            args=(self._proc.stdout, self.log_path, self._redact),
            name=f"server-log-{self._proc.pid}",
            daemon=True,
        )
        self._copy.start()
        log.info("started server process %d (log: %s)", self._proc.pid, self.log_path)

    def _drain(self, timeout_s: float = LOG_DRAIN_S) -> None:
        """Wait (at most `timeout_s`, once per process) for the log copy to reach the end of a dead process's output:
        its end comes when the last process holding the pipe (the server's children too) has exited."""
        if self._copy is not None and self._proc is not None and self._proc.poll() is not None:
            self._copy.join(timeout_s)
            self._copy = None

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def exits_within(self, timeout_s: float) -> bool:
        """Whether the process is gone or exits within `timeout_s` (a server that closed its socket while dying)."""
        if self._proc is None:
            return False
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def death_reason(self) -> str | None:
        """None while running (or never started); else the exit status and the end of the log."""
        if self._proc is None or self._proc.poll() is None:
            return None
        self._drain()
        code = self._proc.returncode
        how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return f"process {self._proc.pid} {how}; last log lines ({self.log_path}):\n{self.log_tail()}"

    def log_tail(self, max_lines: int = 30, max_bytes: int = 16384) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - max_bytes))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError as e:
            return f"(log unreadable: {e})"
        return "\n".join(lines[-max_lines:])

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after `stop_timeout_s`; a no-op when never started."""
        if self._proc is None:
            return
        pgid = self._proc.pid  # start_new_session: the group id is the leader's pid
        # Signal the group even when the leader has exited: SGLang's forked workers may outlive it.
        _signal_group(pgid, signal.SIGTERM)
        try:
            self._proc.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("server process %d ignored SIGTERM for %.0fs; killing it", pgid, self.stop_timeout_s)
        _signal_group(pgid, signal.SIGKILL)
        self._proc.wait()
        self._drain()

    def restart(self) -> None:
        self.stop()
        self.start()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def wait_until_healthy(
    client: SGLangClient, process: ServerProcess | None, *, timeout_s: float, poll_s: float = 1.0
) -> float:
    """Poll `/health_generate` until it answers 200.

    Args:
        client: the server's client.
        process: its process, to fail fast with its log if it dies; None when not supervised here.
        timeout_s: give up after this long (rollout.sglang.startup_timeout_s).
        poll_s: pause between polls.

    Returns:
        Seconds waited.

    Raises:
        SGLangServerDiedError: the process exited before becoming healthy.
        SGLangUnavailableError: not healthy within `timeout_s`.
    """
    start = time.monotonic()
    deadline = start + timeout_s
    while True:
        reason = process.death_reason() if process is not None else None
        if reason is not None:
            raise SGLangServerDiedError(f"SGLang server at {client.base_url} died while starting: {reason}")
        remaining = deadline - time.monotonic()
        if client.is_healthy(timeout_s=max(0.1, min(5.0, remaining))):
            return time.monotonic() - start
        if time.monotonic() >= deadline:
            tail = f"\nlast log lines ({process.log_path}):\n{process.log_tail()}" if process is not None else ""
            raise SGLangUnavailableError(
                f"SGLang server at {client.base_url} was not healthy (/health_generate) after {timeout_s:.0f}s; "
                f"raise rollout.sglang.startup_timeout_s if the model loads slowly, else see its log.{tail}"
            )
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
