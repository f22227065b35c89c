"""The typed records of the data stage: a validated row, an encoded prompt, and the load report.

PromptRow     one dataset row that passed every load-time check (images and videos readable, placeholders match,
              prompt fits); light: images and video frames are kept as encoded bytes or file paths, not pixels.
VideoRef      one video of a row as sampled at load time (frame refs or its file, the sampled indices, the frame
              size), decoded again at encode time by `videos.load_frames`.
PromptSample  a row run through the processor: canonical `prompt_ids` (image and video tokens expanded),
              `pixel_values`, `image_grid_thw`, `pixel_values_videos`, `video_grid_thw`. What rollout engines and the
              trainer consume (`rollout.types.PromptLike`).
LoadReport    how many rows were read, kept, and dropped per `DropReason`, with a few examples each. Every
              dropped row is counted here and logged at load time; none disappears silently.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from PIL import Image
from torch import LongTensor, Tensor

# An image as kept between load and encode: its encoded bytes (PNG, JPEG, ...) or a local file path.
ImageRef = bytes | Path


class DropReason(StrEnum):
    """Why a row was not loaded. Rows are dropped, never repaired: a multimodal prompt is never truncated."""

    PROMPT_TOO_LONG = "prompt_too_long"  # canonical prompt (image tokens expanded) longer than max_prompt_len
    CORRUPT_IMAGE = "corrupt_image"  # bytes that do not decode, no image at all, or a size the processor refuses
    IMAGE_TOO_LARGE = "image_too_large"  # more pixels than data.max_image_pixels (found from the header, not decoded)
    MISSING_IMAGE = "missing_image"  # a path that does not exist
    REMOTE_IMAGE = "remote_image"  # an http(s)/ftp URL: miles_vl never downloads at training time
    PLACEHOLDER_MISMATCH = "placeholder_mismatch"  # number of `<image>` (`<video>`) != number of images (videos)
    MISSING_VIDEO = "missing_video"  # a video file or frame path that does not exist
    CORRUPT_VIDEO = "corrupt_video"  # no frames, frames that do not decode or differ in size, a file that won't decode
    VIDEO_TOO_LARGE = "video_too_large"  # sampled frames above data.max_video_bytes decoded (header, then each frame)
    MISSING_FIELD = "missing_field"  # the prompt or the answer is null/empty in this row
    SKIPPED_BY_DATASET_FN = "skipped_by_dataset_fn"  # the custom `dataset_fn` returned None


@dataclass(frozen=True)
class VideoRef:
    """A video that passed the load-time checks: what to decode again at encode time, and how it was sampled."""

    frames: tuple[ImageRef, ...]  # the sampled frames of a frame list, in order; () for a file
    path: Path | None  # the video file, or None for a frame list
    fps: float  # frames per second of the source (decides the timestamps in the prompt text)
    total_frames: int  # frames in the source
    indices: tuple[int, ...]  # the sampled frames' indices into the source
    size: tuple[int, int]  # (width, height) of every frame

    @property
    def metadata(self) -> dict[str, Any]:
        """The `video_metadata` entry the Qwen3-VL processor takes with pre-sampled frames."""
        return {"fps": self.fps, "total_num_frames": self.total_frames, "frames_indices": list(self.indices)}

    @property
    def decoded_bytes(self) -> int:
        """What the sampled frames take decoded (`video_bytes`): the most `load_frames` lets them take again."""
        return video_bytes(len(self.indices), *self.size)


def video_bytes(n_frames: int, width: int, height: int) -> int:
    """Bytes of `n_frames` frames of width x height decoded as 8-bit RGB (3 a pixel), the measure of
    data.max_video_bytes. (PIL holds an RGB frame in 4 bytes a pixel; decoders hand over 3.)"""
    return n_frames * width * height * 3


@dataclass(frozen=True)
class PromptRow:
    """A dataset row that passed the load-time checks, not yet run through the processor."""

    index: int  # row id: position in the source file (0-based, before any drop), or the synthetic problem id
    problem: str  # prompt text with one `<image>` placeholder per image and one `<video>` per video
    images: tuple[ImageRef, ...]  # in placeholder order
    label: str  # the reference answer
    prompt_len: int  # exact length of the canonical prompt ids (checked again when encoded)
    metadata: dict[str, Any] = field(default_factory=dict)  # the row's other scalar columns
    videos: tuple[VideoRef, ...] = ()  # sampled at load time, in placeholder order


@dataclass
class PromptSample:
    """One canonical prompt: the exact ids every engine must see, and the vision inputs that go with them."""

    index: int  # row id, as in `PromptRow.index`
    prompt_ids: LongTensor  # [L] the processor's input_ids, `<|image_pad|>` expanded to t*h*w/merge^2 per image
    pixel_values: Tensor | None  # [n_patches, C*T*P*P] (3*2*16*16 = 1536 for Qwen3-VL); None without images
    image_grid_thw: LongTensor | None  # [n_images, 3] (t, h, w) in patches; None without images
    label: str  # the reference answer
    images: list[Image.Image]  # the decoded RGB images, in prompt order (engines that take images, e.g. SGLang)
    prompt_text: str  # the chat-templated text before image-token expansion
    metadata: dict[str, Any] = field(default_factory=dict)
    # [n_video_patches, C*T*P*P] and [n_videos, 3] (t = frame groups of temporal_patch_size); None without videos.
    # Each video's block in prompt_ids is t groups of `<t seconds><|vision_start|>` h*w/merge^2 `<|video_pad|>`
    # `<|vision_end|>`, inside the template's own `<|vision_start|>` ... `<|vision_end|>`.
    pixel_values_videos: Tensor | None = None
    video_grid_thw: LongTensor | None = None

    @property
    def prompt_len(self) -> int:
        return int(self.prompt_ids.numel())

    @property
    def n_images(self) -> int:
        return len(self.images)

    @property
    def n_videos(self) -> int:
        return 0 if self.video_grid_thw is None else int(self.video_grid_thw.shape[0])


@dataclass(frozen=True)
class DroppedRow:
    index: int
    reason: DropReason
    detail: str  # what was wrong, e.g. the missing path or "412 tokens > max_prompt_len 256"


@dataclass
class LoadReport:
    """Counts of one load: rows read, kept, and dropped per reason (with the first few examples of each)."""

    source: str  # file path, or "synthetic(n=..., seed=..., task=...)"
    layout: str  # geometry3k | geo3k_imgurl | verl | generic | custom (dataset_fn)
    n_rows: int = 0
    n_kept: int = 0
    dropped: dict[DropReason, int] = field(default_factory=dict)
    examples: list[DroppedRow] = field(default_factory=list)  # up to `max_examples_per_reason` per reason
    max_examples_per_reason: int = 3

    @property
    def n_dropped(self) -> int:
        return sum(self.dropped.values())

    def drop(self, index: int, reason: DropReason, detail: str) -> None:
        """Count one dropped row (and keep it as an example while there are few of its kind)."""
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        if self.dropped[reason] <= self.max_examples_per_reason:
            self.examples.append(DroppedRow(index, reason, detail))

    def summary(self) -> str:
        """One line: `source: kept K of N rows (layout L); dropped D: reason=n, ...`."""
        line = f"{self.source}: kept {self.n_kept} of {self.n_rows} rows (layout {self.layout})"
        if self.dropped:
            parts = ", ".join(f"{r.value}={n}" for r, n in sorted(self.dropped.items()))
            line += f"; dropped {self.n_dropped}: {parts}"
        return line

    def log(self, logger: logging.Logger) -> None:
        """Log the summary (INFO, or WARNING when rows were dropped) and one line per example."""
        logger.log(logging.WARNING if self.dropped else logging.INFO, "%s", self.summary())
        for ex in self.examples:
            logger.warning("  dropped row %d (%s): %s", ex.index, ex.reason.value, ex.detail)
