"""Weights for the rollout engines: megatron-bridge's HF export, minus frozen tensors, in buckets of bounded size.

    named = export_hf_weights(bridge, model, skip_prefixes=("vision_model.",))   # (HF name, full tensor) pairs
    for bucket in bucket_by_bytes(named, 512 << 20):                             # lists of pairs, <= 512 MiB each
        engine.update_weights(bucket)

`bridge.export_hf_weights` gathers TP shards and broadcasts PP stages, so every rank yields every full tensor with
its HF name (vision tower included), converting fused layouts back (QKV, gate/up). With a frozen vision tower the
engines already hold those weights: the conversion tasks of megatron parameters under `skip_prefixes` are dropped
before any gathering, so they cost nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

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


def bucket_by_bytes(named: Iterable[tuple[str, Tensor]], max_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    """Consecutive (name, tensor) pairs grouped into lists of at most `max_bytes` (a larger tensor goes alone).

    Raises:
        ValueError: max_bytes < 1.
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, found {max_bytes}")
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
