"""`build`: a CPU stand-in for `build_megatron_backend` (same signature) that the driver's train ranks call in place of
it (`tests.orchestration.jobs.stand_ins(megatron=True)`).

Everything between the job config and the backend is the production path: the driver's placement, the train actors,
their process group (gloo here), `build_provider` (AutoBridge on the HF checkpoint, the job's parallel sizes,
`configure_provider`), the model megatron-bridge provides with the checkpoint's weights, `MegatronTrainBackend`, its
export to the engines. Stood in, as in the backend's CPU tests (tests/train/megatron/cpu_parts.py): the TE layers
(local specs with TE's parameter names), DDP and finalize, megatron's optimizer (torch AdamW behind its methods), the
schedule and the unwrapping of DDP before the export. The checkpoints are megatron-core's distributed checkpoints,
saved and loaded by the backend's own code (train/megatron/checkpoint.py, in the background with
checkpoint.async_save), with the stand-in optimizer's state sharded as megatron's FP32Optimizer shards it
(cpu_parts.py). The model runs in fp32 with transformers' exact GELU in the patch mergers, so that its logprobs match
the torch backend's on the same checkpoint.
"""

from __future__ import annotations


def build(hf_path: str, tokens, options, parallel):
    from tests.patches.harness.shims import load_qwen3vl_module

    tp, cp, o = parallel.tp_size, parallel.cp_size, options.optimizer
    if parallel.pp_size != 1 or parallel.ep_size != 1:
        raise ValueError("the CPU stand-in runs tp/cp layouts only (pp = ep = 1)")
    module = load_qwen3vl_module("0.6.2")  # the TE stub and CPU shims, before megatron-bridge's model imports
    import megatron.bridge.models.qwen_vl.qwen3_vl_provider as provider_module
    from megatron.core import parallel_state as ps

    from miles_vl.train.megatron.backend import MegatronTrainBackend
    from miles_vl.train.megatron.build import FROZEN_VISION_PREFIXES, build_provider
    from tests.train.megatron.cpu_parts import CpuDDP, CpuOptimizer, cpu_schedule
    from tests.train.megatron.jobs import cpu_te_named_gpt_spec, cpu_te_named_vit_spec, exact_gelu_in_patch_mergers

    class CpuBackend(MegatronTrainBackend):
        def hf_weights(self, skip_prefixes=(), *, cpu=True):
            # megatron-bridge unwraps megatron's DDP itself; CpuDDP is not one of the wrappers it knows
            return self.export_plan(skip_prefixes).weights([c.module for c in self.model], cpu=cpu)

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


def build_gated_save(hf_path: str, tokens, options, parallel, *, gate: str):
    """`build`, whose background checkpoint writes (megatron-core's writer process, forked on every rank) create
    `<gate>.writing-<rank>` and then wait for `<gate>.go` before writing anything: a test acts while a save is in
    flight."""
    import os
    import time

    import torch.distributed as dist

    backend = build(hf_path, tokens, options, parallel)  # first: it imports megatron (the CPU shims before)
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    write, rank = FileSystemWriterAsync.write_preloaded_data_multithread, dist.get_rank()

    def gated(*args, **kwargs):
        open(f"{gate}.writing-{rank}", "w").close()
        deadline = time.monotonic() + 120  # a test that never opens the gate fails instead of hanging
        while not os.path.exists(f"{gate}.go"):  # a file: the writer is another process
            if time.monotonic() > deadline:
                raise TimeoutError(f"{gate}.go did not appear in 120 s")
            time.sleep(0.01)
        return write(*args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data_multithread = staticmethod(gated)
    return backend
