"""Weights for the rollout engines: megatron-bridge's HF export, minus frozen tensors, as a stream of (name, tensor).

    named = export_hf_weights(bridge, model, skip_prefixes=("vision_model.",))   # (HF name, full tensor) pairs
    for bucket in iter_buckets(named, 512 << 20):   # miles_vl.rollout.sglang: the driver's weight sync buckets
        engine.update_weights(bucket)

`bridge.export_hf_weights` gathers TP shards and broadcasts PP stages, so every rank yields every full tensor with
its HF name (vision tower included), converting fused layouts back (QKV, gate/up). With a frozen vision tower the
engines already hold those weights: the conversion tasks of megatron parameters under `skip_prefixes` are dropped
before any gathering, so they cost nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from torch import Tensor


def export_hf_weights(
    bridge, model: list, *, skip_prefixes: Sequence[str] = (), cpu: bool = True
) -> Iterator[tuple[str, Tensor]]:
    """(HF name, tensor) of every exported weight; collective: every rank of the model must iterate it fully.

    Args:
        bridge: the `megatron.bridge.AutoBridge` the model was built from.
        model: the model chunks (DDP-wrapped or not).
        skip_prefixes: megatron parameter names (unwrapped, global, e.g. "vision_model.") not to export.
        cpu: move each tensor to the CPU.
    """
    tasks = [t for t in bridge.get_conversion_tasks(model) if t is not None]
    if skip_prefixes:
        tasks = [t for t in tasks if not t.global_param_name.startswith(tuple(skip_prefixes))]
    # HFWeightTuple is a NamedTuple (param_name, weight): it unpacks as the (name, tensor) pair
    yield from bridge.export_hf_weights(model, cpu=cpu, show_progress=False, conversion_tasks=tasks)
