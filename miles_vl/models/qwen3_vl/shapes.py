"""The shape of a Qwen3-VL checkpoint without its weights: parameter counts and the widths that size activations and
the KV cache (what `miles-vl check`'s memory estimate reads).

The shape comes from `model.path`'s config.json where that is a folder on this machine, else from the released
checkpoints' architecture (`released_shapes.json`, beside this module), matched by the path's last component (a
cluster's config checked on a laptop). Parameters are counted by building the transformers model on the meta device
(no memory, no weights), so that the count is transformers' own, tied embeddings once, MoE experts included.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# released_shapes.json: the architecture fields of the released checkpoints' config.json (Qwen/Qwen3-VL-*-Instruct;
# the -Thinking ones have the same shapes), as config.json writes them. Only what sizes the model: ids, rope and init
# are left at transformers' defaults. A checkpoint released later is one more entry there.
RELEASED_SHAPES: dict[str, dict] = json.loads((Path(__file__).parent / "released_shapes.json").read_text())


@dataclass(frozen=True)
class ModelShape:
    """What sizes a Qwen3-VL model's memory. Counts are parameters (tied embeddings once); widths are per token."""

    params: int  # every parameter
    vision_params: int  # the vision tower with its merger and deepstack mergers (`model.visual.`)
    expert_params: int  # MoE experts (`mlp.experts.`); 0 for a dense model
    layers: int  # decoder layers
    hidden: int  # hidden size h
    q_dim: int  # attention heads * head_dim
    kv_dim: int  # key-value heads * head_dim (one of K, V)
    mlp_dim: int  # intermediate size a token goes through: dense intermediate_size, or MoE top-k * expert size
    kv_heads: int
    head_dim: int
    vocab: int


def released_shape_name(model_path: str) -> str | None:
    """The key of `RELEASED_SHAPES` that `model_path`'s last component names (`/models/Qwen3-VL-8B-Instruct`,
    `Qwen/Qwen3-VL-2B-Thinking`), or None."""
    name = Path(model_path.rstrip("/")).name
    for suffix in ("-Instruct", "-Thinking"):
        name = name.removesuffix(suffix)
    return name if name in RELEASED_SHAPES else None


def hf_config_dict(model_path: str) -> tuple[dict | None, str]:
    """The architecture of `model_path` as a config.json dict and where it came from, or `(None, why not)`."""
    config_json = Path(model_path) / "config.json"
    if config_json.is_file():
        return json.loads(config_json.read_text()), f"{config_json}"
    if name := released_shape_name(model_path):
        return RELEASED_SHAPES[name], f"the released {name}'s config.json shapes ({model_path} is not on this machine)"
    known = ", ".join(RELEASED_SHAPES)
    return None, f"{config_json} is not on this machine and the name is none of the released shapes known ({known})"


def model_shape(config: dict) -> ModelShape:
    """The `ModelShape` of a Qwen3-VL (or Qwen3-VL-MoE) config.json dict.

    Raises:
        ValueError: `model_type` is neither qwen3_vl nor qwen3_vl_moe.
    """
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    model_type = config.get("model_type")
    if model_type not in ("qwen3_vl", "qwen3_vl_moe"):
        raise ValueError(f"model_type must be qwen3_vl or qwen3_vl_moe for a memory estimate, found {model_type!r}")
    hf = AutoConfig.for_model(**config)
    with torch.device("meta"):  # shapes only: no memory, no init cost worth the name
        model = AutoModelForImageTextToText.from_config(hf)
    params = vision = experts = 0
    for name, p in model.named_parameters():  # tied weights appear once
        params += p.numel()
        vision += p.numel() if ".visual." in f".{name}" else 0
        experts += p.numel() if ".mlp.experts." in name else 0
    t = hf.text_config
    moe = model_type == "qwen3_vl_moe"
    return ModelShape(
        params=params,
        vision_params=vision,
        expert_params=experts,
        layers=t.num_hidden_layers,
        hidden=t.hidden_size,
        q_dim=t.num_attention_heads * t.head_dim,
        kv_dim=t.num_key_value_heads * t.head_dim,
        mlp_dim=t.moe_intermediate_size * t.num_experts_per_tok if moe else t.intermediate_size,
        kv_heads=t.num_key_value_heads,
        head_dim=t.head_dim,
        vocab=t.vocab_size,
    )
