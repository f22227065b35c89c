"""Contract: resuming a run whose config.yaml / processor.yaml an older miles_vl wrote (lacking the keys added since,
e.g. the video settings) neither warns nor keeps a copy: the files only gain the new keys; a file that differs on a key
both hold is kept beside the new one with a warning. Fresh starts without a run_name never share a directory."""

import logging
import threading

import yaml

from miles_vl.config import redacted
from miles_vl.data import load_processor, processor_metadata
from miles_vl.orchestration import loop
from miles_vl.orchestration.loop import choose_run_dir, write_run_files
from tests.orchestration.jobs import REPO, FrozenClock, tiny_job

OLD_DEFAULTS = ("rollout.sglang.colocated_sync=tensor", "train.vision_dp_when_cp=false")  # before 2026-11-26
VIDEO_KEYS = ("video_fps", "video_min_frames", "video_max_frames", "video_min_pixels", "video_max_pixels")


def test_files_from_before_new_keys_gain_them_without_a_warning(tmp_path, caplog):
    cfg = tiny_job(tmp_path, "old")
    run_dir = tmp_path / "run"
    meta = processor_metadata(load_processor("offline", cfg.data.min_pixels, cfg.data.max_pixels))
    write_run_files(run_dir, cfg, meta)
    # As a run from before videos left them: no video keys in processor.yaml, no data.video_* in config.yaml.
    old_meta = {k: v for k, v in meta.items() if k not in VIDEO_KEYS}
    (run_dir / "processor.yaml").write_text(yaml.safe_dump(old_meta, sort_keys=False))
    old_cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    for key in ("video_key", *VIDEO_KEYS, "synthetic_task"):
        old_cfg["data"].pop(key)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(old_cfg, sort_keys=False))
    with caplog.at_level(logging.INFO, logger="miles_vl.orchestration.loop"):
        write_run_files(run_dir, cfg, meta)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "processor.yaml"]
    assert yaml.safe_load((run_dir / "processor.yaml").read_text()) == meta
    assert "recorded the keys added since this run started: video_fps, " in caplog.text

    changed = dict(meta, max_pixels=meta["max_pixels"] * 4)
    write_run_files(run_dir, cfg, changed)
    assert "processor.yaml differs from the one this run started with" in caplog.text
    kept = [p for p in run_dir.iterdir() if p.name.startswith("processor.") and p.name != "processor.yaml"]
    assert len(kept) == 1 and yaml.safe_load(kept[0].read_text()) == meta


def test_fresh_starts_in_the_same_second_never_share_a_directory(tmp_path, monkeypatch):
    """Issue 30.3: two `checkpoint.resume=never` starts in the same second got the same run directory (a check for a
    free name, then a create much later). 16 threads claim at once with the clock frozen: 16 directories, each
    created by the claim (`-2` ... `-16` after the stamped name)."""
    monkeypatch.setattr(loop, "datetime", FrozenClock)
    cfg = tiny_job(tmp_path, "unused", "logging.run_name=null", "checkpoint.resume=never")
    config_path = str(REPO / "configs" / "geo3k_tiny_cpu.yaml")
    n, claimed = 16, []
    barrier = threading.Barrier(n)

    def start():
        barrier.wait()  # all at once
        claimed.append(choose_run_dir(cfg, config_path))

    threads = [threading.Thread(target=start) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stamp = "geo3k_tiny_cpu-20261126-120000"
    assert sorted(p.name for p in claimed) == sorted([stamp] + [f"{stamp}-{i}" for i in range(2, n + 1)])
    assert sorted(tmp_path.iterdir()) == sorted(claimed)  # each one exists: claimed, not just named


def test_a_checkpoint_of_the_old_sync_and_vision_defaults_resumes_without_accept_changes(tmp_path):
    """Issues 33.1 and 32.5 changed two defaults (`rollout.sglang.colocated_sync` tensor -> ipc,
    `train.vision_dp_when_cp` false -> true). A checkpoint records the resolved config, so every run saved before has
    the old values, and the same command now resolves the new ones: the resume's config check must not refuse it (both
    keys are in RESUME_MAY_CHANGE: a transport, and a split of the vision work that changes only a reduction's order).
    A key that does change a step is still listed."""
    recorded = {"config": redacted(tiny_job(tmp_path, "old", *OLD_DEFAULTS))}  # as driver.json holds it
    now = tiny_job(tmp_path, "old")
    assert (now.rollout.sglang.colocated_sync, now.train.vision_dp_when_cp) == ("ipc", True)
    assert loop.unaccepted_changes(now, recorded) == []
    hotter = tiny_job(tmp_path, "old", "rollout.temperature=0.5")
    assert [key for key, _, _ in loop.unaccepted_changes(hotter, recorded)] == ["rollout.temperature"]
