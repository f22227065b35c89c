"""Prompt building: `problem` text with `<image>` / `<video>` placeholders -> chat messages -> canonical prompt ids.

    encoder = PromptEncoder(processor, system_prompt=None, instruction="... put the final answer in \\boxed{}.")
    encoder.messages("<image>Find x.")
    # [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find x. ... \\boxed{}."}]}]
    n = encoder.count_tokens("<image>Find x.", [(224, 224)])   # exact canonical length, without pixel work
    sample = encoder.encode(row)                                # PromptSample: prompt_ids, pixel_values, grids

The text is rendered by the processor's own chat template (`apply_chat_template`, generation prompt added) and
encoded by the processor itself (`processor(text=..., images=...)`), so `prompt_ids` are exactly the ids of a real
run: each image becomes `<|vision_start|>` + t*h*w/merge^2 `<|image_pad|>` + `<|vision_end|>`; each video
becomes, inside the template's `<|vision_start|>` ... `<|vision_end|>`, one `<{time:.1f} seconds><|vision_start|>`
h*w/merge^2 `<|video_pad|>` `<|vision_end|>` per group of `temporal_patch_size` frames (Qwen3-VL's
`replace_video_token`; the frames are the ones sampled at load time, passed with their metadata and
`do_sample_frames=False`). Of the processor's outputs only `input_ids` (as `prompt_ids`), `pixel_values`,
`image_grid_thw`, `pixel_values_videos` and `video_grid_thw` are kept.

`count_tokens` predicts that length at load time from the image sizes and the sampled videos alone (the image
processor's own `get_number_of_image_patches`, the video processor's `smart_resize` and the processor's own
timestamp text), so over-long prompts are dropped before any pixel is processed; `encode` checks the prediction
against the processor's output.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image

from miles_vl.data.images import open_image
from miles_vl.data.records import PromptRow, PromptSample, VideoRef
from miles_vl.data.videos import load_frames, video_grid

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
_PLACEHOLDERS = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})")


def build_messages(
    problem: str, *, system_prompt: str | None = None, instruction: str | None = None
) -> list[dict[str, Any]]:
    """Chat messages for one problem: `<image>` / `<video>` placeholders become typed image / video parts, in order.

    Args:
        problem: the prompt text; each `<image>` marks where one image goes, each `<video>` one video.
        system_prompt: a system message, or None for none.
        instruction: appended after the problem text (trailing whitespace of the problem trimmed, one space between),
            e.g. "put the final answer in \\boxed{}"; None or "" for none.

    Returns:
        `[{"role": "system", ...}?, {"role": "user", "content": [{"type": "image"} | {"type": "video"} |
        {"type": "text", "text": ...}]}]`.
    """
    parts: list[dict[str, Any]] = []
    for segment in _PLACEHOLDERS.split(problem):
        if segment == IMAGE_PLACEHOLDER:
            parts.append({"type": "image"})
        elif segment == VIDEO_PLACEHOLDER:
            parts.append({"type": "video"})
        elif segment:
            parts.append({"type": "text", "text": segment})
    if instruction:
        if parts and parts[-1]["type"] == "text" and parts[-1]["text"].strip():
            parts[-1] = {"type": "text", "text": parts[-1]["text"].rstrip() + " " + instruction}
        else:
            parts.append({"type": "text", "text": instruction})
    messages: list[dict[str, Any]] = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": parts})
    return messages


class PromptEncoder:
    """Renders and encodes prompts with one processor and one set of prompt settings."""

    def __init__(
        self,
        processor: Any,
        *,
        system_prompt: str | None = None,
        instruction: str | None = None,
        blank_images: bool = False,
    ):
        """
        Args:
            processor: a Qwen-VL processor (e.g. from `load_processor`), with its pixel range already fixed.
            system_prompt: system message for every prompt, or None.
            instruction: text appended to every problem, or None.
            blank_images: replace each image and each video frame by a white RGB image of the same size (same grid,
                frame count and token count, no content): the control that shows whether a model uses the pixels.
        """
        self.processor = processor
        self.system_prompt = system_prompt
        self.instruction = instruction
        self.blank_images = blank_images
        self.image_token_id = int(processor.image_token_id)
        self.video_token_id = int(processor.video_token_id)
        self.merge_size = int(processor.image_processor.merge_size)

    def messages(self, problem: str) -> list[dict[str, Any]]:
        return build_messages(problem, system_prompt=self.system_prompt, instruction=self.instruction)

    def render(self, problem: str) -> str:
        """The chat-templated prompt text (generation prompt included), one `<|image_pad|>` per image."""
        return self.processor.apply_chat_template(self.messages(problem), tokenize=False, add_generation_prompt=True)

    def image_tokens(self, width: int, height: int) -> int:
        """`<|image_pad|>` tokens for one image of this size: t*h*w/merge^2 of its resized patch grid."""
        patches = self.processor.image_processor.get_number_of_image_patches(height, width, {})
        return int(patches) // self.merge_size**2

    def video_tokens(self, video: VideoRef) -> int:
        """Tokens that replace one video's `<|video_pad|>`: per frame group, its timestamp text, `<|vision_start|>`,
        h*w/merge^2 `<|video_pad|>` and `<|vision_end|>` (the processor's own `replace_video_token`)."""
        from transformers.video_utils import VideoMetadata

        vp = self.processor.video_processor
        t, h, w = video_grid(vp, len(video.indices), *video.size)
        per_group = h * w // vp.merge_size**2
        # The replacement with one pad per group (grid [t, merge, merge]): its text sits between special tokens, so it
        # tokenizes the same alone; each group then holds per_group pads instead of one.
        meta = VideoMetadata(**video.metadata)
        text = self.processor.replace_video_token(
            {"video_grid_thw": torch.tensor([[t, vp.merge_size, vp.merge_size]]), "video_metadata": [meta]}, 0
        )
        return len(self.processor.tokenizer(text, add_special_tokens=False)["input_ids"]) + t * (per_group - 1)

    def count_tokens(
        self, problem: str, image_sizes: Sequence[tuple[int, int]], videos: Sequence[VideoRef] = ()
    ) -> int:
        """Exact length of the canonical prompt ids, computed from the image sizes and sampled videos without
        processing pixels.

        Args:
            problem: the prompt text with one `<image>` per entry of `image_sizes` and one `<video>` per video.
            image_sizes: (width, height) of each image, in placeholder order.
            videos: the probed videos (`videos.probe_video`), in placeholder order.

        Returns:
            The number of ids `encode` will produce.

        Raises:
            ValueError: the rendered text does not hold one image (video) token per image (video): a chat template
                that drops or repeats media parts.
        """
        ids = self.processor.tokenizer(self.render(problem))["input_ids"]
        for what, token_id, n in (
            ("image", self.image_token_id, len(image_sizes)),
            ("video", self.video_token_id, len(videos)),
        ):
            found = sum(1 for i in ids if i == token_id)
            if found != n:
                raise ValueError(
                    f"the chat template rendered {found} {what} tokens for {n} {what}s; use a processor whose "
                    f"template renders one `<|vision_start|><|{what}_pad|><|vision_end|>` per {what}"
                )
        # Each single `<|image_pad|>` / `<|video_pad|>` expands to its tokens; the text around it tokenizes the same.
        return (
            len(ids)
            + sum(self.image_tokens(w, h) - 1 for w, h in image_sizes)
            + sum(self.video_tokens(v) - 1 for v in videos)
        )

    def encode(self, row: PromptRow) -> PromptSample:
        """Run one loaded row through the processor.

        Args:
            row: a row from the loader (its `prompt_len` was computed with this encoder's settings).

        Returns:
            The `PromptSample` with the processor's `input_ids` as `prompt_ids` ([L], int64), `pixel_values`
            ([n_patches, C*T*P*P]) and `image_grid_thw` ([n_images, 3]), None without images, and likewise
            `pixel_values_videos` and `video_grid_thw` ([n_videos, 3]), None without videos.

        Raises:
            ImageError: an image that decoded at load time no longer does (a file removed since).
            VideoError: likewise for a video.
            ValueError: the processor produced a different length than predicted at load time (its pixel range or
                template changed after loading: build the dataset with the processor you encode with).
        """
        images = [open_image(ref) for ref in row.images]
        if self.blank_images:
            images = [Image.new("RGB", im.size, "white") for im in images]
        text = self.render(row.problem)
        video_kwargs: dict[str, Any] = {}
        if row.videos:  # the frames sampled at load time, with the metadata that fixes their timestamps
            videos = [load_frames(v) for v in row.videos]
            if self.blank_images:
                videos = [[Image.new("RGB", f.size, "white") for f in frames] for frames in videos]
            video_kwargs = dict(
                videos=videos,
                video_metadata=[v.metadata for v in row.videos],
                do_sample_frames=False,
            )
        # mm_token_type_ids are dropped anyway (engines derive them from the ids): do not compute them.
        out = self.processor(
            text=[text], images=images or None, return_tensors="pt", return_mm_token_type_ids=False, **video_kwargs
        )
        prompt_ids = out["input_ids"][0].to(torch.long)
        if prompt_ids.numel() != row.prompt_len:
            raise ValueError(
                f"row {row.index}: the processor produced {prompt_ids.numel()} prompt ids, the load-time count was "
                f"{row.prompt_len}; the processor's pixel range or template changed after loading: build the "
                "dataset with the processor you encode with"
            )
        grid = out.get("image_grid_thw")
        grid_v = out.get("video_grid_thw")
        return PromptSample(
            index=row.index,
            prompt_ids=prompt_ids,
            pixel_values=out.get("pixel_values") if images else None,
            image_grid_thw=grid.to(torch.long) if images and grid is not None else None,
            label=row.label,
            images=images,
            prompt_text=text,
            metadata=dict(row.metadata),
            pixel_values_videos=out.get("pixel_values_videos") if row.videos else None,
            video_grid_thw=grid_v.to(torch.long) if row.videos and grid_v is not None else None,
        )
