"""Contract: `miles-vl data synth` writes the generator's problems to parquet; `miles-vl data inspect` prints the
layout, row counts, images per row, each drop reason with its rows, and the first rendered prompt with its token
count and expanded image tokens, using the job config's data settings when `--config` is given."""

import re
from pathlib import Path

import pyarrow.parquet as pq

from miles_vl.cli import main
from miles_vl.data import synth_records
from miles_vl.data.cli import collapse_image_tokens
from tests.data.helpers import png_bytes, verl_record, write_geometry3k_parquet, write_verl_parquet

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "geo3k_tiny_cpu.yaml")


def test_synth_then_inspect(tmp_path, capsys):
    out = tmp_path / "synth.parquet"
    assert main(["data", "synth", str(out), "--n", "6", "--seed", "3"]) == 0
    assert "wrote 6 problems" in capsys.readouterr().out
    table = pq.read_table(out).to_pylist()
    assert [r["answer"] for r in table] == [r["answer"] for r in synth_records(6, seed=3)]

    assert main(["data", "inspect", str(out), "--rows", "2"]) == 0
    text = capsys.readouterr().out
    assert "layout: geometry3k, recognised from its columns (data.format=auto)\nrows: 6  kept: 6  dropped: 0" in text
    assert "images per row (kept rows): {1: 6}" in text
    assert text.count("\nrow ") == 2
    first = re.search(
        r"first prompt \(row 0\): (\d+) tokens, (\d+) image tokens, image_grid_thw \[\[(\d+), (\d+), (\d+)\]\]", text
    )
    assert first, text
    n_tokens, n_image, t, h, w = map(int, first.groups())
    assert n_image == t * h * w // 4 and n_tokens > n_image
    assert f"<|vision_start|><|image_pad|>×{n_image}<|vision_end|>" in text
    assert "<|im_start|>assistant" in text


def test_synth_motion_then_inspect(tmp_path, capsys):
    out = tmp_path / "motion.parquet"
    assert main(["data", "synth", str(out), "--n", "2", "--task", "motion"]) == 0
    assert "wrote 2 problems (motion, seed 0)" in capsys.readouterr().out
    small = ["data.video_min_pixels=1024", "data.video_max_pixels=16384", "data.video_min_frames=2"]
    assert main(["data", "inspect", str(out), "--rows", "1", "--config", TINY, *small]) == 0
    text = capsys.readouterr().out
    assert "kept: 2  dropped: 0" in text and "videos per row (kept rows): {1: 2}; sampled at 2.0 fps" in text
    assert "row 0: 0 image(s), 1 video(s) of [4] frames" in text
    assert "video_grid_thw [[2, 4, 4]]" in text and "<|vision_start|><|video_pad|>×4<|vision_end|>" in text


def test_inspect_reports_drops_with_the_config(tmp_path, capsys):
    good = png_bytes(seed=1)
    records = [
        {"images": [{"bytes": good, "path": None}], "problem": "<image>Find x.", "answer": "1"},
        {"images": [{"bytes": b"garbage", "path": None}], "problem": "<image>Find x.", "answer": "1"},
        {"images": [{"bytes": None, "path": "https://example.com/x.png"}], "problem": "<image>Find x.", "answer": "1"},
        {"images": [{"bytes": good, "path": None}], "problem": "<image><image>Find x.", "answer": "1"},
    ]
    path = write_geometry3k_parquet(tmp_path / "d.parquet", records)
    assert main(["data", "inspect", str(path), "--config", TINY]) == 0
    text = capsys.readouterr().out
    assert "rows: 4  kept: 1  dropped: 3" in text
    assert "corrupt_image: 1\n    row 1: cannot decode image" in text
    assert "remote_image: 1\n    row 2: remote image URL" in text
    assert "placeholder_mismatch: 1\n    row 3: 2 <image> placeholders but 1 images" in text
    assert "pixels 3136..12544" in text  # the tiny config's pixel range, not the schema default

    assert main(["data", "inspect", str(path), "--config", TINY, "data.max_prompt_len=5"]) == 1
    text = capsys.readouterr().out
    assert "prompt_too_long: 1" in text and "no usable rows" in text


def test_inspect_says_which_layout_it_recognised(tmp_path, capsys):
    """Issue 35.3: a verl parquet is recognised from its columns, and inspect says so (and which format a config named
    instead)."""
    path = write_verl_parquet(tmp_path / "train.parquet", [verl_record(i, "<image>Find x.", str(i)) for i in range(2)])
    assert main(["data", "inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "layout: verl, recognised from its columns (data.format=auto)\nrows: 2  kept: 2  dropped: 0" in text
    assert "answer '1': '<image>Find x. You FIRST think" in text
    assert main(["data", "inspect", str(path), "--config", TINY, "data.format=verl"]) == 0
    assert "layout: verl, data.format=verl\n" in capsys.readouterr().out


def test_collapse_image_tokens():
    assert collapse_image_tokens("a<|image_pad|><|image_pad|>b<|image_pad|>") == "a<|image_pad|>×2b<|image_pad|>×1"


def test_synth_many_images(tmp_path, capsys):
    out = tmp_path / "many.parquet"
    assert main(["data", "synth", str(out), "--n", "2", "--task", "many_images", "--images", "3"]) == 0
    table = pq.read_table(out).to_pylist()
    assert [len(row["images"]) for row in table] == [3, 3] and table[0]["problem"].count("<image>") == 3
    assert main(["data", "synth", str(tmp_path / "x.parquet"), "--task", "many_images", "--images", "1"]) == 2
    assert "--images must be >= 2" in capsys.readouterr().err and not (tmp_path / "x.parquet").exists()
