"""megatron-bridge's Qwen3-VL vision tower under full recompute: the deepstack features lose their gradients.

What upstream does (megatron-bridge 0.6.2, `modelling_qwen3_vl/transformer_block.py`): under
`recompute_granularity="full"` the vision tower's block (`Qwen3VLVisionTransformerBlock._checkpointed_forward`) runs
each chunk of layers through megatron-core's `tensor_parallel.checkpoint` (a reentrant `CheckpointFunction`, or
Transformer Engine's `te_checkpoint` in fp8) with a function that returns `(hidden_states, [deepstack features],
context)`. `CheckpointFunction.forward` runs the function under `torch.no_grad()` and only its tensor outputs join
the graph: the list inside the tuple comes back as plain tensors without a `grad_fn`, and its backward drops
non-tensor outputs. So the deepstack features (3 of the tower's 24 layers in the 2B, merged and added into the
language model's first layers) carry no gradient: the three deepstack mergers never learn, and the tower's layers
below them miss that part of their gradient. The loss and the logprobs are right (the values are the same); only
the gradient is not. The language model's block (`Qwen3VLTransformerBlock`) passes its deepstack inputs as separate
tensors and is right. Seen on a GPU: the 2B job's step-1 gradient norm was 1.391 with the tower fully recomputed
and 1.446 without (`docs/gpu-runs/2026-11-28-lv-2b-28160-full-4xh200`, `-28160-lang-4xh200`); with this patch
1.44575 and 1.44570 (2026-11-29, `docs/gpu-runs/2026-11-29-dg-2b-28160-full-x1-h200`, `-28160-lang-x1-h200`). Its
tests: the CPU one runs megatron's own `CheckpointFunction`, the GPU one (passed on one H200, 2026-11-29)
Transformer Engine's layers, CUDA's RNG and megatron's DDP.

Detection: the release's `transformer_block` module (beside the model module) has
`Qwen3VLVisionTransformerBlock._checkpointed_forward` and the module-level `tensor_parallel` and `te_checkpoint` it
calls. There is no cheaper capability test than running a tower, so the patch is applied to every release that has them;
where a release returns flat outputs, flattening them again changes nothing.

What replaces it: in that module only, `tensor_parallel` is a view of megatron-core's package whose `checkpoint` (and
the module's `te_checkpoint`) flattens the checkpointed function's outputs to a tuple of tensors (torch's pytree; None
leaves such as `context` stay as they are) and rebuilds the nesting after: each deepstack feature is then an output of
the `CheckpointFunction`, with its gradient. The language model's block returns flat outputs already and is unchanged.
Upstream fix to propose: return the deepstack features as separate outputs of the checkpointed function, as the language
model's block takes them as separate inputs.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from torch.utils import _pytree as pytree

from miles_vl.patches.core import Patch, PatchTargetMissing, bridge_version, require


def with_flat_outputs(checkpoint: Callable[..., Any]) -> Callable[..., Any]:
    """`checkpoint(function, *args)` (megatron-core's or Transformer Engine's) with `function`'s outputs flattened to a
    tuple (torch's pytree) inside the checkpoint and nested again outside, so that every tensor in them is an output
    of the autograd function and gets its gradient. The flattened function keeps `function`'s name and qualname."""

    @functools.wraps(checkpoint)
    def run(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        spec: list[pytree.TreeSpec] = []

        @functools.wraps(function)
        def flat(*inputs: Any) -> tuple:
            leaves, tree = pytree.tree_flatten(function(*inputs))
            spec[:] = [tree]  # the same in the forward and in the backward's recompute
            return tuple(leaves)

        out = checkpoint(flat, *args, **kwargs)
        return pytree.tree_unflatten(list(out if isinstance(out, tuple) else (out,)), spec[0])

    run.__miles_vl_original__ = checkpoint
    return run


class FlatCheckpointTensorParallel:
    """megatron-core's `tensor_parallel` package as the patched module sees it: every attribute is the package's,
    read at call time, but `checkpoint` flattens its function's outputs (`with_flat_outputs`)."""

    def __init__(self, package: ModuleType) -> None:
        self.__miles_vl_original__ = package

    def __getattr__(self, name: str) -> Any:  # only for names not set on the instance
        if name == "__miles_vl_original__":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.__miles_vl_original__, name)

    def checkpoint(self, function: Callable[..., Any], *args: Any) -> Any:
        return with_flat_outputs(self.__miles_vl_original__.checkpoint)(function, *args)


def block_module(module: ModuleType) -> ModuleType:
    """The `transformer_block` module beside the model module `module` (the one its classes were built from).

    Raises:
        PatchTargetMissing: there is none, or it cannot be imported.
    """
    name = module.__name__.rpartition(".")[0] + ".transformer_block"
    if (block := sys.modules.get(name)) is not None:
        return block
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise PatchTargetMissing(
            f"megatron-bridge {bridge_version()}: cannot import {name} ({e}); the patch "
            "vision_recompute_deepstack_grads needs the vision tower's block module (supported: 0.5.x and >= 0.6.0)"
        ) from e


def _detect(module: ModuleType) -> str:
    block = block_module(module)
    require(block, "Qwen3VLVisionTransformerBlock._checkpointed_forward", "tensor_parallel.checkpoint", "te_checkpoint")
    return "needed"  # te_checkpoint may be None (no Transformer Engine): fp8 then cannot run, patched or not


def _apply(module: ModuleType) -> None:
    block = block_module(module)
    if isinstance(block.tensor_parallel, FlatCheckpointTensorParallel):  # another model-module object applied it
        return
    block.tensor_parallel = FlatCheckpointTensorParallel(block.tensor_parallel)
    if block.te_checkpoint is not None:
        block.te_checkpoint = with_flat_outputs(block.te_checkpoint)


PATCHES = [
    Patch(
        name="vision_recompute_deepstack_grads",
        summary="full recompute of the vision tower returns the deepstack features from the checkpointed function "
        "in a list, which megatron's CheckpointFunction leaves without gradients (the deepstack mergers never "
        "learn): flatten the checkpointed function's outputs so that each feature is an output with its gradient",
        detect=_detect,
        apply=_apply,
    ),
]
