"""Contract: a row's video (a frame list, a `{frames, fps}` struct, or a video file) goes through the loader and the
encoder into a `PromptSample` with `pixel_values_videos` and `video_grid_thw`, sampled by Qwen3-VL's own rule with
the settings fixed on the processor (and recorded by `processor_metadata`), and the load-time token count equals the
processor's; a bad video drops its row under a named reason; a video file without a decoder is an error that says
what to install. A video whose sampled frames take more than `data.max_video_bytes` decoded is dropped
(`video_too_large`) from its headers before a frame is decoded, or, when a header understates, at the frame that passes
the bound."""

import functools
import sys
import types
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from miles_vl.config.schema import DataConfig
from miles_vl.data import (
    DataError,
    DropReason,
    LoadOptions,
    PromptEncoder,
    VideoSettings,
    build_datasets,
    load_processor,
    load_prompt_file,
    load_prompt_records,
    processor_metadata,
    video_settings,
)
from miles_vl.data import videos as videos_module
from miles_vl.data.videos import VideoError
from tests.data.helpers import png_bytes, write_jsonl, write_png

SMALL = VideoSettings(fps=2.0, min_frames=2, max_frames=8, min_pixels=32 * 32, max_pixels=4 * 64 * 64)


@pytest.fixture(scope="module")
def processor():
    return load_processor("offline", 32 * 32, 64 * 64, SMALL)


@pytest.fixture(scope="module")
def encoder(processor):
    return PromptEncoder(processor, instruction="Answer.")


def frames(n, size=(64, 64)):
    return [png_bytes(*size, seed=k) for k in range(n)]


def load(records, encoder, **kw):
    base_dir = kw.pop("base_dir", None)
    options = LoadOptions(max_prompt_len=kw.pop("max_prompt_len", 512), **kw)
    return load_prompt_records(records, encoder, options, source="t", base_dir=base_dir)


def test_rows_become_prompt_samples_with_video_grids(encoder, processor):
    records = [
        {"problem": "<video>Which way?", "answer": "A", "videos": [frames(4)]},
        {"problem": "Look: <image> then <video>.", "answer": "B", "images": [png_bytes(64, 64)], "videos": [frames(3)]},
        {"problem": "<video>", "answer": "C", "videos": [{"frames": frames(8), "fps": 8}]},  # 1 s at 8 fps -> 2 frames
    ]
    rows, report = load(records, encoder)
    assert report.n_kept == 3 and not report.dropped
    assert [v.indices for r in rows for v in r.videos] == [(0, 1, 2, 3), (0, 1, 2), (0, 7)]
    for row in rows:
        sample = encoder.encode(row)  # raises if the load-time count differs from the processor's output
        assert sample.prompt_len == row.prompt_len
        grid = sample.video_grid_thw
        # 64x64 frames at this pixel range: 4x4 patches; t = ceil(frames / temporal_patch_size)
        assert grid.tolist() == [[-(-len(row.videos[0].indices) // 2), 4, 4]]
        assert sample.pixel_values_videos.shape == (int(grid.prod()), 3 * 2 * 16 * 16)
        n_video_tokens = int((sample.prompt_ids == processor.video_token_id).sum())
        assert n_video_tokens == int(grid.prod()) // 4  # merge 2 x 2
    mixed = encoder.encode(rows[1])
    assert mixed.image_grid_thw.tolist() == [[1, 4, 4]]
    text = processor.tokenizer.decode(mixed.prompt_ids)
    assert text.index("<|image_pad|>") < text.index("<|video_pad|>")  # placeholder order kept
    # Qwen3-VL's timestamps: frames 0..2 at 2 fps, padded to 4 -> groups at (0 + 0.5) / 2 and (1 + 1) / 2 seconds
    assert "<0.2 seconds>" in text and "<1.0 seconds>" in text
    assert "<0.4 seconds>" in processor.tokenizer.decode(encoder.encode(rows[2]).prompt_ids)  # (0 + 7/8) / 2 = .44


def test_frame_paths_in_a_file_are_relative_to_it(tmp_path, encoder):
    for k in range(2):
        write_png(tmp_path / "clip" / f"{k}.png", width=64, height=64, seed=k)
    path = write_jsonl(
        tmp_path / "d.jsonl", [{"problem": "<video>x", "answer": "1", "videos": [["clip/0.png", "clip/1.png"]]}]
    )
    rows, report = load_prompt_file(path, encoder, LoadOptions(max_prompt_len=512))
    assert report.n_kept == 1 and rows[0].videos[0].frames == (tmp_path / "clip/0.png", tmp_path / "clip/1.png")
    assert encoder.encode(rows[0]).video_grid_thw.tolist() == [[1, 4, 4]]


def test_bad_videos_drop_their_rows_with_a_reason(tmp_path, encoder):
    records = [
        {"problem": "<video>", "answer": "1", "videos": [[]]},
        {"problem": "<video>", "answer": "1", "videos": [["missing/0.png"]]},
        {"problem": "<video><video>", "answer": "1", "videos": [frames(2)]},
        {"problem": "no placeholder", "answer": "1", "videos": [frames(2)]},
        {"problem": "<video>", "answer": "1", "videos": [[png_bytes(64, 64), png_bytes(64, 48)]]},
        {"problem": "<video>", "answer": "1", "videos": [frames(2, size=(20, 20))]},
        {"problem": "<video>", "answer": "1", "videos": ["https://example.com/a.mp4"]},
        {"problem": "<video>", "answer": "1", "videos": [str(tmp_path / "gone.mp4")]},
        {"problem": "<video>", "answer": "1", "videos": [frames(8)]},  # fits only a longer max_prompt_len
    ]
    rows, report = load(records, encoder, base_dir=tmp_path, max_prompt_len=60)
    assert rows == []
    reasons = {ex.index: (ex.reason, ex.detail) for ex in report.examples}
    assert reasons[0] == (
        DropReason.CORRUPT_VIDEO,
        "a video with zero frames; give at least one frame, or drop the <video>",
    )
    assert reasons[1][0] == DropReason.MISSING_VIDEO and "missing/0.png" in reasons[1][1]
    assert reasons[2] == (
        DropReason.PLACEHOLDER_MISMATCH,
        "2 <video> placeholders but 1 videos; put one <video> in the prompt per entry of the videos column",
    )
    assert reasons[3][0] == DropReason.PLACEHOLDER_MISMATCH
    assert reasons[4][0] == DropReason.CORRUPT_VIDEO and "differ in size" in reasons[4][1]
    assert reasons[5][0] == DropReason.CORRUPT_VIDEO and "20x20" in reasons[5][1]
    assert reasons[6][0] == DropReason.REMOTE_IMAGE and "does not download" in reasons[6][1]
    assert reasons[7][0] == DropReason.MISSING_VIDEO and "gone.mp4" in reasons[7][1]
    assert reasons[8][0] == DropReason.PROMPT_TOO_LONG and "video frames [8]" in reasons[8][1]
    assert report.n_dropped == len(records)
    assert "corrupt_video=3" in report.summary() and "missing_video=2" in report.summary()
    _, report = load([{"problem": "<video>", "answer": "1", "videos": [[b"not a png", b"nor this"]]}], encoder)
    assert report.dropped == {DropReason.CORRUPT_VIDEO: 1} and "cannot decode" in report.examples[0].detail


def test_a_video_file_without_a_decoder_says_what_to_install(tmp_path, encoder, monkeypatch):
    monkeypatch.setattr(videos_module, "video_backend", lambda: None)
    (tmp_path / "a.mp4").write_bytes(b"\x00" * 16)
    records = [{"problem": "ok", "answer": "1"}, {"problem": "<video>", "answer": "1", "videos": ["a.mp4"]}]
    with pytest.raises(DataError, match=r"^t: row 1: the video .*a\.mp4 is a file.*pip install .*av.*lists of frames"):
        load(records, encoder, base_dir=tmp_path)


@dataclass
class FakeClip:
    """A video file as `FakePyAV` shows it: frame k is filled with grey level 20 * k (so the decoded frames show which
    indices were taken). `header` is the (width, height) the stream states; `size` what the frames decode to (a
    header that lies), by default the same."""

    n_frames: int = 10
    fps: float = 5.0
    header: tuple[int, int] = (64, 64)
    size: tuple[int, int] | None = None
    error: Exception | None = None  # raised by av.open (a file that does not decode, a library that will not load)


class FakePyAV(types.ModuleType):
    """Stands in for PyAV (none is installed here), with the calls miles_vl makes: `av.open(path)`, the stream's
    `frames`, `average_rate`, `width`, `height`, `container.decode(video=0)` yielding frames in order, lazily, and
    `frame.to_ndarray(format="rgb24")`. `decoded` records (file name, index) of each frame the decoder yields,
    `converted` of each made RGB."""

    def __init__(self, clips: dict[str, FakeClip]):
        super().__init__("av")
        self.clips, self.decoded, self.converted = clips, [], []

    def open(self, path: str):
        name = Path(path).name
        clip = self.clips[name]
        if clip.error is not None:
            raise clip.error
        width, height = clip.size or clip.header
        stream = types.SimpleNamespace(
            frames=clip.n_frames, average_rate=Fraction(clip.fps), width=clip.header[0], height=clip.header[1]
        )

        def to_ndarray(k, format):
            assert format == "rgb24"
            self.converted.append((name, k))
            return np.full((height, width, 3), 20 * k % 256, dtype=np.uint8)

        def decode(video):
            assert video == 0
            for k in range(clip.n_frames):
                self.decoded.append((name, k))
                yield types.SimpleNamespace(width=width, height=height, to_ndarray=functools.partial(to_ndarray, k))

        return types.SimpleNamespace(streams=types.SimpleNamespace(video=[stream]), decode=decode, close=lambda: None)


def fake_pyav(monkeypatch, broken=False, **clips: FakeClip) -> FakePyAV:
    """Install `FakePyAV` with `clips` by file name as the video decoder (`broken`: `import av` raises
    ModuleNotFoundError)."""
    av = FakePyAV(clips)
    monkeypatch.setattr(videos_module, "video_backend", lambda: "pyav")
    monkeypatch.setitem(sys.modules, "av", None if broken else av)
    return av


def test_a_video_file_is_sampled_by_the_processors_rule(tmp_path, encoder, processor, monkeypatch):
    """A stand-in decoder: 10 frames at 5 fps."""
    av = fake_pyav(monkeypatch, **{"a.mp4": FakeClip()})
    (tmp_path / "a.mp4").write_bytes(b"\x00")
    rows, report = load([{"problem": "<video>", "answer": "1", "videos": ["a.mp4"]}], encoder, base_dir=tmp_path)
    assert report.n_kept == 1
    video = rows[0].videos[0]
    # Qwen3-VL: int(10 frames / 5 fps * 2 fps) = 4 frames, linspace(0, 9, 4) rounded
    assert video.indices == (0, 3, 6, 9) and video.fps == 5.0 and video.total_frames == 10
    sample = encoder.encode(rows[0])
    # load time, then encode time with the same indices; the decoder runs through the frames up to the last one taken
    assert av.converted == [("a.mp4", k) for k in (0, 3, 6, 9)] * 2 and len(av.decoded) == 20
    assert sample.video_grid_thw.tolist() == [[2, 4, 4]] and sample.prompt_len == rows[0].prompt_len
    frames_back = videos_module.load_frames(video)
    assert [f.getpixel((0, 0))[0] for f in frames_back] == [0, 60, 120, 180]


def test_video_settings_reach_the_processor_and_the_run_metadata():
    cfg = DataConfig(
        synthetic_n=1,
        video_fps=1.5,
        video_min_frames=3,
        video_max_frames=16,
        video_min_pixels=2048,
        video_max_pixels=65536,
    )
    processor = load_processor("offline", 32 * 32, 64 * 64, video_settings(cfg))
    meta = processor_metadata(processor)
    assert {k: v for k, v in meta.items() if k.startswith("video_")} == {
        "video_fps": 1.5,
        "video_min_frames": 3,
        "video_max_frames": 16,
        "video_min_pixels": 2048,
        "video_max_pixels": 65536,
    }
    vp = processor.video_processor
    assert (vp.fps, vp.min_frames, vp.max_frames, vp.size.shortest_edge) == (1.5, 3, 16, 2048)
    with pytest.raises(ValueError, match="video_min_frames"):
        DataConfig(synthetic_n=1, video_min_frames=9, video_max_frames=8)
    with pytest.raises(ValueError, match="data.video_fps"):
        load_processor("offline", 32 * 32, 64 * 64, VideoSettings(fps=0))


@pytest.mark.parametrize("fps", [0.7, 1.1])
def test_a_frame_list_without_fps_keeps_every_frame_at_any_sampling_rate(fps):
    """Pins a bug: frame lists without their own fps went through the processor's fps rule at the sampling rate,
    `int(total / fps * fps)` frames, which float rounding makes one short (3 frames at 0.7 fps gave 2; 29 at 1.1
    gave 28). Every frame is kept (up to max_frames), and load-time counts still equal the processor's."""
    settings = VideoSettings(fps=fps, min_frames=2, max_frames=64, min_pixels=32 * 32, max_pixels=64 * 32 * 32)
    processor = load_processor("offline", 32 * 32, 64 * 64, settings)
    encoder = PromptEncoder(processor, instruction="Answer.")
    counts = (3, 6, 12, 24, 29, 41, 48)
    records = [{"problem": "<video>x", "answer": "1", "videos": [frames(n, size=(32, 32))]} for n in counts]
    rows, report = load(records, encoder, max_prompt_len=4096)
    assert report.n_kept == len(counts), report.summary()
    assert [r.videos[0].indices for r in rows] == [tuple(range(n)) for n in counts]
    for row in rows:
        sample = encoder.encode(row)
        assert sample.prompt_len == row.prompt_len and sample.video_grid_thw[0, 0] == -(
            -len(row.videos[0].indices) // 2
        )
    # Longer than max_frames: thinned evenly, as the processor's linspace does.
    thin = VideoSettings(fps=fps, min_frames=2, max_frames=4, min_pixels=32 * 32, max_pixels=64 * 32 * 32)
    rows, _ = load(records[:2], PromptEncoder(load_processor("offline", 32 * 32, 64 * 64, thin)))
    assert [r.videos[0].indices for r in rows] == [(0, 1, 2), (0, 2, 3, 5)]  # linspace(0, 5, 4) = 0, 1.67, 3.33, 5


def test_a_broken_decoder_install_is_an_error_that_names_it(tmp_path, encoder, monkeypatch):
    """Pins a bug: a decoder that is found but does not load (an ImportError, a shared library missing) was counted
    as corrupt_video for every file row, and the load went on without saying what to install."""
    (tmp_path / "a.mp4").write_bytes(b"\x00")
    records = [{"problem": "<video>", "answer": "1", "videos": ["a.mp4"]}]
    fake_pyav(monkeypatch, broken=True, **{"a.mp4": FakeClip()})
    with pytest.raises(
        DataError, match=r"decoder pyav is installed but does not load \(ModuleNotFoundError: .*av.*pip install"
    ):
        load(records, encoder, base_dir=tmp_path)

    # a part that loads on first use
    fake_pyav(monkeypatch, **{"a.mp4": FakeClip(error=ImportError("libavformat.so.61: cannot open shared object"))})
    with pytest.raises(DataError, match=r"pyav .*ImportError: libavformat\.so\.61.*--force-reinstall av"):
        load(records, encoder, base_dir=tmp_path)


def test_a_file_that_does_not_decode_drops_only_its_row(tmp_path, encoder, monkeypatch):
    """A decoder that raises on one file (its own error type) drops that row as corrupt_video; the others load."""
    bad = FakeClip(error=OSError("[Errno 1094995529] Invalid data found when processing input"))
    fake_pyav(monkeypatch, **{"good.mp4": FakeClip(), "bad.mp4": bad})
    for name in ("good.mp4", "bad.mp4"):
        (tmp_path / name).write_bytes(b"\x00")
    records = [{"problem": "<video>", "answer": "1", "videos": [name]} for name in ("good.mp4", "bad.mp4")]
    rows, report = load(records, encoder, base_dir=tmp_path)
    assert [r.index for r in rows] == [0] and report.dropped == {DropReason.CORRUPT_VIDEO: 1}
    assert "bad.mp4 (pyav): [Errno 1094995529] Invalid data" in report.examples[0].detail


def test_a_parquet_column_mixing_frame_and_file_videos(tmp_path, encoder, monkeypatch):
    """Pins a bug: pyarrow fills every struct field, so in a file whose videos are both `{frames, fps}` and
    `{path}` structs a file video reads {"frames": None, "fps": None, "path": ...}; it was taken as a frame video with
    no frames and dropped as corrupt_video."""
    fake_pyav(monkeypatch, **{"a.mp4": FakeClip()})
    (tmp_path / "a.mp4").write_bytes(b"\x00")
    video = pa.struct([("frames", pa.list_(pa.binary())), ("fps", pa.float64()), ("path", pa.string())])
    schema = pa.schema([("problem", pa.string()), ("answer", pa.string()), ("videos", pa.list_(video))])
    records = [
        {"problem": "<video>x", "answer": "1", "videos": [{"frames": frames(4), "fps": 2.0}]},
        {"problem": "<video>y", "answer": "2", "videos": [{"path": "a.mp4"}]},
    ]
    path = tmp_path / "mixed.parquet"
    pq.write_table(pa.Table.from_pylist(records, schema=schema), path)
    assert pq.read_table(path).to_pylist()[1]["videos"] == [{"frames": None, "fps": None, "path": "a.mp4"}]
    rows, report = load_prompt_file(path, encoder, LoadOptions(max_prompt_len=512))
    assert report.n_kept == 2, report.summary()
    assert [(v.path, v.indices) for r in rows for v in r.videos] == [
        (None, (0, 1, 2, 3)),
        (tmp_path / "a.mp4", (0, 3, 6, 9)),
    ]
    for row in rows:
        assert encoder.encode(row).prompt_len == row.prompt_len


def test_a_scalar_videos_column_is_metadata_and_a_literal_video_says_how_to_fix_it(encoder):
    """Pins a bug: an unrelated scalar column named `videos` was read as one video file, dropping image-only rows as
    placeholder_mismatch. Only a list is video entries; a scalar is metadata. A literal `<video>` in a row without
    videos still drops (it always marks a video), with a message that says how to fix it."""
    records = [
        {"problem": "<image>Count.", "answer": "1", "images": [png_bytes(64, 64)], "videos": 3},
        {"problem": "Say hi.", "answer": "hi", "videos": "none"},
        {"problem": "Is <video> an HTML tag?", "answer": "yes"},
    ]
    rows, report = load(records, encoder)
    assert [(r.index, r.videos, r.metadata) for r in rows] == [(0, (), {"videos": 3}), (1, (), {"videos": "none"})]
    assert report.dropped == {DropReason.PLACEHOLDER_MISMATCH: 1}
    detail = report.examples[0].detail
    assert detail.startswith("1 <video> placeholders but 0 videos; the row has no videos, and <video> always marks")
    assert "list in the videos column (data.video_key)" in detail and "reword the prompt" in detail


def test_two_videos_and_an_image_with_a_video_keep_placeholder_order(encoder, processor):
    """Two videos in one prompt, and a video before an image: `pixel_values_videos` / `video_grid_thw` hold the videos
    in placeholder order (each block equals that video encoded alone), `pixel_values` the image, the id blocks sit in
    placeholder order, and the load-time counts equal the processor's."""
    import torch

    first, second = frames(4), {"frames": frames(6, size=(64, 32)), "fps": 4.0}  # grids (2, 4, 4) and (2, 2, 4)
    image = png_bytes(64, 64)
    records = [
        {"problem": "<video>then<video>", "answer": "1", "videos": [first, second]},
        {"problem": "<video> and <image>", "answer": "1", "videos": [second], "images": [image]},
        {"problem": "<video>", "answer": "1", "videos": [first]},
        {"problem": "<video>", "answer": "1", "videos": [second]},
        {"problem": "<image>", "answer": "1", "images": [image]},
    ]
    rows, report = load(records, encoder)
    assert report.n_kept == 5, report.summary()
    two, mixed, alone_1, alone_2, image_alone = (encoder.encode(r) for r in rows)  # raises if a count differs
    assert [s.prompt_len for s in (two, mixed)] == [rows[0].prompt_len, rows[1].prompt_len]
    assert two.video_grid_thw.tolist() == [[2, 4, 4], [2, 2, 4]] and two.image_grid_thw is None
    assert torch.equal(two.pixel_values_videos, torch.cat([alone_1.pixel_values_videos, alone_2.pixel_values_videos]))
    assert mixed.video_grid_thw.tolist() == [[2, 2, 4]] and mixed.image_grid_thw.tolist() == [[1, 4, 4]]
    assert torch.equal(mixed.pixel_values_videos, alone_2.pixel_values_videos)
    assert torch.equal(mixed.pixel_values, image_alone.pixel_values)
    ids = mixed.prompt_ids.tolist()
    assert ids.index(processor.video_token_id) < ids.index(processor.image_token_id)
    # Two videos: 2 groups of 4 pads, then (6 frames at 4 fps -> 3 sampled, padded to 4) 2 groups of 2 pads, each
    # group after its own timestamp.
    text = processor.tokenizer.decode(two.prompt_ids)
    assert text.count("<|video_pad|>") == 2 * 4 + 2 * 2 and text.count("seconds>") == 4


# ---------------------------------------------------------------------------------------------------------------------
# the decoded-size budget (issue 30.12)


def test_the_issues_video_is_dropped_under_the_default_budget_before_a_frame_is_decoded(monkeypatch):
    """Issue 30.12: 800 frames of 1024x1024 were decoded all at once (3.1 GB). With Qwen3-VL's own max_frames (768),
    the sampled frames would take 768 * 1024 * 1024 * 3 = 2,304 MiB decoded, over the default data.max_video_bytes
    (1 GiB): dropped and counted from the frames' headers, no frame decoded (PIL's `load` never runs)."""
    settings = VideoSettings(fps=2.0, min_frames=2, max_frames=768, min_pixels=32 * 32, max_pixels=768 * 32 * 32)
    encoder = PromptEncoder(load_processor("offline", 32 * 32, 64 * 64, settings), instruction="Answer.")
    big = png_bytes(1024, 1024)
    loaded = []
    monkeypatch.setattr(Image.Image, "load", lambda self: loaded.append(self.size))
    default = DataConfig(synthetic_n=1).max_video_bytes
    assert default == 1 << 30
    rows, report = load(
        [{"problem": "<video>", "answer": "1", "videos": [[big] * 800]}], encoder, max_video_bytes=default
    )
    assert rows == [] and report.dropped == {DropReason.VIDEO_TOO_LARGE: 1} and "video_too_large=1" in report.summary()
    assert report.examples[0].detail == (
        "768 sampled frames of 1024x1024: 2,304.0 MiB decoded (RGB), above data.max_video_bytes=1073741824 "
        "(1,024.0 MiB); sample fewer frames (data.video_max_frames, data.video_fps), use a smaller video, or raise the "
        "limit"
    )
    assert loaded == []


def test_a_frame_list_at_the_budget_loads_and_one_byte_less_drops_it(encoder):
    """8 frames of 64x64 take 8 * 64 * 64 * 3 = 98,304 bytes decoded: kept at that bound, dropped below it."""
    record = {"problem": "<video>", "answer": "1", "videos": [frames(8)]}
    rows, report = load([record], encoder, max_video_bytes=98_304)
    assert report.n_kept == 1 and rows[0].videos[0].decoded_bytes == 98_304
    rows, report = load([record], encoder, max_video_bytes=98_303)
    assert rows == [] and report.dropped == {DropReason.VIDEO_TOO_LARGE: 1}
    assert report.examples[0].detail.startswith("8 sampled frames of 64x64: 0.1 MiB decoded (RGB), above")


def test_a_video_file_over_the_budget_is_dropped_from_its_header_without_decoding(tmp_path, encoder, monkeypatch):
    """The container's header says 800 frames of 1024x1024 at 25 fps; 8 are sampled (the test processor's
    max_frames), 24 MiB decoded, over a 16 MiB budget: dropped before the decoder yields a frame. A small file in the
    same load passes."""
    av = fake_pyav(
        monkeypatch,
        **{"big.mp4": FakeClip(n_frames=800, fps=25.0, header=(1024, 1024)), "small.mp4": FakeClip()},
    )
    for name in ("big.mp4", "small.mp4"):
        (tmp_path / name).write_bytes(b"\x00")
    records = [{"problem": "<video>", "answer": "1", "videos": [name]} for name in ("big.mp4", "small.mp4")]
    rows, report = load(records, encoder, base_dir=tmp_path, max_video_bytes=16 << 20)
    assert [r.index for r in rows] == [1] and report.dropped == {DropReason.VIDEO_TOO_LARGE: 1}
    assert report.examples[0].detail.startswith(
        f"video {tmp_path / 'big.mp4'}: 8 sampled frames of 1024x1024: 24.0 MiB decoded (RGB), above "
        "data.max_video_bytes=16777216 (16.0 MiB)"
    )
    assert [k for name, k in av.decoded if name == "big.mp4"] == []


def test_a_header_that_understates_the_frames_stops_the_decode(tmp_path, encoder, monkeypatch):
    """The header says 64x64 (4 sampled frames: 48 KiB), the frames decode to 1024x1024 (3 MiB each). With a 7 MiB
    budget the third sampled frame (index 6) passes it: the decoder stops there, having yielded frames 0..6 and made
    RGB of the first two only, and the row is dropped, naming the frame and both sizes."""
    av = fake_pyav(monkeypatch, **{"lie.mp4": FakeClip(header=(64, 64), size=(1024, 1024))})
    (tmp_path / "lie.mp4").write_bytes(b"\x00")
    rows, report = load(
        [{"problem": "<video>", "answer": "1", "videos": ["lie.mp4"]}],
        encoder,
        base_dir=tmp_path,
        max_video_bytes=7 << 20,
    )
    assert rows == [] and report.dropped == {DropReason.VIDEO_TOO_LARGE: 1}
    assert report.examples[0].detail.startswith(
        f"video {tmp_path / 'lie.mp4'}: decoding stopped at sampled frame 3 of 4, of 1024x1024 where the header says "
        "64x64: the frames so far: 9.0 MiB decoded (RGB), above data.max_video_bytes=7340032 (7.0 MiB)"
    )
    assert [k for _, k in av.decoded] == list(range(7)) and [k for _, k in av.converted] == [0, 3]


def test_at_encode_time_a_video_may_not_grow_past_what_was_probed(tmp_path, encoder, monkeypatch):
    """A file replaced between load and encode by one whose frames are larger: the encode refuses it at the first
    frame, instead of decoding it all."""
    av = fake_pyav(monkeypatch, **{"a.mp4": FakeClip()})
    (tmp_path / "a.mp4").write_bytes(b"\x00")
    rows, _ = load([{"problem": "<video>", "answer": "1", "videos": ["a.mp4"]}], encoder, base_dir=tmp_path)
    av.clips["a.mp4"] = FakeClip(header=(64, 64), size=(256, 256))
    with pytest.raises(VideoError, match="decoding stopped at sampled frame 1 of 4, of 256x256") as info:
        encoder.encode(rows[0])
    assert info.value.reason == DropReason.VIDEO_TOO_LARGE


def test_the_budget_of_the_data_section_reaches_every_load(encoder, processor):
    """`data.max_video_bytes` from the config, through `build_datasets`: rows in memory, and the synthetic videos."""
    records = [
        {"problem": "<video>", "answer": "1", "videos": [frames(8)]},  # 98,304 bytes
        {"problem": "<video>", "answer": "2", "videos": [frames(2)]},  # 24,576 bytes
    ]
    cfg = DataConfig(in_memory=True, format="generic", max_video_bytes=50_000, instruction="Answer.")
    splits = build_datasets(cfg, processor, seed=0, records=records)
    assert splits.reports[0].dropped == {DropReason.VIDEO_TOO_LARGE: 1} and len(splits.train) == 1
    motion = DataConfig(synthetic_n=2, synthetic_task="motion", max_video_bytes=1)
    with pytest.raises(DataError, match="no usable training rows: .*video_too_large=2"):
        build_datasets(motion, processor, seed=0)


def fake_frame_decoder(monkeypatch, backend: str, clip: FakeClip) -> list[int]:
    """Install a stand-in torchcodec or decord (neither is installed here) with the calls miles_vl makes: torchcodec's
    `VideoDecoder(path, ...)`, its `metadata` and `get_frame_at(i).data` ([3, H, W]); decord's `VideoReader(path,
    ctx=cpu(0))`, `len`, `get_avg_fps()` and `reader[i]` ([H, W, 3], `asnumpy()`), which states no frame size before
    decoding. Returns the list of the indices it decodes."""
    import torch

    decoded: list[int] = []
    width, height = clip.size or clip.header

    def frame(i: int) -> np.ndarray:
        decoded.append(i)
        return np.full((height, width, 3), 20 * i % 256, dtype=np.uint8)

    monkeypatch.setattr(videos_module, "video_backend", lambda: backend)
    if backend == "torchcodec":
        meta = types.SimpleNamespace(
            num_frames=clip.n_frames, average_fps=clip.fps, width=clip.header[0], height=clip.header[1]
        )
        decoder = types.SimpleNamespace(
            metadata=meta,
            get_frame_at=lambda i: types.SimpleNamespace(data=torch.from_numpy(frame(i)).permute(2, 0, 1)),
        )
        decoders = types.ModuleType("torchcodec.decoders")
        decoders.VideoDecoder = lambda path, seek_mode, num_ffmpeg_threads: decoder
        monkeypatch.setitem(sys.modules, "torchcodec", types.ModuleType("torchcodec"))
        monkeypatch.setitem(sys.modules, "torchcodec.decoders", decoders)
    else:

        class Reader:
            def __init__(self, path, ctx):
                assert ctx == "cpu0"

            def __len__(self):
                return clip.n_frames

            def get_avg_fps(self):
                return clip.fps

            def __getitem__(self, i):
                data = frame(i)
                return types.SimpleNamespace(shape=data.shape, asnumpy=lambda: data)

        decord = types.ModuleType("decord")
        decord.VideoReader, decord.cpu = Reader, lambda k: f"cpu{k}"
        monkeypatch.setitem(sys.modules, "decord", decord)
    return decoded


@pytest.mark.parametrize("backend", ["torchcodec", "decord"])
def test_the_other_decoders_sample_and_keep_the_budget(tmp_path, encoder, monkeypatch, backend):
    """torchcodec and decord decode each sampled frame by index. 4 sampled frames of 1024x1024 take 12 MiB decoded:
    over an 8 MiB budget, torchcodec's header refuses them before any frame is decoded; decord states no size, so its
    first frame stands for the header."""
    (tmp_path / "a.mp4").write_bytes(b"\x00")
    record = {"problem": "<video>", "answer": "1", "videos": ["a.mp4"]}
    decoded = fake_frame_decoder(monkeypatch, backend, FakeClip())
    rows, report = load([record], encoder, base_dir=tmp_path, max_video_bytes=8 << 20)
    assert report.n_kept == 1 and rows[0].videos[0].indices == (0, 3, 6, 9) and decoded == [0, 3, 6, 9]
    assert [f.getpixel((0, 0))[0] for f in videos_module.load_frames(rows[0].videos[0])] == [0, 60, 120, 180]
    decoded = fake_frame_decoder(monkeypatch, backend, FakeClip(header=(1024, 1024)))
    rows, report = load([record], encoder, base_dir=tmp_path, max_video_bytes=8 << 20)
    assert rows == [] and report.dropped == {DropReason.VIDEO_TOO_LARGE: 1}
    first = " (its first)" if backend == "decord" else ""
    assert f"4 sampled frames of 1024x1024{first}: 12.0 MiB decoded (RGB)" in report.examples[0].detail
    assert decoded == ([0] if backend == "decord" else [])
