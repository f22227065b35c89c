"""SGLang 0.5.17's vision hook: `vision.patch_vision` on 0.5.17's Qwen3-VL vision tower.

0.5.17's graph runner takes the backend the vision attention chose (`ViTCudaGraphRunner._attn_backend` from
`qkv_backend_name`, `srt/multimodal/vit_cuda_graph_runner.py:82`), so 0.5.16's pinning of `--mm-attention-backend` is
not carried here. 0.5.17's server arguments are read-only once resolved: the one the graphs need is changed through
`ServerArgs.override` (its audited mutation point). Its runner still keys graphs by total patch count
(`_get_graph_key`),
so `VisionGraphs` stays.
"""

from __future__ import annotations

from miles_vl.sglang_plugin.adapter import Context, Hook, Target
from miles_vl.sglang_plugin.v0_5_16.vision import PATCHED, SERVER_ARGS_MODULE, VISION_MODULE
from miles_vl.sglang_plugin.v0_5_16.vision import TARGETS as TARGETS_0_5_16
from miles_vl.sglang_plugin.vision import patch_vision

TARGETS = TARGETS_0_5_16 + (Target(SERVER_ARGS_MODULE, "ServerArgs.override", ("self", "source")),)


def set_args(server_args, changes: dict) -> None:
    server_args.override("miles_vl.sglang_plugin (vision graphs)", **changes)


def apply(modules: dict, context: Context) -> None:
    server_args_cls = modules[SERVER_ARGS_MODULE].ServerArgs
    patch_vision(modules[VISION_MODULE], server_args_cls, context, set_args, pin_backend=False)


HOOK = Hook("vision", TARGETS, apply, PATCHED)
