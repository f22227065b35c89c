"""`build`: a CPU stand-in for `build_megatron_backend` (same signature) that the driver's train ranks call in place of
it (`tests.orchestration.jobs.stand_ins(megatron=True)`).

Everything between the job config and the backend is the production path: the driver's placement, the train actors,
their process group (gloo here), `build_provider` (AutoBridge on the HF checkpoint, the job's parallel sizes,
`configure_provider`), the model megatron-bridge provides with the checkpoint's weights, `MegatronTrainBackend`, its
export to the engines. Stood in, as in the backend's CPU tests (tests/train/megatron/cpu_parts.py): the TE layers
(local specs with TE's parameter names), DDP and finalize, megatron's optimizer (torch AdamW behind its methods), the
schedule, the unwrapping of DDP before the export, and the distributed checkpoint (megatron's needs its distributed
optimizer: `torch.save` of each rank's model and optimizer state instead). The model runs in fp32 with transformers'
exact GELU in the patch mergers, so that its logprobs match the torch backend's on the same checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch


def build(hf_path: str, tokens, options, parallel):
    import torch.distributed as dist

    from tests.patches.harness.shims import load_qwen3vl_module

    tp, cp, o = parallel.tp_size, parallel.cp_size, options.optimizer
    if parallel.pp_size != 1 or parallel.ep_size != 1:
        raise ValueError("the CPU stand-in runs tp/cp layouts only (pp = ep = 1)")
    module = load_qwen3vl_module("0.6.2")  # the TE stub and CPU shims, before megatron-bridge's model imports
    import megatron.bridge.models.qwen_vl.qwen3_vl_provider as provider_module
    from megatron.core import parallel_state as ps

    from miles_vl.train.megatron.backend import MegatronTrainBackend
    from miles_vl.train.megatron.build import FROZEN_VISION_PREFIXES, build_provider
    from miles_vl.train.megatron.export import export_hf_weights
    from tests.train.megatron.cpu_parts import CpuDDP, CpuOptimizer, cpu_schedule
    from tests.train.megatron.jobs import cpu_te_named_gpt_spec, cpu_te_named_vit_spec, exact_gelu_in_patch_mergers

    class CpuBackend(MegatronTrainBackend):
        def hf_weights(self, skip_prefixes=(), *, cpu=True):
            # megatron-bridge unwraps megatron's DDP itself; CpuDDP is not one of the wrappers it knows
            chunks = [c.module for c in self.model]
            return export_hf_weights(self.bridge, chunks, skip_prefixes=skip_prefixes, cpu=cpu)

        def save_checkpoint(self, directory: Path) -> None:
            state = {
                "model": [c.state_dict() for c in self.model],
                "optimizer": self.optimizer.inner.state_dict(),
                "steps": (self.optimizer_steps, self.skipped_steps),
            }
            torch.save(state, Path(directory) / f"megatron_cpu_rank{dist.get_rank()}.pt")

        def load_checkpoint(self, directory: Path) -> None:
            state = torch.load(Path(directory) / f"megatron_cpu_rank{dist.get_rank()}.pt", weights_only=False)
            for chunk, weights in zip(self.model, state["model"], strict=True):
                chunk.load_state_dict(weights)
            self.optimizer.inner.load_state_dict(state["optimizer"])
            self.optimizer_steps, self.skipped_steps = state["steps"]

    provider_module.get_gpt_layer_with_transformer_engine_spec = lambda **kw: cpu_te_named_gpt_spec()
    module.get_vit_layer_with_transformer_engine_spec = cpu_te_named_vit_spec
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    bridge, provider = build_provider(
        hf_path,
        tp_size=tp,
        cp_size=cp,
        sp=parallel.sp,
        freeze_vision=options.freeze_vision,
        vision_dp_when_cp=parallel.vision_dp_when_cp,
        bf16=False,
    )
    model = provider.provide_distributed_model(
        wrap_with_ddp=False, use_cpu_initialization=True, bf16=False, fp16=False, mixed_precision_wrapper=None
    )
    exact_gelu_in_patch_mergers(model[0])
    chunks = [CpuDDP(m) for m in model]
    optimizer = CpuOptimizer(
        chunks, lr=o.lr, clip_grad=o.grad_clip, weight_decay=o.weight_decay, betas=o.betas, eps=o.eps
    )
    return CpuBackend(
        chunks,
        optimizer,
        tokens,
        options,
        bridge=bridge,
        schedule=cpu_schedule(),
        device="cpu",
        frozen_prefixes=FROZEN_VISION_PREFIXES if options.freeze_vision else (),
    )
