"""Load the processor (tokenizer + chat template + image processor) and read the token ids the rest of the code needs.

    processor = load_processor("offline", min_pixels=3136, max_pixels=12544)           # built-in, no download
    processor = load_processor("/ckpt/Qwen3-VL-2B-Instruct", 256 * 32 * 32, 1024 * 32 * 32)  # local files only

`min_pixels`/`max_pixels` are fixed on the processor's image processor here, once, and the video settings the user
gave (`VideoSettings`: fps, frame limits, the video pixel range; each None keeps the checkpoint's own value) on its
video processor, so that every consumer (the data loader, the engines) sees the same image and video token counts;
`processor_metadata` returns the resolved values for the run record.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from miles_vl.data.layouts import DataError
from miles_vl.data.videos import VideoSettings
from miles_vl.models.hub import is_hub_id
from miles_vl.models.qwen3_vl.processor import OFFLINE_PROCESSOR_DIR

if TYPE_CHECKING:
    from transformers import ProcessorMixin

OFFLINE = "offline"


def load_processor(
    path_or_offline: str, min_pixels: int, max_pixels: int, video: VideoSettings | None = None
) -> ProcessorMixin:
    """The Qwen3-VL processor of a local checkpoint, or the built-in offline one, with a fixed pixel range.

    Args:
        path_or_offline: "offline" for the built-in small-vocabulary Qwen3-VL processor (see
            `miles_vl.models.qwen3_vl.processor`), or a local directory (or a hub id already in the local cache)
            holding a checkpoint's processor files.
        min_pixels: smallest image area (pixels) after resizing; smaller images are upscaled.
        max_pixels: largest image area (pixels) after resizing; larger images are downscaled.
        video: fps, frame limits and pixel range of the video processor; only the fields that are set replace the
            checkpoint's own (None, or a None field: keep the checkpoint's or the offline processor's value).

    Returns:
        A transformers processor (a `Qwen3VLProcessor` for Qwen3-VL and offline) whose image processor resizes
        into [min_pixels, max_pixels] and whose video processor samples and sizes videos per `video`.

    Raises:
        ValueError: a pixel range that is empty or not positive; video settings out of range (checked on the resolved
            values: a given min_frames above the checkpoint's max_frames is refused too).
        DataError: `path_or_offline` is neither "offline" nor loadable from local files, or it loads a processor
            without an image processor.
        ImportError: torchvision is missing (transformers' Qwen3-VL video processor needs it).
    """
    if not 0 < min_pixels <= max_pixels:
        raise ValueError(
            f"need 0 < min_pixels <= max_pixels, found min_pixels={min_pixels}, max_pixels={max_pixels}; "
            "fix data.min_pixels / data.max_pixels"
        )
    video = video or VideoSettings()
    from transformers import AutoProcessor

    path = str(OFFLINE_PROCESSOR_DIR) if path_or_offline == OFFLINE else path_or_offline
    try:
        processor = AutoProcessor.from_pretrained(
            path, local_files_only=True, min_pixels=min_pixels, max_pixels=max_pixels
        )
    except ImportError as err:  # Qwen3-VL's video processor needs torchvision
        raise ImportError(
            f"loading the processor from {path_or_offline!r} needs a missing package: {err}; install torchvision "
            "(the build that matches your torch, e.g. torchvision==0.26.0 for torch 2.11)"
        ) from err
    except OSError as err:
        fetch = (
            f"fetch the hub id with `hf download {path_or_offline}` (or `miles-vl train`, which does), "
            if is_hub_id(path_or_offline)
            else ""
        )
        raise DataError(
            f"cannot load a processor from {path_or_offline!r} with local files only ({err}); {fetch}point "
            "model.processor (or model.path) at a local checkpoint directory with its processor files, or use 'offline'"
        ) from err
    image_processor = getattr(processor, "image_processor", None)
    if image_processor is None:
        raise DataError(
            f"{path_or_offline!r} loads a {type(processor).__name__} without an image processor; "
            "a vision-language checkpoint (Qwen3-VL) is needed"
        )
    size = image_processor.size
    if (size.shortest_edge, size.longest_edge) != (min_pixels, max_pixels):  # kwargs were not routed: set them
        image_processor.size = type(size)(shortest_edge=min_pixels, longest_edge=max_pixels)
    video_processor = getattr(processor, "video_processor", None)
    if video_processor is not None:
        set_video_settings(video_processor, video, path_or_offline)
    return processor


def set_video_settings(video_processor: Any, video: VideoSettings, source: str = "the processor") -> None:
    """Set the fields of `video` that are not None on a Qwen3-VL video processor; keep its other values.

    Raises:
        ValueError: the resolved settings are out of range (names the data.video_* keys and the values found).
    """
    vp, size = video_processor, video_processor.size
    fps = vp.fps if video.fps is None else video.fps
    min_frames = vp.min_frames if video.min_frames is None else video.min_frames
    max_frames = vp.max_frames if video.max_frames is None else video.max_frames
    min_pixels = size.shortest_edge if video.min_pixels is None else video.min_pixels
    max_pixels = size.longest_edge if video.max_pixels is None else video.max_pixels
    if not (fps > 0 and 1 <= min_frames <= max_frames and 0 < min_pixels <= max_pixels):
        given = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(video).items() if v is not None)
        raise ValueError(
            f"need video fps > 0, 1 <= min_frames <= max_frames and 0 < min_pixels <= max_pixels; with {source}'s own "
            f"values for those not given, found fps={fps}, min_frames={min_frames}, max_frames={max_frames}, "
            f"min_pixels={min_pixels}, max_pixels={max_pixels} (given: {given or 'none'}); fix data.video_fps / "
            "data.video_min_frames / data.video_max_frames / data.video_min_pixels / data.video_max_pixels"
        )
    vp.fps, vp.min_frames, vp.max_frames = fps, min_frames, max_frames
    if (size.shortest_edge, size.longest_edge) != (min_pixels, max_pixels):
        vp.size = type(size)(shortest_edge=min_pixels, longest_edge=max_pixels)


def processor_metadata(processor: Any) -> dict[str, int | float | str]:
    """The processor settings a run must record (they decide every image's and video's token count).

    Returns:
        patch_size, temporal_patch_size, merge_size, min_pixels, max_pixels, tokenizer size and processor class;
        with a video processor also video_fps, video_min_frames, video_max_frames, video_min_pixels and
        video_max_pixels.
    """
    ip = processor.image_processor
    vp = getattr(processor, "video_processor", None)
    video = {}
    if vp is not None:
        video = {
            "video_fps": float(vp.fps),
            "video_min_frames": int(vp.min_frames),
            "video_max_frames": int(vp.max_frames),
            "video_min_pixels": int(vp.size.shortest_edge),
            "video_max_pixels": int(vp.size.longest_edge),
        }
    return {
        "processor_class": type(processor).__name__,
        "patch_size": int(ip.patch_size),
        "temporal_patch_size": int(ip.temporal_patch_size),
        "merge_size": int(ip.merge_size),
        "min_pixels": int(ip.size.shortest_edge),
        "max_pixels": int(ip.size.longest_edge),
        "tokenizer_size": len(processor.tokenizer),
        **video,
    }
