"""Load the processor (tokenizer + chat template + image processor) and read the token ids the rest of the code needs.

    processor = load_processor("offline", min_pixels=3136, max_pixels=12544)           # built-in, no download
    processor = load_processor("/ckpt/Qwen3-VL-2B-Instruct", 256 * 32 * 32, 1024 * 32 * 32)  # local files only

`min_pixels`/`max_pixels` are fixed on the processor's image processor here, once, so that every consumer (the
data loader, the engines) sees the same image token counts; `processor_metadata` returns them for the run record.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from miles_vl.data.layouts import DataError
from miles_vl.models.qwen3_vl.processor import OFFLINE_PROCESSOR_DIR

if TYPE_CHECKING:
    from transformers import ProcessorMixin

OFFLINE = "offline"


def load_processor(path_or_offline: str, min_pixels: int, max_pixels: int) -> ProcessorMixin:
    """The Qwen3-VL processor of a local checkpoint, or the built-in offline one, with a fixed pixel range.

    Args:
        path_or_offline: "offline" for the built-in small-vocabulary Qwen3-VL processor (see
            `miles_vl.models.qwen3_vl.processor`), or a local directory (or a hub id already in the local cache)
            holding a checkpoint's processor files.
        min_pixels: smallest image area (pixels) after resizing; smaller images are upscaled.
        max_pixels: largest image area (pixels) after resizing; larger images are downscaled.

    Returns:
        A transformers processor (a `Qwen3VLProcessor` for Qwen3-VL and offline) whose image processor resizes
        into [min_pixels, max_pixels].

    Raises:
        ValueError: a pixel range that is empty or not positive.
        DataError: `path_or_offline` is neither "offline" nor loadable from local files, or it loads a processor
            without an image processor.
        ImportError: torchvision is missing (transformers' Qwen3-VL video processor needs it).
    """
    if not 0 < min_pixels <= max_pixels:
        raise ValueError(
            f"need 0 < min_pixels <= max_pixels, found min_pixels={min_pixels}, max_pixels={max_pixels}; "
            "fix data.min_pixels / data.max_pixels"
        )
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
        raise DataError(
            f"cannot load a processor from {path_or_offline!r} with local files only ({err}); point model.processor "
            "(or model.path) at a local checkpoint directory with its processor files, or use 'offline'"
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
    return processor


def processor_metadata(processor: Any) -> dict[str, int | str]:
    """The processor settings a run must record (they decide every image's token count).

    Returns:
        patch_size, temporal_patch_size, merge_size, min_pixels, max_pixels, tokenizer size and processor class.
    """
    ip = processor.image_processor
    return {
        "processor_class": type(processor).__name__,
        "patch_size": int(ip.patch_size),
        "temporal_patch_size": int(ip.temporal_patch_size),
        "merge_size": int(ip.merge_size),
        "min_pixels": int(ip.size.shortest_edge),
        "max_pixels": int(ip.size.longest_edge),
        "tokenizer_size": len(processor.tokenizer),
    }
