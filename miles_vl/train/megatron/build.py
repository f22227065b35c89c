"""Build the megatron backend from a Qwen3-VL HF checkpoint (dense or MoE) on GPUs: the CUDA-only parts.

    torch.distributed.init_process_group("nccl")       # torchrun or the Ray train actor does this
    parallel = ParallelOptions(tp_size=2, cp_size=2)
    backend = build_megatron_backend("/ckpt/Qwen3-VL-2B-Instruct", tokens, options, parallel)

Steps: `AutoBridge.from_hf_pretrained(path)` -> `bridge.to_megatron_provider()` (weights load in a pre-wrap hook)
-> parallel sizes, sequence parallel, recompute, bf16, frozen vision tower -> `miles_vl.patches.configure_provider`
(per-token loss under CP, rope fusion off, vision_dp_when_cp) -> `calculate_per_token_loss=True` for every CP size
(the gradient scaling in step.py relies on it) and, with pp > 1, `variable_seq_lengths=True` (THD rows differ per
micro-batch, which pipeline stages must be told) -> megatron's parallel state -> `provide_distributed_model` (DDP
with fp32 gradient buffers, SUM reduction) -> megatron's distributed optimizer (Adam, fp32 main weights;
`optimizer_config`: its state on the CPU with train.optimizer.cpu_offload).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import logging
from pathlib import Path
from typing import Literal, get_args

import torch
import torch.distributed as dist

from miles_vl.models import SpecialTokens
from miles_vl.models.qwen3_vl import MEGATRON_VISION_PREFIXES
from miles_vl.train.megatron.backend import MegatronTrainBackend
from miles_vl.train.megatron.checkpoint import require_offload_support
from miles_vl.train.megatron.parallel import ParallelGroups, ParallelOptions, recompute_layers_problem
from miles_vl.train.types import OptimizerOptions, TrainOptions

log = logging.getLogger(__name__)

Recompute = Literal["none", "selective", "full", "vision", "language"]
FROZEN_VISION_PREFIXES = MEGATRON_VISION_PREFIXES  # the vision tower, its merger and deepstack mergers


def build_provider(
    hf_path: str | Path,
    *,
    tp_size: int = 1,
    pp_size: int = 1,
    cp_size: int = 1,
    ep_size: int = 1,
    sp: bool = False,
    recompute: Recompute = "none",
    recompute_layers: int | None = None,
    freeze_vision: bool = False,
    vision_dp_when_cp: bool = False,
    bf16: bool = True,
    load_weights: bool = True,
):
    """(AutoBridge, finalized provider) for the checkpoint at `hf_path` with these parallel settings.

    Raises:
        ValueError: inconsistent sizes (sequence parallel without TP, a size < 1, an unknown recompute mode, a
            `recompute_layers` without full recompute or past the decoder layers of a pipeline stage).
    """
    from megatron.bridge import AutoBridge

    from miles_vl.patches import configure_provider

    for name, value in (("tp", tp_size), ("pp", pp_size), ("cp", cp_size), ("ep", ep_size)):
        if value < 1:
            raise ValueError(f"train.{name} must be >= 1, found {value}")
    if sp and tp_size == 1:
        raise ValueError("train.sp (sequence parallel) needs train.tp > 1; set sp=false or raise tp")
    if recompute not in get_args(Recompute):
        raise ValueError(f"train.recompute must be one of {', '.join(get_args(Recompute))}; found {recompute!r}")
    if recompute_layers is not None and recompute not in ("full", "language"):
        raise ValueError(
            f"train.recompute_layers={recompute_layers} needs train.recompute=full or language (found {recompute!r}); "
            "set train.recompute=full (or language) or train.recompute_layers=null"
        )
    if recompute_layers is not None and recompute_layers < 1:
        raise ValueError(f"train.recompute_layers must be >= 1 (or null for every layer), found {recompute_layers}")

    bridge = AutoBridge.from_hf_pretrained(str(hf_path))
    provider = bridge.to_megatron_provider(load_weights=load_weights)
    provider.tensor_model_parallel_size = tp_size
    provider.pipeline_model_parallel_size = pp_size
    provider.expert_model_parallel_size = ep_size
    provider.sequence_parallel = sp
    provider.bf16, provider.fp16 = bf16, False
    provider.params_dtype = torch.bfloat16 if bf16 else torch.float32
    provider.pipeline_dtype = provider.params_dtype
    if recompute == "selective":
        provider.recompute_granularity = "selective"
    elif recompute in ("full", "language") and recompute_layers is None:
        provider.recompute_granularity, provider.recompute_method, provider.recompute_num_layers = "full", "uniform", 1
    elif recompute in ("full", "language"):  # the first recompute_layers of each stage (the tower copies them)
        if problem := recompute_layers_problem(recompute_layers, provider.num_layers, pp_size, str(hf_path)):
            raise ValueError(problem)
        provider.recompute_granularity, provider.recompute_method = "full", "block"
        provider.recompute_num_layers = recompute_layers
    if recompute == "full" and recompute_layers is not None:  # the tower recomputes all of its layers again
        provider.register_pre_wrap_hook(keep_vision_tower_recomputed)
    elif recompute == "language":  # the tower keeps its activations
        provider.register_pre_wrap_hook(no_recompute_in_vision_tower)
    elif recompute == "vision":  # the language model keeps its activations; the vision tower's are recomputed
        provider.register_pre_wrap_hook(recompute_vision_tower)
    # the torch backend's freeze_vision freezes all of `visual`: the tower, its merger and the deepstack mergers.
    # Set all three explicitly: megatron-bridge 0.6.2's MoE provider defaults to freezing the language model AND
    # the vision tower (freeze_language_model=True, freeze_vision_model=True), which would train nothing.
    provider.freeze_language_model = False
    provider.freeze_vision_model = freeze_vision
    provider.freeze_vision_projection = freeze_vision
    configure_provider(provider, cp_size=cp_size, vision_dp_when_cp=vision_dp_when_cp)
    if not provider.calculate_per_token_loss:
        log.info("provider.calculate_per_token_loss: False -> True (the loss carries global denominators)")
        provider.calculate_per_token_loss = True
    if provider.gradient_accumulation_fusion and importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is None:
        # megatron-core's own ColumnParallelLinear (the output layer) needs APEX's extension for it; TE's layers
        # would fuse without it, but the flag is model-wide
        log.info("provider.gradient_accumulation_fusion: True -> False (APEX fused_weight_gradient_mlp_cuda missing)")
        provider.gradient_accumulation_fusion = False
    if pp_size > 1:  # THD rows differ in length per micro-batch: pipeline stages exchange shapes
        provider.variable_seq_lengths = True
        if provider.moe_token_dispatcher_type == "allgather":  # megatron rejects it with variable lengths
            log.info("provider.moe_token_dispatcher_type: allgather -> alltoall (pp > 1, variable lengths)")
            provider.moe_token_dispatcher_type = "alltoall"
    provider.finalize()
    if provider.sequence_parallel != sp:
        # megatron-bridge 0.6.2's MoE provider turns sequence parallelism on whenever tp > 1 (megatron requires it
        # for MoE with TP); the row layout follows the provider (ParallelGroups reads it back in build_megatron_backend)
        log.warning(
            "train.sp=%s but the provider set sequence_parallel=%s (tp=%d); training with sequence_parallel=%s",
            sp,
            provider.sequence_parallel,
            tp_size,
            provider.sequence_parallel,
        )
    return bridge, provider


FULL_RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
NO_RECOMPUTE = {"recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None}


def keep_vision_tower_recomputed(model: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """`train.recompute_layers`: the vision tower, whose config copies the language model's block recompute of its
    first N layers, recomputes every layer again (a pre-wrap hook, as `recompute_vision_tower`); a model without a
    tower is left as it is."""
    _full_recompute_in_towers(model)
    return model


def no_recompute_in_vision_tower(model: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """`train.recompute=language`: the vision tower, whose config copies the language model's full recompute, keeps
    its activations and runs each layer's forward once (a pre-wrap hook, as `recompute_vision_tower`); a model
    without a tower is left as it is. The tower's activations are those of one micro-batch's images (with
    `train.vision_once_per_image`, its distinct ones), which `miles-vl check` does not count."""
    _set_recompute_in_towers(model, NO_RECOMPUTE)
    return model


def _full_recompute_in_towers(model: list[torch.nn.Module]) -> bool:
    """Full recompute, one layer per checkpoint, in the chunks' vision towers (`_set_recompute_in_towers`)."""
    return _set_recompute_in_towers(model, FULL_RECOMPUTE)


def _set_recompute_in_towers(model: list[torch.nn.Module], fields: dict) -> bool:
    """`fields` (megatron's recompute settings) on every config object of the chunks' vision towers; whether any
    chunk has the attribute `vision_model` (a pipeline stage may hold None there).

    A tower module that holds one of the language model's config objects (megatron-bridge 0.6.2 with Transformer
    Engine's layers: the tower's `patch_embed.proj`; the CPU layers do not, and `owed.sh p15`'s first runs stopped on
    it) gets a shallow copy of it first, one per shared object: the same values, so that the fields change the tower
    only.
    """
    towers = [chunk.vision_model for chunk in model if getattr(chunk, "vision_model", None) is not None]
    language = {
        id(m.config)
        for chunk in model
        for m in [chunk, *(chunk.language_model.modules() if getattr(chunk, "language_model", None) else [])]
        if hasattr(m, "config")
    }
    copies: dict[int, object] = {}
    for tower in towers:
        for name, m in tower.named_modules():
            if hasattr(m, "config") and id(m.config) in language:
                if id(m.config) not in copies:
                    log.info("vision tower module %r holds the language model's config: given its own copy", name)
                    copies[id(m.config)] = copy.copy(m.config)
                m.config = copies[id(m.config)]
    configs = {id(m.config): m.config for tower in towers for m in tower.modules() if hasattr(m, "config")}
    for config in configs.values():
        for field, value in fields.items():
            setattr(config, field, value)
    return bool(towers) or any(hasattr(chunk, "vision_model") for chunk in model)


def recompute_vision_tower(model: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """`train.recompute=vision`: full recompute (one layer per checkpoint) in the vision tower only (a pre-wrap hook).

    megatron-bridge builds the tower's own TransformerConfig from the language model's when the model is built
    (`get_vision_model_config` copies its recompute fields), so there is no provider field for the tower alone: the
    tower's config objects are set here, after it is built and before the first forward (its block reads them at
    forward time). The vision tower's activations (every patch of every image, in fp32 attention) are what a long
    multi-image row spends memory on besides the language model's; the language model then runs without recompute.

    Raises:
        ValueError: no chunk has a vision tower (a pipeline stage without it is fine, but some chunk must have it).
    """
    if not _full_recompute_in_towers(model):
        raise ValueError("train.recompute=vision needs a Qwen3-VL model with a vision tower (`vision_model`)")
    return model


def optimizer_config(options: OptimizerOptions, *, bf16: bool):
    """megatron-core's `OptimizerConfig` for `options`: distributed Adam (AdamW), fp32 main weights and moments.

    `options.cpu_offload` = f > 0 turns on megatron's `HybridDeviceOptimizer`: the first f of this rank's optimizer
    shard (by elements) keeps its fp32 main weights and moments on the CPU and steps there (torch's AdamW); its
    gradients are copied to pinned host memory each step and the updated bf16 weights back. megatron-core 0.19.2
    routes it through the precision-aware optimizer's code path (megatron/training/arguments.py asserts
    `--optimizer-cpu-offload` needs `--use-precision-aware-optimizer`), so both are set; that path needs the
    distributed optimizer and Adam (optimizer_config.py's `__post_init__`), which this always is, and the precision
    stays fp32 (main weights, moments, gradients: the dtypes are megatron's defaults). It needs CUDA (CUDA streams,
    pinned memory). Checkpoints keep their layout: the distributed optimizer's sharded state dict reads and writes
    the offloaded state through the HybridDeviceOptimizer; after a load, `checkpoint.sync_offloaded_optimizer` hands
    it to the sub-optimizers (megatron's "dp_reshardable" load leaves that out), and remainders are off (below).

    Raises:
        ValueError: cpu_offload outside [0, 1].
    """
    from megatron.core.optimizer import OptimizerConfig

    o = options
    if not 0.0 <= o.cpu_offload <= 1.0:
        raise ValueError(f"optimizer.cpu_offload must be in [0, 1] (a fraction of the state), found {o.cpu_offload}")
    offload = o.cpu_offload > 0
    return OptimizerConfig(
        optimizer="adam",
        lr=o.lr,
        min_lr=o.lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.betas[0],
        adam_beta2=o.betas[1],
        adam_eps=o.eps,
        clip_grad=o.grad_clip,
        bf16=bf16,
        fp16=False,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=True,
        optimizer_cpu_offload=offload,
        optimizer_offload_fraction=o.cpu_offload,
        use_precision_aware_optimizer=offload,
        # the HybridDeviceOptimizer keeps whole fp32 main weights; with remainders (megatron's default) a load's
        # placeholder for them is int16, which its load hook copies into those weights (checkpoint.py)
        store_param_remainders=not offload,
    )


def build_megatron_backend(
    hf_path: str | Path, tokens: SpecialTokens, options: TrainOptions, parallel: ParallelOptions
) -> MegatronTrainBackend:
    """The megatron train backend on this rank (collective: every rank of the train world calls it).

    `torch.distributed` must be initialized with NCCL and the CUDA device set; the world size must be a multiple of
    tp * pp * cp (the rest is data parallel).

    Raises:
        RuntimeError: torch.distributed is not initialized, or the world does not fit the parallel sizes.
        ValueError: from `build_provider`.
    """
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.utils import get_model_config

    if not dist.is_initialized():
        raise RuntimeError(
            "build_megatron_backend needs torch.distributed: call torch.distributed.init_process_group('nccl') "
            "(torchrun and the Ray train actors do) and torch.cuda.set_device(local_rank) first"
        )
    p, bf16 = parallel, parallel.bf16
    world = dist.get_world_size()
    if world % (p.tp_size * p.pp_size * p.cp_size):
        raise RuntimeError(
            f"world size {world} is not a multiple of tp*pp*cp = {p.tp_size}*{p.pp_size}*{p.cp_size}; "
            "change train.* sizes"
        )

    layout = {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.name != "seed"}  # build_provider's names
    bridge, provider = build_provider(hf_path, **layout, freeze_vision=options.freeze_vision)
    provider.initialize_model_parallel(seed=p.seed)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        use_distributed_optimizer=True,
        average_in_collective=False,  # per-token loss: gradients are SUMMED over DP x CP (step.py)
        check_for_nan_in_grad=False,  # a non-finite step is skipped and counted by the backend
    )
    model = provider.provide_distributed_model(ddp_config=ddp_config, bf16=bf16, fp16=False)
    if options.optimizer.cpu_offload > 0:
        require_offload_support()  # what a resume of it calls, checked before the first step
    optimizer = get_megatron_optimizer(optimizer_config(options.optimizer, bf16=bf16), model)
    config = get_model_config(model[0])
    config.finalize_model_grads_func = finalize_model_grads  # DP x CP reduction, then the 1/num_tokens scaling
    config.grad_scale_func = optimizer.scale_loss  # 1.0 in bf16 (no loss scaling)
    return MegatronTrainBackend(
        model,
        optimizer,
        tokens,
        options,
        groups=ParallelGroups.from_megatron(sequence_parallel=provider.sequence_parallel),
        bridge=bridge,
        frozen_prefixes=FROZEN_VISION_PREFIXES if options.freeze_vision else (),
    )
