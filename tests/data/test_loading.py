"""Contract: parquet and jsonl load in the geometry3k, geo3k_imgurl and generic layouts, with images from bytes,
paths (relative to the file), file:// and data URLs; every unusable row is dropped, counted under its reason and
logged: over-long prompt, corrupt or truncated bytes, missing file, remote URL, placeholder/image count mismatch,
missing field, dataset_fn skip. Kept rows keep their original row ids."""

import dataclasses
import logging

import pytest

from miles_vl.config.schema import DataConfig
from miles_vl.data import (
    DataError,
    DropReason,
    LoadOptions,
    load_dataset_fn,
    load_prompt_file,
    load_prompt_records,
    read_records,
)
from miles_vl.data.builder import load_options
from tests.data.helpers import (
    data_url,
    png_bytes,
    verl_record,
    write_geometry3k_parquet,
    write_jsonl,
    write_png,
    write_verl_parquet,
)


def load(path, encoder, max_prompt_len=512, **kw):
    return load_prompt_file(path, encoder, LoadOptions(max_prompt_len=max_prompt_len, **kw))


def test_geometry3k_parquet(tmp_path, encoder):
    records = [
        {"images": [{"bytes": png_bytes(seed=i), "path": f"{i}.png"}], "problem": f"<image>Find x{i}.", "answer": "5"}
        for i in range(3)
    ]
    rows, report = load(write_geometry3k_parquet(tmp_path / "g.parquet", records), encoder)
    assert report.layout == "geometry3k"
    assert (report.n_rows, report.n_kept, report.n_dropped) == (3, 3, 0)
    assert [r.index for r in rows] == [0, 1, 2]
    assert rows[1].images == (png_bytes(seed=1),) and rows[1].label == "5" and rows[1].problem == "<image>Find x1."
    assert all(r.prompt_len == encoder.encode(r).prompt_len for r in rows)


def test_geo3k_imgurl_jsonl_paths_and_data_urls(tmp_path, encoder):
    rel = write_png(tmp_path / "imgs" / "a.png", seed=1)
    absolute = write_png(tmp_path / "elsewhere" / "b.png", seed=2)
    records = [
        {"images": ["imgs/a.png"], "problem": "<image>Find x.", "answer": "3"},  # relative to the jsonl's folder
        {"images": [str(absolute)], "problem": "<image>Find y.", "answer": "4"},
        {"images": ["file://" + str(absolute)], "problem": "<image>Find z.", "answer": "5"},
        {"images": [data_url(png_bytes(seed=3))], "problem": "Two: <image> <image>", "answer": "6"},
    ]
    records[3]["images"].append("imgs/a.png")
    rows, report = load(write_jsonl(tmp_path / "d.jsonl", records), encoder)
    assert report.layout == "geo3k_imgurl" and report.n_kept == 4 and not report.dropped
    assert rows[0].images == (rel,) and rows[1].images == (absolute,) and rows[2].images == (absolute,)
    assert rows[3].images == (png_bytes(seed=3), rel)
    assert encoder.encode(rows[3]).image_grid_thw.shape == (2, 3)


def test_generic_layout_with_custom_keys(tmp_path, encoder):
    write_png(tmp_path / "q.png")
    records = [
        {"question": "<image>How long is AB?", "solution": 3.5, "picture": "q.png", "source": "mine", "id": 7},
        {"question": "What is 1 + 1?", "solution": 2, "picture": None, "source": "mine", "id": 8},  # text only
    ]
    path = write_jsonl(tmp_path / "g.jsonl", records)
    rows, report = load(path, encoder, prompt_key="question", answer_key="solution", image_key="picture")
    assert report.layout == "generic" and report.n_kept == 2
    assert [r.label for r in rows] == ["3.5", "2"]
    assert rows[0].metadata == {"source": "mine", "id": 7} and len(rows[0].images) == 1 and rows[1].images == ()
    with pytest.raises(ValueError, match=r"no prompt column 'problem'.*'question'.*set data.prompt_key"):
        load(path, encoder)
    with pytest.raises(ValueError, match="set data.format=generic"):
        load(path, encoder, layout="geometry3k", prompt_key="question")


def test_verl_parquet_is_recognised_and_read(tmp_path, encoder):
    """Issue 35.3: verl's geo3k parquet (chat-message `prompt`, `reward_model.ground_truth`) loads as the `verl`
    layout: the user message is the problem, the nested ground truth the answer, the scalar columns metadata."""
    records = [verl_record(0, "<image>Find x.", "5"), verl_record(1, "Two: <image> <image>", "12", n_images=2)]
    records.append(verl_record(2, "<image>Find y.", "7") | {"reward_model": {"style": "rule", "ground_truth": None}})
    path = write_verl_parquet(tmp_path / "train.parquet", records)
    for layout in ("auto", "verl"):
        rows, report = load(path, encoder, layout=layout)
        assert report.layout == "verl"
        assert [r.index for r in rows] == [0, 1] and report.dropped == {DropReason.MISSING_FIELD: 1}
        assert rows[0].problem == "<image>Find x. You FIRST think about the reasoning process." and rows[0].label == "5"
        assert rows[1].images == (png_bytes(seed=1), png_bytes(seed=2)) and rows[1].label == "12"
        assert rows[0].metadata == {"data_source": "hiyouga/geometry3k", "ability": "math"}
    with pytest.raises(ValueError, match="set data.format=generic"):
        load(path, encoder, layout="verl", answer_key="reward_model")


def test_verl_prompt_parts_and_refused_messages(tmp_path, encoder):
    """A content given as typed parts reads as text with `<image>` where the image part is; a system or assistant
    message, or two user messages, is one DataError naming the file, the row and the fix (the system prompt is
    data.system_prompt), never a row silently read without it."""
    parts = [{"type": "image"}, {"type": "text", "text": "Find x."}]
    record = {"prompt": [{"role": "user", "content": parts}], "images": [data_url(png_bytes())]}
    record["reward_model"] = {"ground_truth": "5"}
    rows, report = load(write_jsonl(tmp_path / "parts.jsonl", [record]), encoder)
    assert report.layout == "verl" and rows[0].problem == "<image>Find x." and rows[0].label == "5"

    system = {"role": "system", "content": "Be brief."}
    for i, prompt in enumerate(
        [[system, {"role": "user", "content": "<image>Find x."}], [{"role": "user", "content": "a"}] * 2]
    ):
        bad = [verl_record(0, "<image>Find x.", "5"), verl_record(1, "<image>Find y.", "6")]
        bad[1]["prompt"] = prompt
        path = write_verl_parquet(tmp_path / f"bad{i}.parquet", bad)
        with pytest.raises(
            DataError, match=rf"bad{i}.parquet: row 1: the verl prompt has the messages .*data.system_prompt"
        ):
            load(path, encoder)


def test_every_drop_reason_is_counted_and_logged(tmp_path, encoder, caplog):
    good = png_bytes(seed=5)
    truncated = good[: len(good) // 2]
    records = [
        {"images": [{"bytes": good, "path": None}], "problem": "<image>Find x.", "answer": "1"},  # 0 kept
        {"images": [{"bytes": b"not an image", "path": None}], "problem": "<image>Find x.", "answer": "1"},  # corrupt
        {"images": [{"bytes": truncated, "path": None}], "problem": "<image>Find x.", "answer": "1"},  # corrupt
        {"images": [{"bytes": None, "path": "gone.png"}], "problem": "<image>Find x.", "answer": "1"},  # missing
        {"images": [{"bytes": None, "path": "http://example.com/a.png"}], "problem": "<image>x", "answer": "1"},
        {"images": [{"bytes": None, "path": "https://example.com/b.png"}], "problem": "<image>x", "answer": "1"},
        {"images": [{"bytes": good, "path": None}], "problem": "<image><image>Find x.", "answer": "1"},  # 2 vs 1
        {"images": [{"bytes": good, "path": None}], "problem": "Find x.", "answer": "1"},  # 0 vs 1
        {"images": [{"bytes": good, "path": None}], "problem": "<image>" + "Find x. " * 300, "answer": "1"},  # long
        {"images": [{"bytes": good, "path": None}], "problem": "<image>Find x.", "answer": None},  # no answer
        {"images": [{"bytes": good, "path": None}], "problem": "<image>Find y.", "answer": "2"},  # 10 kept
    ]
    path = write_geometry3k_parquet(tmp_path / "mixed.parquet", records)
    with caplog.at_level(logging.INFO, logger="miles_vl.data.loading"):
        rows, report = load(path, encoder, max_prompt_len=256)
    assert [r.index for r in rows] == [0, 10]
    assert report.dropped == {
        DropReason.CORRUPT_IMAGE: 2,
        DropReason.MISSING_IMAGE: 1,
        DropReason.REMOTE_IMAGE: 2,
        DropReason.PLACEHOLDER_MISMATCH: 2,
        DropReason.PROMPT_TOO_LONG: 1,
        DropReason.MISSING_FIELD: 1,
    }
    assert (report.n_rows, report.n_kept, report.n_dropped) == (11, 2, 9)
    details = {(e.index, e.reason): e.detail for e in report.examples}
    assert "gone.png" in details[3, DropReason.MISSING_IMAGE]
    assert "http://example.com/a.png" in details[4, DropReason.REMOTE_IMAGE]
    assert "does not download" in details[5, DropReason.REMOTE_IMAGE]
    assert "2 <image> placeholders but 1 images" in details[6, DropReason.PLACEHOLDER_MISMATCH]
    assert "0 <image> placeholders but 1 images" in details[7, DropReason.PLACEHOLDER_MISMATCH]
    assert "> max_prompt_len 256" in details[8, DropReason.PROMPT_TOO_LONG]
    log = caplog.text
    assert "kept 2 of 11 rows" in log and "remote_image=2" in log and "prompt_too_long=1" in log
    assert "dropped row 1 (corrupt_image)" in log


def test_jsonl_image_values(tmp_path, encoder):
    """Bad data URLs or base64, unsupported values, struct-less dicts and sizes the processor refuses are corrupt."""
    records = [
        {"images": [data_url(png_bytes(1000, 4))], "problem": "<image>a", "answer": "1"},  # aspect ratio 250 > 200
        {"images": ["data:image/png;base64,@@@notbase64"], "problem": "<image>a", "answer": "1"},
        {"images": ["data:image/png,rawtext"], "problem": "<image>a", "answer": "1"},
        {"images": [{"bytes": "!!"}], "problem": "<image>a", "answer": "1"},
        {"images": [12345], "problem": "<image>a", "answer": "1"},
        {"images": [{"other": 1}], "problem": "<image>a", "answer": "1"},
        {"images": ["missing/dir/x.png"], "problem": "<image>a", "answer": "1"},
        {"images": ["ftp://host/x.png"], "problem": "<image>a", "answer": "1"},
        {"images": [], "problem": "", "answer": "1"},
    ]
    _, report = load(write_jsonl(tmp_path / "v.jsonl", records), encoder)
    assert "cannot take a 1000x4 image" in report.examples[0].detail
    assert report.dropped == {
        DropReason.CORRUPT_IMAGE: 6,
        DropReason.MISSING_IMAGE: 1,
        DropReason.REMOTE_IMAGE: 1,
        DropReason.MISSING_FIELD: 1,
    }


def map_row(record):
    """A custom dataset_fn (used through 'tests.data.test_loading:map_row'): skips rows marked skip."""
    if record.get("skip"):
        return None
    return {"problem": "<image>" + record["q"], "answer": record["a"], "images": [record["img"]], "metadata": {"k": 1}}


def test_dataset_fn(tmp_path, encoder):
    fn = load_dataset_fn("tests.data.test_loading:map_row")
    records = [{"q": "Find x.", "a": "2", "img": data_url(png_bytes())}, {"skip": True}]
    rows, report = load_prompt_records(
        records, encoder, LoadOptions(max_prompt_len=512, dataset_fn=fn), source="custom"
    )
    assert report.layout == "custom" and report.dropped == {DropReason.SKIPPED_BY_DATASET_FN: 1}
    assert rows[0].problem == "<image>Find x." and rows[0].metadata == {"k": 1}
    with pytest.raises(DataError, match="x: row 0: dataset_fn failed: TypeError: .*must return None or a mapping"):
        load_prompt_records([{}], encoder, LoadOptions(max_prompt_len=512, dataset_fn=lambda r: "oops"), source="x")
    for spec, match in [
        ("no_colon", "package.module:function"),
        ("not_a_module_xyz:f", "cannot import"),
        ("tests.data.test_loading:nope", "has no attribute"),
        ("tests.data.test_loading:pytest.__name__", "not a function"),
    ]:
        with pytest.raises(ValueError, match=match):
            load_dataset_fn(spec)


def test_load_options_carry_every_loading_setting_of_the_data_section():
    """`builder.load_options` is what both `build_datasets` and `miles-vl data inspect` load with: a setting of the
    data section it left out would be silently ignored by both. Every field here differs from its default."""
    cfg = DataConfig(
        train_path="d.jsonl",
        format="generic",
        prompt_key="q",
        answer_key="a",
        image_key="img",
        video_key="clip",
        dataset_fn="tests.data.test_loading:map_row",
        max_prompt_len=77,
        max_image_pixels=1234,
        max_video_bytes=5678,
    )
    options = load_options(cfg)
    assert options == LoadOptions(77, "generic", "q", "a", "img", "clip", map_row, 1234, 5678)
    unset = [f.name for f in dataclasses.fields(LoadOptions) if getattr(options, f.name) == f.default]
    assert not unset, f"LoadOptions fields load_options leaves at their defaults: {unset}"


def test_file_errors(tmp_path):
    with pytest.raises(DataError, match="data.train_path"):
        read_records(tmp_path / "nope.parquet")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="use .parquet or .jsonl"):
        read_records(tmp_path / "d.csv")
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\n{broken\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        read_records(tmp_path / "bad.jsonl")
