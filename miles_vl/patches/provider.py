"""Provider settings that Qwen3-VL needs for packed THD under context parallelism.

- `calculate_per_token_loss=True` when CP > 1: megatron-bridge's Qwen3VLModel asserts it, because a loss averaged
  per CP shard is wrong (miles_vl's loss weights carry the global denominators; see miles_vl.algo.loss_weights).
  0.6 providers set it in `finalize()`; 0.5 providers do not, so it is set here for every release.
- `apply_rope_fusion=False`: MRoPE uses per-token absolute frequencies that TE's fused RoPE kernels cannot take.
- `vision_dp_when_cp`: split the vision tower's work across CP ranks (>= 0.6); exposed as `train.vision_dp_when_cp`
  (on by default). megatron-bridge reads it only when CP > 1, so it is asked of the provider only then: a CP=1 job
  runs on a release without it.

Nothing is changed silently: `configure_provider` returns every change and logs it.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def configure_provider(provider: Any, *, cp_size: int, vision_dp_when_cp: bool = False) -> dict[str, tuple[Any, Any]]:
    """Set the CP-related fields of a megatron-bridge Qwen3-VL provider before `finalize()`/`provide()`.

    Args:
        provider: a `Qwen3VLModelProvider` (or MoE provider) from `AutoBridge.to_megatron_provider()`.
        cp_size: context-parallel size.
        vision_dp_when_cp: split vision work across CP ranks when cp_size > 1 (needs megatron-bridge >= 0.6).

    Returns:
        {field: (old, new)} for every field whose value changed.

    Raises:
        ValueError: the provider lacks a field (an unsupported release), or vision_dp_when_cp is asked under CP of a
            release without it.
    """
    wanted: dict[str, Any] = {"context_parallel_size": cp_size, "apply_rope_fusion": False}
    if cp_size > 1:
        wanted["calculate_per_token_loss"] = True
    split_vision = vision_dp_when_cp and cp_size > 1
    if split_vision or hasattr(provider, "vision_dp_when_cp"):
        wanted["vision_dp_when_cp"] = split_vision
    missing = [name for name in wanted if not hasattr(provider, name)]
    if missing:
        raise ValueError(
            f"{type(provider).__name__} has no {missing}: "
            + (
                "train.vision_dp_when_cp (on by default) needs megatron-bridge >= 0.6 under CP; set "
                "train.vision_dp_when_cp=false, or install megatron-bridge 0.6.2"
                if missing == ["vision_dp_when_cp"]
                else "not a megatron-bridge Qwen3-VL provider of a supported release"
            )
        )
    changes = {}
    for name, value in wanted.items():
        old = getattr(provider, name)
        if old != value:
            setattr(provider, name, value)
            changes[name] = (old, value)
            log.info("provider.%s: %r -> %r (Qwen3-VL with packed THD, cp_size=%d)", name, old, value, cp_size)
    return changes
