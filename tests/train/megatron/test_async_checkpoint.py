"""Issue 33.3: the megatron backend writes its checkpoints in the background with megatron-core's own async save
(train/megatron/checkpoint.py), under the contract of the torch backend's (orchestration/trainer.py,
orchestration/checkpoint.py): the state written is the one at the call, whatever training does while the write is in
flight; the checkpoint is complete (`metadata.json`, `.metadata`) only once every rank's write has ended and the
finalize ran; a rank's failed write is raised on every rank by `wait()` (never by a `done()` poll), names the
checkpoint, and a full disk is recognised as one; a resume from it repeats the step a synchronous save's resume
does. Two gloo ranks on the CPU, the tiny real Qwen3VLModel, the real megatron-core 0.19 save and load (its two CUDA
calls stood in: tests/patches/harness/shims.py)."""

from __future__ import annotations

import errno
import json
import sys
from pathlib import Path

import pytest
import torch

from tests.disks import with_tmpfs
from tests.train.megatron import cpu_parts, jobs

REPO = Path(__file__).resolve().parents[3]


pytestmark = pytest.mark.usefixtures("megatron_bridge")


def assert_same_state(a: dict, b: dict) -> None:
    assert a["counters"] == b["counters"]
    assert a["weights"].keys() == b["weights"].keys()
    for name, w in a["weights"].items():
        assert torch.equal(w, b["weights"][name]), name
    assert len(a["moments"]) == len(b["moments"])
    for x, y in zip(a["moments"], b["moments"], strict=True):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def differ(a: dict, b: dict) -> list[str]:
    return [n for n, w in a["weights"].items() if not torch.equal(w, b["weights"][n])]


def test_a_background_save_holds_the_state_at_the_call_and_resumes_like_a_synchronous_one(tmp_path):
    ranks = cpu_parts.spawn(jobs.job_async_save, 2, args=(jobs.train_samples(0)[:4], str(tmp_path)))
    sync_files = sorted(p.name for p in (tmp_path / "sync").iterdir())
    async_files = sorted(p.name for p in (tmp_path / "async").iterdir())
    assert async_files == sync_files and {"metadata.json", ".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(
        sync_files
    )
    for name in sync_files:
        if name != ".metadata":  # the index holds a save id (a uuid): the shards and metadata.json are byte for byte
            assert (tmp_path / "async" / name).read_bytes() == (tmp_path / "sync" / name).read_bytes(), name
    for out in ranks:
        # while the writer was held the write was in flight: not done, no index and no metadata.json yet
        assert out["done_while_held"] is False and out["done_after_step"] is False, out["files_while_held"]
        assert not {"metadata.json", ".metadata"} & set(out["files_while_held"])
        assert out["done_after_wait"] is True
        assert differ(out["at_save"], out["straight"])  # the second step moved the weights while the write was held
        assert_same_state(out["async_loaded"], out["at_save"])  # yet the checkpoint holds the state at the call
        assert_same_state(out["sync_loaded"], out["at_save"])
        assert_same_state(out["async_resumed"], out["straight"])  # and the resumed step repeats the straight one
        assert_same_state(out["sync_resumed"], out["straight"])


def test_a_write_that_fails_on_one_rank_is_raised_on_every_rank_and_nothing_is_published(tmp_path):
    """Rank 1's shard file cannot be created (a directory stands in its place), in megatron-core's writer process:
    polling `done()` never raises; `wait()` raises `CheckpointWriteError` naming the checkpoint on both ranks (the
    driver gets it from whichever rank it asks first); it is not taken for a full disk (a probe write fits); no
    `metadata.json` or `.metadata` is written; the next save works."""
    ranks = cpu_parts.spawn(jobs.job_async_save_fails, 2, args=(jobs.train_samples(0)[:4], str(tmp_path)))
    for rank, out in enumerate(ranks):
        assert out["polls"] == [True], rank
        name, message, full = out["blocked"]
        assert name == "CheckpointWriteError", out["blocked"]
        assert f"writing the megatron checkpoint {tmp_path / 'blocked'} failed: " in message
        assert full is None
        assert not {"metadata.json", ".metadata"} & set(out["blocked_files"]), out["blocked_files"]
        assert {"metadata.json", ".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(out["after_files"])
    assert "Worker failure" in ranks[0]["blocked"][1]  # rank 0 gathers every rank's result: it says what failed


def test_a_full_disk_in_the_background_writer_is_found(tmp_path):
    """A real full disk (a 64 KiB tmpfs) met by megatron-core's writer process: its error carries no errno (the
    writer keeps only the text), and the probe write of `out_of_space` finds the full disk, on every rank, so the
    driver reports it as one (orchestration/checkpoint.py: `DiskFullError`, the partial checkpoint removed)."""
    disk = tmp_path / "disk"
    code = (
        "import json, sys\n"
        "from tests.train.megatron import cpu_parts, jobs\n"
        "print(json.dumps(cpu_parts.spawn(jobs.job_async_save_on_a_full_disk, 2, args=(sys.argv[1],))))\n"
    )
    done = with_tmpfs(disk, [sys.executable, "-c", code, str(disk)], size="64k", cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for out in json.loads(done.stdout.splitlines()[-1]):
        name, message, full = out["raised"]
        assert name == "CheckpointWriteError" and full == errno.ENOSPC, out
        assert f"writing the megatron checkpoint {disk / 'ckpt'} failed" in message
