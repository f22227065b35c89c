"""Contract: checkpoints appear only complete (atomic rename), the last K are kept, `auto` finds the newest."""

import pytest

from miles_vl.orchestration.checkpoint import (
    list_checkpoints,
    read_driver_state,
    resolve_resume,
    save_checkpoint,
)


def writer(payload):
    return lambda d: (d / "model.bin").write_text(payload)


def test_save_prune_and_resume(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, {"cursor": step * 10}, writer(f"w{step}"), keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 3]
    newest = resolve_resume(tmp_path, "auto")
    assert read_driver_state(newest) == {"step": 3, "cursor": 30}
    assert (newest / "model.bin").read_text() == "w3"
    assert resolve_resume(tmp_path, "never") is None
    assert resolve_resume(tmp_path / "empty", "auto") is None


def test_failed_write_leaves_no_checkpoint(tmp_path):
    save_checkpoint(tmp_path, 1, {}, writer("ok"), keep_last=3)

    def broken(d):
        (d / "model.bin").write_text("partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        save_checkpoint(tmp_path, 2, {}, broken, keep_last=3)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]  # the temp dir is not a checkpoint


def test_explicit_resume_path_must_exist(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a checkpoint directory"):
        resolve_resume(tmp_path, str(tmp_path / "nope"))
