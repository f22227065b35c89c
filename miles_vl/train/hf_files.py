"""Write a Hugging Face model directory: config.json and safetensors weights, sharded with an index when large.

    write_hf_model(directory, model.config, model.state_dict().items(), max_shard_bytes=5 * 10**9)

What `transformers.AutoModel*.from_pretrained(directory)` and SGLang load: `config.json` (its `dtype` set to the
weights' dtype), and either one `model.safetensors` or `model-0000i-of-0000n.safetensors` shards with
`model.safetensors.index.json` (`weight_map`: tensor name -> shard file), the layout `save_pretrained` writes. The
weights arrive as a stream of (HF name, tensor) and are written one shard at a time, so at most one shard is held in
memory. A tensor larger than `max_shard_bytes` gets a shard of its own. The processor files are the caller's (the
train backends know the model, the driver knows the processor).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' save_pretrained default ("5GB")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def write_hf_model(
    directory: str | Path,
    config,
    weights: Iterable[tuple[str, Tensor]],
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[str]:
    """Write `config` and `weights` into `directory` (created if missing) as an HF model directory.

    Args:
        directory: where to write; files of the same names are replaced.
        config: a `transformers.PretrainedConfig` (its `dtype` is set to that of the first floating-point weight).
        weights: (HF name, tensor) pairs, each name once; tensors are moved to the CPU and made contiguous.
        max_shard_bytes: the largest shard file (bytes of tensor data); above it the weights are sharded.

    Returns:
        The weight files written, in order.

    Raises:
        ValueError: `max_shard_bytes` < 1, no weights, or a name given twice.
    """
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, found {max_shard_bytes}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards: list[tuple[Path, list[str]]] = []  # (temporary file, names in it)
    shard: dict[str, Tensor] = {}
    size, total, dtype, seen = 0, 0, None, set()

    def flush() -> None:
        nonlocal shard, size
        if shard:
            path = directory / f".shard-{len(shards):05d}.safetensors"
            save_file(shard, str(path), metadata={"format": "pt"})
            shards.append((path, list(shard)))
            shard, size = {}, 0

    for name, tensor in weights:
        if name in seen:
            raise ValueError(f"weight {name!r} given twice")
        seen.add(name)
        tensor = tensor.detach().to("cpu").contiguous()
        if dtype is None and tensor.is_floating_point():
            dtype = tensor.dtype
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > max_shard_bytes:
            flush()
        shard[name] = tensor
        size += nbytes
        total += nbytes
    flush()
    if not shards:
        raise ValueError("no weights to write")

    files = []
    if len(shards) == 1:
        os.replace(shards[0][0], directory / SINGLE_FILE)
        files.append(SINGLE_FILE)
    else:
        weight_map = {}
        for i, (path, names) in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            os.replace(path, directory / file)
            weight_map.update(dict.fromkeys(names, file))
            files.append(file)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    config.dtype = str(dtype or torch.float32).removeprefix("torch.")
    config.save_pretrained(directory)
    return files
