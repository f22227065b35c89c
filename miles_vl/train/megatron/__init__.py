"""The production `megatron` train backend (megatron-bridge Qwen3-VL, TP/PP/CP/EP, pre-sharded THD rows).

    from miles_vl.train.megatron import build_megatron_backend
    backend = build_megatron_backend(hf_path, tokens, options, ParallelOptions(tp_size=2, cp_size=2))  # parallel.py

Modules: `plan` (samples -> DP ranks -> micro-batches), `batch` (packing, the CP shard, model and loss inputs),
`vocab_parallel` (label logprobs / entropy over TP-split logits), `step` (megatron's forward step and loss function,
the gradient-scaling contract), `parallel` (process groups, gathers, metric reduction), `export` (HF weights for
the engines, streamed; the driver buckets them), `checkpoint` (distributed checkpoints), `backend` (the
`TrainBackend`), `build` (AutoBridge, DDP, distributed optimizer: the CUDA-only parts).

Importing `backend` or `build` imports megatron and installs `miles_vl.patches`; `build_megatron_backend` loads
lazily so that `import miles_vl.train.megatron.plan` (pure torch) does not.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_LAZY = {"build_megatron_backend": "miles_vl.train.megatron.build"}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'miles_vl.train.megatron' has no attribute {name!r}")
