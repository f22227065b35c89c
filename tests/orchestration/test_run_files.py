"""Contract: resuming a run whose config.yaml / processor.yaml an older miles_vl wrote (lacking the keys added since,
e.g. the video settings) neither warns nor keeps a copy: the files only gain the new keys; a file that differs on a key
both hold is kept beside the new one with a warning."""

import logging

import yaml

from miles_vl.data import load_processor, processor_metadata
from miles_vl.orchestration.loop import write_run_files
from tests.orchestration.jobs import tiny_job

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
