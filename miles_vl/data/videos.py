"""Videos from the values datasets hold: a list of frames (any image value), or a local video file.

    source = video_source([png0, png1, png2, png3], base_dir)          # 4 frames: all are kept
    source = video_source({"frames": [...], "fps": 8}, base_dir)       # frames recorded at 8 frames per second
    source = video_source("clips/a.mp4", base_dir)                     # a file: needs a decoder (PyAV, ...)
    video = probe_video(source, processor)      # load time: frames sampled, decoded once, counted -> VideoRef
    frames = load_frames(video)                 # encode time: the sampled frames again, RGB

A dataset row's video column holds one entry per `<video>` placeholder; each entry is a frame list, a
`{"frames": [...], "fps": x}` or `{"path": ...}` struct, or a path string (so a single video of frames is written
`[[frame, frame, ...]]`). Frames are sampled the way Qwen3-VL's video processor samples them
(`Qwen3VLVideoProcessor.sample_frames`: `fps` frames per second of the source, clamped to [min_frames, max_frames]
and to the frames there are), with the settings `load_processor` fixed on the processor (data.video_*), so that
the load-time token count, the encoded prompt and the run's recorded settings all come from one place. A frame
list without its own `fps` keeps every frame (evenly thinned to max_frames when longer: `every_frame_indices`), its
timestamps as if recorded at the sampling rate.

Frame lists need nothing beyond PIL. Video files are decoded frame by frame with the first decoder installed of
`VIDEO_BACKENDS` (called as transformers' `load_video` calls them); with none, or one that does not load, loading a row
with a file is a `DataError` that says what to install (only a file that fails to decode drops its row, as
corrupt_video).

The sampled frames of a video take frames x width x height x 3 bytes decoded (8-bit RGB, `video_bytes`); above
`max_video_bytes` (data.max_video_bytes) the video is dropped as video_too_large, never truncated: first from the
frames' headers or the container's, before anything is decoded, then frame by frame while decoding, because a
container's header can understate its frames (a stream that changes resolution, a crafted file). At encode time a
video may take no more than it did when it was probed.
Every per-row failure is a `VideoError` carrying the `DropReason` the loader counts the row under.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from miles_vl.data.images import REMOTE_PREFIXES, ImageError, find_local_file, image_ref, image_size, open_image
from miles_vl.data.layouts import DataError
from miles_vl.data.records import DropReason, ImageRef, VideoRef, video_bytes

# transformers' `load_video` backends, in the order tried, with the module each needs and its pip name.
VIDEO_BACKENDS = (("torchcodec", "torchcodec", "torchcodec"), ("pyav", "av", "av"), ("decord", "decord", "decord"))


class VideoError(ValueError):
    """A video value that cannot be used; `reason` is the drop reason its row is counted under."""

    def __init__(self, reason: DropReason, detail: str):
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True)
class VideoSettings:
    """How videos are sampled and sized: the Qwen3-VL video processor's `fps`, `min_frames`, `max_frames` and
    `size` (shortest_edge / longest_edge: the pixel range of all sampled frames together, t * h * w). None keeps the
    processor's own value (the checkpoint's, or the offline processor's); the defaults live there, not here."""

    fps: float | None = None
    min_frames: int | None = None
    max_frames: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None


@dataclass(frozen=True)
class VideoSource:
    """One video value as found in a row: frame refs, or a local file (not yet decoded)."""

    frames: tuple[ImageRef, ...] = ()
    path: Path | None = None
    fps: float | None = None  # frames per second of the frame list; None: the sampling rate (files: their own)


def video_source(value: Any, base_dir: Path | None = None) -> VideoSource:
    """One video value of a row -> its frame refs or file path (frames are resolved, nothing is decoded).

    Args:
        value: a list/tuple of frames (each any value `images.image_ref` takes); `{"frames": [...], "fps": x}`;
            `{"path" | "video" | "url": str}`; a string: a local video file path or `file://` URL.
        base_dir: folder relative paths are looked up in first (the dataset file's folder); then the working dir.

    Raises:
        VideoError: MISSING_VIDEO for a file or frame that does not exist, REMOTE_IMAGE for a remote URL, CORRUPT_VIDEO
            for no frames, a bad fps, or a value of another type.
    """
    if isinstance(value, dict):
        # `is not None`: pyarrow fills every struct field, so a file video from a parquet column that also holds frame
        # videos reads {"frames": None, "fps": None, "path": "a.mp4"}.
        if value.get("frames") is not None:
            fps = value.get("fps")
            if fps is not None and not (isinstance(fps, int | float) and fps > 0):
                raise VideoError(DropReason.CORRUPT_VIDEO, f"video fps must be a positive number, found {fps!r}")
            source = video_source(list(value["frames"] or []), base_dir)
            return VideoSource(frames=source.frames, fps=None if fps is None else float(fps))
        for key in ("path", "video", "url"):
            if value.get(key):
                return video_source(str(value[key]), base_dir)
        raise VideoError(DropReason.CORRUPT_VIDEO, f"video struct with no frames and no path: keys {sorted(value)}")
    if isinstance(value, list | tuple):
        if not value:
            raise VideoError(
                DropReason.CORRUPT_VIDEO, "a video with zero frames; give at least one frame, or drop the <video>"
            )
        try:
            return VideoSource(frames=tuple(image_ref(frame, base_dir) for frame in value))
        except ImageError as err:
            raise VideoError(_frame_reason(err.reason), f"video frame: {err}") from err
    if isinstance(value, str):
        return VideoSource(path=_video_path(value, base_dir))
    raise VideoError(
        DropReason.CORRUPT_VIDEO,
        f"unsupported video value of type {type(value).__name__}; give a list of frames or a video file path",
    )


def probe_video(
    source: VideoSource, processor: Any, max_image_pixels: int | None = None, max_video_bytes: int | None = None
) -> VideoRef:
    """Sample the video's frames with the processor's settings and decode them once (load time).

    Args:
        source: from `video_source`.
        processor: a Qwen3-VL processor whose video processor holds the sampling settings (`load_processor`).
        max_image_pixels: frames of a frame list with more pixels are refused before decoding.
        max_video_bytes: a video whose sampled frames take more bytes decoded (`video_bytes`) is refused, before
            decoding from the headers, and while decoding; None: no bound.

    Returns:
        The `VideoRef`: the sampled frames (or the file), the source fps and frame count, the sampled indices, the size.

    Raises:
        VideoError: CORRUPT_VIDEO for frames that do not decode, differ in size, or are smaller than the processor
            takes; VIDEO_TOO_LARGE above `max_video_bytes`; MISSING_VIDEO, IMAGE_TOO_LARGE from a frame.
        DataError: a video file and no decoder installed, or one that does not load (names what to install).
    """
    vp = processor.video_processor
    if source.path is not None:
        frames, fps, total, indices = decode_video_file(source.path, vp, max_bytes=max_video_bytes)
        sizes = sorted({f.size for f in frames})
        del frames  # only their size is kept; encode time decodes them again
    else:
        total = len(source.frames)
        if source.fps is None:  # recorded at the sampling rate: every frame, up to max_frames
            fps, indices = float(vp.fps), every_frame_indices(total, int(vp.max_frames))
        else:
            fps, indices = source.fps, sample_indices(vp, total, source.fps)
        refs = [source.frames[i] for i in indices]
        try:
            headers = [image_size(ref, max_image_pixels) for ref in refs]
            n_bytes = sum(video_bytes(1, w, h) for w, h in headers)
            if max_video_bytes is not None and n_bytes > max_video_bytes:
                raise _too_large(f"{len(refs)} sampled frames of {_sizes_text(headers)}", n_bytes, max_video_bytes)
            for ref in refs:  # decoded one at a time (truncated data fails here), then let go
                open_image(ref, max_image_pixels)
        except ImageError as err:
            raise VideoError(_frame_reason(err.reason), f"video frame: {err}") from err
        sizes = sorted(set(headers))
    if not indices:
        raise VideoError(DropReason.CORRUPT_VIDEO, "the video decoded to zero frames")
    if len(sizes) > 1:
        raise VideoError(
            DropReason.CORRUPT_VIDEO, f"the frames of one video differ in size {sizes[:3]}; resize them to one size"
        )
    width, height = sizes[0]
    try:
        video_grid(vp, len(indices), width, height)
    except ValueError as err:  # smaller than patch * merge, or an aspect ratio above 200
        raise VideoError(
            DropReason.CORRUPT_VIDEO, f"the processor cannot take {width}x{height} video frames: {err}"
        ) from err
    return VideoRef(
        frames=tuple(source.frames[i] for i in indices) if source.path is None else (),
        path=source.path,
        fps=float(fps),
        total_frames=int(total),
        indices=tuple(int(i) for i in indices),
        size=(width, height),
    )


def load_frames(video: VideoRef) -> list[Image.Image]:
    """The sampled frames of a probed video, decoded again (encode time), RGB; each no larger than when probed.

    Raises:
        VideoError: a file or frame that no longer decodes, or whose frames have grown since (VIDEO_TOO_LARGE).
    """
    if video.path is not None:
        return decode_video_file(video.path, None, list(video.indices), max_bytes=video.decoded_bytes)[0]
    width, height = video.size
    try:
        return [open_image(ref, max_pixels=width * height) for ref in video.frames]
    except ImageError as err:
        raise VideoError(_frame_reason(err.reason), f"video frame: {err}") from err


def sample_indices(video_processor: Any, total_frames: int, fps: float) -> list[int]:
    """Indices of the frames Qwen3-VL's video processor samples from `total_frames` frames recorded at `fps`."""
    from transformers.video_utils import VideoMetadata

    meta = VideoMetadata(total_num_frames=total_frames, fps=fps)
    return [int(i) for i in video_processor.sample_frames(meta, fps=float(video_processor.fps))]


def every_frame_indices(total_frames: int, max_frames: int) -> list[int]:
    """Every frame of a frame list given without its fps, evenly thinned to `max_frames` when longer: the
    processor's `linspace(0, total - 1, n).round()`. Not `sample_indices` at the sampling rate, whose
    `int(total / fps * fps)` loses a frame to float rounding for some fps (3 frames at 0.7 fps give 2)."""
    return [int(i) for i in np.linspace(0, total_frames - 1, min(total_frames, max_frames)).round()]


def video_grid(video_processor: Any, n_frames: int, width: int, height: int) -> tuple[int, int, int]:
    """(t, h, w) in patches of `n_frames` frames of this size, as the processor resizes them (its `smart_resize`).

    Raises:
        ValueError: frames smaller than patch * merge, or an aspect ratio above 200.
    """
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    vp = video_processor
    h, w = smart_resize(
        num_frames=n_frames,
        height=height,
        width=width,
        temporal_factor=vp.temporal_patch_size,
        factor=vp.patch_size * vp.merge_size,
        min_pixels=vp.size.shortest_edge,
        max_pixels=vp.size.longest_edge,
    )
    return math.ceil(n_frames / vp.temporal_patch_size), h // vp.patch_size, w // vp.patch_size


def video_backend() -> str | None:
    """The first of `VIDEO_BACKENDS` whose module is installed (found, not yet imported), or None."""
    return next((name for name, module, _ in VIDEO_BACKENDS if importlib.util.find_spec(module)), None)


def import_backend(backend: str) -> None:
    """Import a video decoder's module, so that a broken install (an ImportError, a shared library that does not
    load) is an error about the install, not a corrupt_video drop of every file row.

    Raises:
        DataError: the module does not import (names the backend, the error and what to reinstall).
    """
    module = next(m for name, m, _ in VIDEO_BACKENDS if name == backend)
    try:
        importlib.import_module(module)
    except Exception as err:  # ImportError, OSError (a missing libav*.so), RuntimeError (torchcodec's FFmpeg check)
        raise DataError(_broken_backend(backend, err)) from err


def decode_video_file(
    path: Path, video_processor: Any, indices: Sequence[int] | None = None, max_bytes: int | None = None
) -> tuple[list[Image.Image], float, int, list[int]]:
    """Decode the sampled frames of a video file, one at a time, within `max_bytes`.

    Args:
        path: an existing local file.
        video_processor: samples the frames (`sample_indices`) when `indices` is None.
        indices: the frames to decode (encode time: those chosen at load time).
        max_bytes: the most the sampled frames may take decoded (`video_bytes`): checked from the container's
            frame size before decoding (decord states none: from the first frame), then frame by frame, so that a
            header that understates the frames stops the decode at the frame that passes the bound. None: no bound.

    Returns:
        (RGB frames, source fps, source frame count, the indices decoded).

    Raises:
        DataError: no decoder installed, or the installed one does not load (names what to install).
        VideoError: CORRUPT_VIDEO when the file does not decode, has no frames, or ends before a sampled frame;
            VIDEO_TOO_LARGE above `max_bytes`.
    """
    backend = video_backend()
    if backend is None:
        names = " or ".join(pip for _, _, pip in VIDEO_BACKENDS)
        raise DataError(
            f"the video {path} is a file, and reading video files needs a decoder, none of which is installed: "
            f"pip install {names} (PyAV: `pip install av`); videos given as lists of frames need none"
        )
    import_backend(backend)
    try:
        video = _OPENERS[backend](path)
        try:
            total, fps = video.total, video.fps
            if total < 1 or fps <= 0:
                raise VideoError(DropReason.CORRUPT_VIDEO, f"video {path}: {total} frames at {fps} fps")
            chosen = [int(i) for i in indices] if indices is not None else sample_indices(video_processor, total, fps)
            decoded = _decode_within(path, video, chosen, max_bytes)
        finally:
            video.close()
    except VideoError:
        raise
    except ImportError as err:  # a part of the decoder that loads on first use: the install, not this file
        raise DataError(_broken_backend(backend, err)) from err
    except Exception as err:  # decoders raise their own types for broken files
        raise VideoError(DropReason.CORRUPT_VIDEO, f"cannot decode video {path} ({backend}): {err}") from err
    missing = [i for i in chosen if i not in decoded]
    if missing:
        raise VideoError(
            DropReason.CORRUPT_VIDEO,
            f"video {path}: the file ends before sampled frame {missing[0]} (its header says {total} frames)",
        )
    return [decoded[i] for i in chosen], fps, total, chosen


@dataclass(frozen=True)
class _OpenVideo:
    """A video file opened by one decoder: what its header says, and its frames decoded one at a time."""

    total: int  # frames, as the header counts them
    fps: float
    size: tuple[int, int] | None  # (width, height) from the header; None: the decoder states none before decoding
    # frames(indices) yields (index, width, height, to_rgb) per sampled frame in the file's order; to_rgb() makes the
    # [H, W, 3] uint8 array, and is called only once the frame has fit the budget
    frames: Callable[[Sequence[int]], Iterator[tuple[int, int, int, Callable[[], Any]]]]
    close: Callable[[], None]


def _decode_within(
    path: Path, video: _OpenVideo, chosen: Sequence[int], max_bytes: int | None
) -> dict[int, Image.Image]:
    """The chosen frames as RGB images by index, refused (VIDEO_TOO_LARGE) as soon as they would take more than
    `max_bytes`: from the header's frame size before any is decoded (without one, from the first frame's), then
    counted frame by frame, before each is converted to RGB."""
    n = len(chosen)
    if max_bytes is not None and video.size is not None and video_bytes(n, *video.size) > max_bytes:
        raise _too_large(
            f"video {path}: {n} sampled frames of {_sizes_text([video.size])}", video_bytes(n, *video.size), max_bytes
        )
    decoded: dict[int, Image.Image] = {}
    stated, used = video.size, 0
    for index, width, height, to_rgb in video.frames(chosen):
        if stated is None:  # decord: the first frame stands for the header
            stated = (width, height)
            if max_bytes is not None and video_bytes(n, width, height) > max_bytes:
                raise _too_large(
                    f"video {path}: {n} sampled frames of {width}x{height} (its first)",
                    video_bytes(n, width, height),
                    max_bytes,
                )
        used += video_bytes(1, width, height)
        if max_bytes is not None and used > max_bytes:
            raise _too_large(
                f"video {path}: decoding stopped at sampled frame {len(decoded) + 1} of {n}, of {width}x{height} where "
                f"{'the header says' if video.size else 'the first was'} {_sizes_text([stated])}: the frames so far",
                used,
                max_bytes,
            )
        decoded[index] = Image.fromarray(np.asarray(to_rgb(), dtype=np.uint8)).convert("RGB")
    return decoded


def _open_pyav(path: Path) -> _OpenVideo:
    """PyAV: the stream's header, then every frame decoded in order up to the last sampled one (as transformers'
    `read_video_pyav` does); the frames not sampled are let go as they come."""
    import av

    container = av.open(str(path))
    try:
        stream = container.streams.video[0]
        total, rate, size = int(stream.frames), stream.average_rate, (int(stream.width), int(stream.height))
    except BaseException:
        container.close()
        raise

    def frames(indices: Sequence[int]) -> Iterator[tuple[int, int, int, Callable[[], Any]]]:
        wanted, last = set(indices), max(indices)
        for i, frame in enumerate(container.decode(video=0)):
            if i > last:
                break
            if i in wanted:
                yield i, int(frame.width), int(frame.height), functools.partial(frame.to_ndarray, format="rgb24")

    return _OpenVideo(total, float(rate) if rate else 0.0, size if all(size) else None, frames, container.close)


def _open_torchcodec(path: Path) -> _OpenVideo:
    """torchcodec: the stream's metadata, then each sampled frame by index (`get_frame_at`, [3, H, W] uint8)."""
    from torchcodec.decoders import VideoDecoder

    decoder = VideoDecoder(str(path), seek_mode="exact", num_ffmpeg_threads=0)  # as transformers opens it
    meta = decoder.metadata
    size = (int(meta.width or 0), int(meta.height or 0))

    def frames(indices: Sequence[int]) -> Iterator[tuple[int, int, int, Callable[[], Any]]]:
        for i in indices:
            data = decoder.get_frame_at(int(i)).data  # [3, H, W]
            yield int(i), int(data.shape[-1]), int(data.shape[-2]), lambda data=data: data.permute(1, 2, 0).numpy()

    return _OpenVideo(
        int(meta.num_frames or 0), float(meta.average_fps or 0.0), size if all(size) else None, frames, lambda: None
    )


def _open_decord(path: Path) -> _OpenVideo:
    """decord: frame count and rate, no frame size before decoding; each sampled frame by index ([H, W, 3])."""
    from decord import VideoReader, cpu

    reader = VideoReader(str(path), ctx=cpu(0))

    def frames(indices: Sequence[int]) -> Iterator[tuple[int, int, int, Callable[[], Any]]]:
        for i in indices:
            data = reader[int(i)]
            yield int(i), int(data.shape[1]), int(data.shape[0]), data.asnumpy

    return _OpenVideo(len(reader), float(reader.get_avg_fps()), None, frames, lambda: None)


_OPENERS: dict[str, Callable[[Path], _OpenVideo]] = {
    "torchcodec": _open_torchcodec,
    "pyav": _open_pyav,
    "decord": _open_decord,
}


def _too_large(what: str, n_bytes: int, max_bytes: int) -> VideoError:
    return VideoError(
        DropReason.VIDEO_TOO_LARGE,
        f"{what}: {_mib(n_bytes)} decoded (RGB), above data.max_video_bytes={max_bytes} ({_mib(max_bytes)}); sample "
        "fewer frames (data.video_max_frames, data.video_fps), use a smaller video, or raise the limit",
    )


def _mib(n_bytes: int) -> str:
    return f"{n_bytes / 2**20:,.1f} MiB"


def _sizes_text(sizes: Sequence[tuple[int, int]]) -> str:
    distinct = sorted(set(sizes))
    return ", ".join(f"{w}x{h}" for w, h in distinct[:3]) + (" ..." if len(distinct) > 3 else "")


def _broken_backend(backend: str, err: BaseException) -> str:
    pip = next(p for name, _, p in VIDEO_BACKENDS if name == backend)
    others = ", ".join(name for name, _, _ in VIDEO_BACKENDS if name != backend)
    return (
        f"the video decoder {backend} is installed but does not load ({type(err).__name__}: {err}); reinstall it "
        f"(pip install --force-reinstall {pip}, with the system libraries it needs, e.g. FFmpeg), or uninstall it to "
        f"use another of {others}; videos given as lists of frames need none"
    )


def _video_path(text: str, base_dir: Path | None) -> Path:
    text = text.strip()
    if text.lower().startswith(REMOTE_PREFIXES):
        raise VideoError(
            DropReason.REMOTE_IMAGE,
            f"remote video URL {text[:120]!r}: miles_vl does not download; point the dataset at local files or frames",
        )
    found, name, tried = find_local_file(text, base_dir)
    if found is None:
        raise VideoError(DropReason.MISSING_VIDEO, f"video file not found: {name!r} (looked at {tried})")
    return found


def _frame_reason(reason: DropReason) -> DropReason:
    """A frame's image drop reason as the video's: missing and corrupt frames make a missing or corrupt video."""
    return {DropReason.MISSING_IMAGE: DropReason.MISSING_VIDEO, DropReason.CORRUPT_IMAGE: DropReason.CORRUPT_VIDEO}.get(
        reason, reason
    )
