"""SGLang 0.5.16's vision hook: `vision.patch_vision` on 0.5.16's Qwen3-VL vision tower. 0.5.16's graph runner reads
`--mm-attention-backend` (`ViTCudaGraphRunner`, `srt/multimodal/vit_cuda_graph_runner.py:154`), not the backend the
vision model chose, so the argument is pinned to what 0.5.16 would choose anyway; its server arguments are plain
attributes, set directly before any scheduler starts.
"""

from __future__ import annotations

from miles_vl.sglang_plugin.adapter import Context, Hook, Target
from miles_vl.sglang_plugin.vision import patch_vision

VISION_MODULE = "sglang.srt.models.qwen3_vl"
SERVER_ARGS_MODULE = "sglang.srt.server_args"
VISION = "Qwen3VLMoeVisionModel"

TARGETS = (
    Target(VISION_MODULE, f"{VISION}.forward", ("self", "x", "grid_thw")),
    Target(VISION_MODULE, f"{VISION}.forward_with_cuda_graph", ("self", "x", "grid_thw")),
    Target(VISION_MODULE, "graph_runners_dict"),
    Target(SERVER_ARGS_MODULE, "ServerArgs.__post_init__", ("self",)),
    Target(SERVER_ARGS_MODULE, "ServerArgs.enable_deterministic_inference"),
    Target(SERVER_ARGS_MODULE, "ServerArgs.tp_size"),
    Target(SERVER_ARGS_MODULE, "ServerArgs.base_gpu_id"),
    Target(SERVER_ARGS_MODULE, "ServerArgs.mm_attention_backend"),
    Target(SERVER_ARGS_MODULE, "ServerArgs.enable_precise_embedding_interpolation"),
)
PATCHED = ((VISION_MODULE, f"{VISION}.forward"),)


def set_args(server_args, changes: dict) -> None:
    for name, value in changes.items():
        setattr(server_args, name, value)


def apply(modules: dict, context: Context) -> None:
    server_args_cls = modules[SERVER_ARGS_MODULE].ServerArgs
    patch_vision(modules[VISION_MODULE], server_args_cls, context, set_args, pin_backend=True)


HOOK = Hook("vision", TARGETS, apply, PATCHED)
