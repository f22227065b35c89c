"""Contract of checkpoint.py: checkpoints appear only complete (atomic rename), the last K are kept, `auto` finds the
newest that verifies; a label is never rewritten; a failed or interrupted save leaves nothing behind; a broken
checkpoint is named file by file before anything starts."""

import errno
import json
import logging
import re
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import save_file

from miles_vl.orchestration.checkpoint import (
    CheckpointError,
    list_checkpoints,
    read_driver_state,
    resolve_resume,
    save_checkpoint,
    verify_checkpoint,
)
from tests.disks import with_tmpfs


def writer(payload):
    return lambda d: (d / "model.bin").write_text(payload)


def real_writer(seed: int):
    """Writes what the torch backend writes: a safetensors file and a torch.save archive."""

    def write(d):
        g = torch.Generator().manual_seed(seed)
        save_file({"w": torch.randn(64, 64, generator=g)}, str(d / "model.safetensors"))
        torch.save({"step": seed, "m": torch.randn(64, generator=g)}, d / "trainer_state.pt")

    return write


def leftovers(root):
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # reaped: no process has this id now (ids are not reused that fast)


def test_save_prune_and_resume(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, {"cursor": step * 10}, writer(f"w{step}"), keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 3]
    newest = resolve_resume(tmp_path, "auto")
    assert read_driver_state(newest) == {"step": 3, "cursor": 30}
    assert (newest / "model.bin").read_text() == "w3"
    assert json.loads((newest / "manifest.json").read_text())["files"] == {
        "driver.json": len(json.dumps({"step": 3, "cursor": 30}, indent=1)),  # what read_driver_state parsed
        "model.bin": len("w3"),
    }
    assert resolve_resume(tmp_path, "never") is None
    assert resolve_resume(tmp_path / "empty", "auto") is None


def test_the_log_says_how_large_a_checkpoint_is_and_how_long_its_write_took(tmp_path, caplog):
    """The GPU runs size their stop's grace from this line (scripts/gpu/loop_run.sh): the bytes of every file the
    checkpoint holds, the seconds from the write's start to its publication."""

    def slow_writer(d):
        (d / "a.bin").write_bytes(b"x" * 3_000_000)
        (d / "sub").mkdir()
        (d / "sub" / "b.bin").write_bytes(b"y" * 1_000_000)
        time.sleep(0.3)

    with caplog.at_level(logging.INFO, logger="miles_vl.orchestration.checkpoint"):
        final = save_checkpoint(tmp_path, 4, {"cursor": 1}, slow_writer, keep_last=2)
    files = [f for f in final.rglob("*") if f.is_file()]
    assert {f.name for f in files} == {"a.bin", "b.bin", "driver.json", "manifest.json"}
    expected_gb = sum(f.stat().st_size for f in files) / 1e9
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("checkpoint saved")]
    size, seconds = re.fullmatch(
        rf"checkpoint saved: {re.escape(str(final))} \(([0-9.]+) GB, ([0-9.]+) s after its write began\)", line
    ).groups()
    assert float(size) == float(f"{expected_gb:.4g}") > 0.0039
    assert 0.3 <= float(seconds) < 30


def test_failed_write_leaves_no_checkpoint_and_no_temp_dir(tmp_path):
    save_checkpoint(tmp_path, 1, {}, writer("ok"), keep_last=3)

    def broken(d):
        (d / "model.bin").write_text("partial")
        raise RuntimeError("writer bug")

    with pytest.raises(RuntimeError):
        save_checkpoint(tmp_path, 2, {}, broken, keep_last=3)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]  # the temp dir is not a checkpoint ...
    assert leftovers(tmp_path) == []  # ... and it is gone


def test_a_full_disk_names_the_place_and_leaves_nothing(tmp_path):
    """Issue 15.5: ENOSPC mid-save left `.step_*.tmp-<pid>` behind, so the rerun hit ENOSPC again."""

    def fills_the_disk(d):
        (d / "model.bin").write_bytes(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="no space left on the device of .* free space there") as info:
        save_checkpoint(tmp_path, 1, {}, fills_the_disk, keep_last=2)
    assert info.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []


# A save into a real full disk, in a subprocess: `writer` fills the 1 MiB tmpfs that `with_tmpfs` mounts at `disk`.
FULL_DISK_SAVE = """
import json, os, sys, torch
from safetensors.torch import save_file
from miles_vl.orchestration.checkpoint import save_checkpoint
disk, writer = sys.argv[1], sys.argv[2]
big = {"w": torch.zeros(1 << 20)}  # 4 MiB of float32

def write(d):
    if writer == "torch":
        torch.save(big, d / "trainer_state.pt")
    else:
        save_file(big, str(d / "model.safetensors"))

try:
    save_checkpoint(disk, 1, {}, write, keep_last=2)
    result = {"raised": None}
except Exception as err:
    result = {"raised": type(err).__name__, "errno": getattr(err, "errno", None), "message": str(err)}
    result["cause"] = repr(err.__cause__)
result["left"] = os.listdir(disk)
print(json.dumps(result))
"""


@pytest.mark.parametrize("writer", ["torch", "safetensors"])
def test_a_full_disk_in_torchs_or_safetensors_writer_names_the_place_and_leaves_nothing(tmp_path, writer):
    """Issue 30.10: torch's writer meets a full disk with a RuntimeError ("unexpected pos ...", "file write failed")
    and safetensors' with a SafetensorError ("... (os error 28)"), neither an OSError, so the user got a traceback
    instead of the message. Now both give the message, with the errno; the partial checkpoint is removed. A real
    full disk (a 1 MiB tmpfs), real writers."""
    done = with_tmpfs(tmp_path / "disk", [sys.executable, "-c", FULL_DISK_SAVE, str(tmp_path / "disk"), writer])
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["raised"] == "DiskFullError" and result["errno"] == errno.ENOSPC, result
    assert f"no space left on the device of {tmp_path / 'disk'} while writing checkpoint step 1" in result["message"]
    assert "the partial checkpoint was removed; free space there or point checkpoint.dir elsewhere" in result["message"]
    assert ("RuntimeError" if writer == "torch" else "SafetensorError") in result["cause"]  # the writer's own error
    assert result["left"] == []


def test_a_torch_write_failure_that_is_not_a_full_disk_keeps_its_own_error(tmp_path):
    """Only a full disk is called one: torch's writer failing on a file size limit (RLIMIT_FSIZE: EFBIG, with space
    left on the device) raises torch's RuntimeError as it was, and the partial checkpoint is still removed."""
    code = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
        + FULL_DISK_SAVE.replace("disk, writer = sys.argv[1], sys.argv[2]", "disk, writer = sys.argv[1], 'torch'")
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["raised"] == "RuntimeError", result
    assert "no space left" not in result["message"]
    assert result["left"] == []


def test_temp_dirs_of_dead_processes_are_removed_by_the_next_save(tmp_path):
    """A process killed mid-save (SIGKILL, power loss) cannot clean up; the next save does, but never touches the
    temp dir of a process that is still alive (it may be saving right now)."""
    stale = tmp_path / f".step_00000002.tmp-{dead_pid()}"
    stale.mkdir()
    (stale / "model.bin").write_bytes(b"x" * 100)
    live = tmp_path / f".step_00000002.tmp-{subprocess.os.getppid()}"
    live.mkdir()
    save_checkpoint(tmp_path, 3, {}, writer("w3"), keep_last=2)
    assert not stale.exists()
    assert live.exists()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3]


def test_a_label_is_never_rewritten(tmp_path):
    """A checkpoint label holds one state for ever: saving an existing step raises before writing anything, and the
    existing checkpoint is untouched (issue 15.1/15.2 rewrote step_2 with another state; issue 20 asks that
    dropping this guard is caught here)."""
    save_checkpoint(tmp_path, 2, {"cursor": 20}, writer("first"), keep_last=3)
    calls = []

    def second(d):
        calls.append(d)
        (d / "model.bin").write_text("second")

    with pytest.raises(FileExistsError, match="step_00000002 already exists and a checkpoint label is never rewritten"):
        save_checkpoint(tmp_path, 2, {"cursor": 99}, second, keep_last=3)
    assert calls == []  # refused before the backend wrote anything
    path = tmp_path / "step_00000002"
    assert (path / "model.bin").read_text() == "first"
    assert read_driver_state(path) == {"step": 2, "cursor": 20}
    assert leftovers(tmp_path) == []


# ---------------------------------------------------------------------------------------------------------------------
# verification before a resume


def test_a_whole_checkpoint_verifies(tmp_path):
    path = save_checkpoint(tmp_path, 1, {}, real_writer(1), keep_last=2)
    assert verify_checkpoint(path) == []


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda p: (p / "trainer_state.pt").unlink(), "trainer_state.pt: missing"),
        (lambda p: _truncate(p / "model.safetensors", 100), "model.safetensors: 100 bytes, the manifest says"),
        (lambda p: _truncate(p / "trainer_state.pt", 200), "trainer_state.pt: 200 bytes, the manifest says"),
        (lambda p: (p / "driver.json").write_text('{"step": 1, "da'), "driver.json: not valid JSON"),
    ],
    ids=["missing-file", "truncated-safetensors", "truncated-torch-archive", "torn-driver-json"],
)
def test_auto_skips_a_broken_newest_checkpoint_naming_the_file(tmp_path, caplog, damage, expected):
    """Issue 15.6: a missing or truncated file in the newest checkpoint failed after Ray had started. Now `auto`
    verifies before anything starts, names the file, resumes from the previous checkpoint and keeps the broken one
    aside (its label is free again for the resumed run to write)."""
    save_checkpoint(tmp_path, 1, {}, real_writer(1), keep_last=3)
    newest = save_checkpoint(tmp_path, 2, {}, real_writer(2), keep_last=3)
    damage(newest)
    with caplog.at_level(logging.WARNING, logger="miles_vl.orchestration.checkpoint"):
        assert resolve_resume(tmp_path, "auto") == tmp_path / "step_00000001"
    assert expected in caplog.text and "resuming from step_00000001 instead" in caplog.text
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    assert len(list(tmp_path.glob("step_00000002.broken-*"))) == 1


def test_an_explicit_broken_checkpoint_is_an_error_that_offers_the_previous_one(tmp_path):
    good = save_checkpoint(tmp_path, 1, {}, real_writer(1), keep_last=3)
    bad = save_checkpoint(tmp_path, 2, {}, real_writer(2), keep_last=3)
    _truncate(bad / "model.safetensors", 50)
    with pytest.raises(CheckpointError, match=f"model.safetensors: 50 bytes.*checkpoint.resume={good}"):
        resolve_resume(tmp_path, str(bad))
    assert bad.exists()  # an explicit choice is not moved


def test_only_broken_checkpoints_is_an_error(tmp_path):
    bad = save_checkpoint(tmp_path, 1, {}, real_writer(1), keep_last=3)
    (bad / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no checkpoint under .* can be resumed from: step_00000001: .*missing"):
        resolve_resume(tmp_path, "auto")


def test_checkpoints_without_a_manifest_still_resume(tmp_path):
    """Checkpoints written before manifests existed: the format checks still run, the resume still works."""
    path = save_checkpoint(tmp_path, 1, {}, real_writer(1), keep_last=2)
    (path / "manifest.json").unlink()
    assert resolve_resume(tmp_path, "auto") == path
    _truncate(path / "model.safetensors", 300)
    assert "model.safetensors: 300 bytes, its header describes" in verify_checkpoint(path)[0]


def test_explicit_resume_path_must_exist(tmp_path):
    with pytest.raises(CheckpointError, match=r"is not a checkpoint directory.*\(none in .* or .*\)"):
        resolve_resume(tmp_path, str(tmp_path / "nope"))


def test_a_mistyped_checkpoint_name_is_answered_with_the_names_there_in_the_job_and_in_check(tmp_path):
    """`step_4` for `step_00000004` (a new user did, from the docs): the job and `miles-vl check` both list the newest
    checkpoints of that directory."""
    from miles_vl.config import load_config
    from miles_vl.orchestration.preflight import resume_problems

    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, {}, real_writer(step), keep_last=3)
    names = [str(tmp_path / f"step_0000000{s}") for s in (2, 3, 4)]
    with pytest.raises(CheckpointError) as err:
        resolve_resume(tmp_path, str(tmp_path / "step_4"))
    assert f"or one of {names}" in str(err.value)
    job = tmp_path / "job.yaml"
    job.write_text("model:\n  init: random\n  processor: offline\ndata:\n  synthetic_n: 8\n")
    cfg = load_config(job, [f"checkpoint.resume={tmp_path / 'step_4'}"])
    assert resume_problems(cfg) == [str(err.value)]
    elsewhere = tmp_path / "other_run"  # the job's own checkpoint root holds none: the path's own place is listed
    with pytest.raises(CheckpointError, match=re.escape(f"or one of {names}")):
        resolve_resume(elsewhere, str(tmp_path / "step_4"))
    with pytest.raises(CheckpointError, match=re.escape(f"or one of {names}")):  # the checkpoints folder itself
        resolve_resume(elsewhere, str(tmp_path))


def _truncate(path, size):
    data = path.read_bytes()
    path.write_bytes(data[:size])
