"""Contract (issue 35.3): `model.path` may be a Hugging Face hub id. `miles-vl train` resolves it through
huggingface_hub before Ray starts (downloading into the cache when the hub can be reached, else the cached snapshot),
and every loader then reads the cached files; an id that is not cached where the hub cannot be reached is one error
(exit 2, nothing created) naming the configured id and `hf download <id>`. `miles-vl check` never downloads: it says
that `train` will.

The CLI runs as a process against a Hugging Face cache built here (HF_HUB_CACHE), with the hub either switched off
(HF_HUB_OFFLINE=1) or unreachable (HF_ENDPOINT at a closed local port): no network.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles_vl.models.hub import ModelNotFoundError, is_hub_id, local_model_dir
from tests.orchestration.jobs import FAST, REPO, write_checkpoint

TINY = REPO / "configs" / "geo3k_tiny_cpu.yaml"
REPO_ID = "acme/tiny-qwen3-vl"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
UNREACHABLE = "http://127.0.0.1:9"  # the discard port: nothing listens, the connection is refused at once


def fake_hub_cache(cache: Path, repo_id: str = REPO_ID) -> Path:
    """A Hugging Face hub cache holding `repo_id` at COMMIT (huggingface_hub's layout: `models--owner--name/` with
    `refs/main` naming the commit and `snapshots/<commit>/` the files), the snapshot a tiny Qwen3-VL checkpoint with
    a generation_config.json. Returns the snapshot directory."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    write_checkpoint(snapshot)
    (snapshot / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_k": 20}))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf_cache")
    fake_hub_cache(root)
    return root


def miles_vl(tmp_path: Path, cache: Path, *args: str, offline: bool) -> subprocess.CompletedProcess:
    """`miles-vl ARGS` as a process reading the HF cache `cache`, the hub switched off or unreachable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "RAY_ADDRESS", "WANDB_"))}
    env |= {
        "HF_HUB_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1" if offline else "0",
        "HF_ENDPOINT": UNREACHABLE,
        "HOME": str(tmp_path),
        "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "COLUMNS": "300",  # rich wraps log lines at the terminal width
    }
    exe = Path(sys.executable).with_name("miles-vl")
    return subprocess.run([str(exe), *args], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)


def job_args(tmp_path: Path, command: str, model: str, *extra: str) -> list[str]:
    return [
        command,
        str(TINY),
        *FAST,
        f"logging.output_dir={tmp_path / 'runs'}",
        "logging.run_name=r",
        "model.init=pretrained",
        f"model.path={model}",
        "model.processor=null",
        *extra,
    ]


def test_hub_id_shapes(tmp_path):
    assert is_hub_id("Qwen/Qwen3-VL-2B-Instruct") and is_hub_id("acme/tiny.v2_x-1")
    assert not is_hub_id("/models/Qwen3-VL-2B-Instruct")
    assert not is_hub_id("./ckpt/x") and not is_hub_id("~/x/y") and not is_hub_id("a/b/c") and not is_hub_id("x")
    (tmp_path / "own" / "dir").mkdir(parents=True)
    assert not is_hub_id(str(tmp_path / "own" / "dir"))
    assert local_model_dir(str(tmp_path / "own" / "dir")) == tmp_path / "own" / "dir"
    with pytest.raises(ModelNotFoundError, match="no such directory, and not a hub id") as nowhere:
        local_model_dir(str(tmp_path / "nowhere"))
    assert "hf download" not in str(nowhere.value)


def test_the_missing_model_hint_names_the_configured_model(tmp_path):
    """Issue 35.3: the hint for a missing checkpoint directory always said `huggingface-cli download
    Qwen/Qwen3-VL-2B-Instruct`, whatever model the config named; it now names the configured one."""
    path = str(tmp_path / "models" / "Qwen3-VL-8B-Instruct")
    with pytest.raises(ModelNotFoundError) as missing:
        local_model_dir(path)
    assert f"`hf download Qwen/Qwen3-VL-8B-Instruct --local-dir {path}`" in str(missing.value)
    assert "model.path=Qwen/Qwen3-VL-8B-Instruct" in str(missing.value) and "2B" not in str(missing.value)


def test_train_from_a_hub_id_in_the_cache_when_the_hub_cannot_be_reached(tmp_path, cache):
    """The whole tiny job starts from the cached snapshot of a hub id (trainer, engine and processor load it with
    local files only), and the HF directory it writes carries the snapshot's generation_config.json (export used to
    look for it under the id as a path and drop it silently)."""
    proc = miles_vl(
        tmp_path,
        cache,
        *job_args(tmp_path, "train", REPO_ID, "num_steps=1", "checkpoint.save_hf.final=true"),
        offline=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    snapshot = cache / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / COMMIT
    assert f"model.path={REPO_ID}: using {snapshot}" in " ".join(proc.stderr.split())
    hf_dirs = list((tmp_path / "runs" / "r" / "hf").iterdir())
    assert len(hf_dirs) == 1
    assert json.loads((hf_dirs[0] / "generation_config.json").read_text())["top_k"] == 20


def test_check_finds_a_cached_hub_id_offline(tmp_path, cache):
    proc = miles_vl(tmp_path, cache, *job_args(tmp_path, "check", REPO_ID), offline=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("command", ["check", "train"])
def test_a_hub_id_not_in_the_cache_offline_is_one_error_naming_it(tmp_path, cache, command):
    """Not cached and HF_HUB_OFFLINE=1: exit 2 before anything starts, the message names the configured id (the
    old hint always named Qwen3-VL-2B-Instruct) and how to fetch it."""
    proc = miles_vl(tmp_path, cache, *job_args(tmp_path, command, "acme/not-downloaded"), offline=True)
    err = " ".join(proc.stderr.split())
    assert proc.returncode == 2, err[-3000:]
    assert "model.path='acme/not-downloaded' is a hub id that is not in the local Hugging Face cache" in err
    assert "HF_HUB_OFFLINE is set" in err and "`hf download acme/not-downloaded`" in err
    assert "Qwen3-VL-2B" not in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def test_train_asks_the_hub_for_an_id_not_in_the_cache_and_says_it_cannot_be_reached(tmp_path, cache):
    """Online (HF_HUB_OFFLINE unset), `train` downloads a hub id that is not cached; here the hub refuses the
    connection, so it is one error saying so. `check` does not download: it passes and says `train` will."""
    proc = miles_vl(tmp_path, cache, *job_args(tmp_path, "train", "acme/not-downloaded"), offline=False)
    err = " ".join(proc.stderr.split())
    assert proc.returncode == 2, err[-3000:]
    assert "model.path='acme/not-downloaded' is a hub id that is not in the local Hugging Face cache" in err
    assert "the hub cannot be reached" in err and "`hf download acme/not-downloaded`" in err
    assert "Traceback" not in err and not (tmp_path / "runs").exists()

    proc = miles_vl(tmp_path, cache, *job_args(tmp_path, "check", "acme/not-downloaded"), offline=False)
    err = " ".join(proc.stderr.split())
    assert proc.returncode == 0, err[-3000:]
    assert "acme/not-downloaded is a hub id not in the local Hugging Face cache: `miles-vl train` downloads it" in err


def test_readers_of_the_checkpoint_files_find_a_hub_id_in_the_cache(tmp_path, cache, monkeypatch):
    """The weight-sync name check, the pixel dtype and the merge size read the checkpoint's own files; with a hub id
    they read the cached snapshot instead of silently falling back (no name check, float32 pixels)."""
    from huggingface_hub import constants

    from miles_vl.rollout.sglang.server import _checkpoint_config, spatial_merge_size
    from miles_vl.rollout.sglang.verify import checkpoint_names

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    snapshot = cache / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / COMMIT
    assert _checkpoint_config(REPO_ID) == json.loads((snapshot / "config.json").read_text())
    assert (
        spatial_merge_size(REPO_ID)
        == json.loads((snapshot / "config.json").read_text())["vision_config"]["spatial_merge_size"]
    )
    assert checkpoint_names(REPO_ID) == checkpoint_names(snapshot) and "lm_head.weight" in checkpoint_names(REPO_ID)
    assert checkpoint_names("acme/not-downloaded") is None
