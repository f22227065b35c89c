"""CPU stand-ins for the CUDA-only parts of the megatron backend, with megatron's semantics, and a gloo spawner.

    results = spawn(job, world_size=2, args=(...))    # job(ctx: Ctx, *args), module-level, in a module that does
                                                      # not import megatron at import time (see runner.py's header)

Inside a job: `ctx.init_parallel(tp, cp)` (re)initializes megatron's parallel state, `build_backend(ctx, ...)`
builds the tiny real Qwen3VLModel (tests/patches/harness/tiny.py) and a `MegatronTrainBackend` around it with:
- `CpuDDP`: megatron DDP's interface (`zero_grad_buffer`, `module`); gradients stay in `.grad`;
- `cpu_finalize`: what megatron's `finalize_model_grads` does with `calculate_per_token_loss=True` and the DDP
  config of build.py: SUM the gradients over DP x CP, sum the partial gradients of replicated parameters that only
  see part of the work on each TP rank (q/k layernorm over heads, norms under sequence parallelism), then divide
  them by the number of tokens the loss functions reported, all-reduced over DP x CP;
- `CpuOptimizer`: torch AdamW behind megatron's optimizer methods (`prepare_grads`, `get_grad_norm` over TP
  shards, `step` that clips to `clip_grad` and steps, `reload_model_params`); with `main_params` it steps fp32 main
  weights of its own and copies them into the model, as megatron's mixed-precision optimizers do;
- `step.sequential_forward_backward`: megatron's no-pipelining schedule loop.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from tests.dist import rank_main, spawn_ranks


@dataclass
class Ctx:
    rank: int
    world_size: int
    module: object  # megatron-bridge's Qwen3-VL model module

    def init_parallel(self, tp: int = 1, cp: int = 1, pp: int = 1) -> None:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp, context_parallel_size=cp, pipeline_model_parallel_size=pp
        )


class WorkerError(RuntimeError):
    pass


def _child(rank, world_size, init_file, out_dir, timeout_s, job, args) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

    def setup():
        from tests.patches.harness.shims import load_qwen3vl_module

        module = load_qwen3vl_module("0.6.2")
        import miles_vl.train.megatron.backend  # noqa: F401  (installs miles_vl.patches into the module)

        return module

    rank_main(
        rank,
        world_size,
        init_file,
        out_dir,
        backend="gloo",
        timeout_s=timeout_s,
        setup=setup,
        body=lambda module: job(Ctx(rank, world_size, module), *args),
    )


def spawn(job, world_size: int, args: tuple = (), timeout_s: float = 300.0) -> list:
    """Run `job(ctx, *args)` on `world_size` fresh gloo processes; returns each rank's result."""
    results = spawn_ranks(_child, world_size, (timeout_s, job, tuple(args)), timeout_s)
    for rank, res in enumerate(results):
        if "error" in res:
            exc_type, message, tb = res["error"]
            raise WorkerError(f"rank {rank}: {exc_type}: {message}\n{tb}")
    return [res["ok"] for res in results]


# ----------------------------------------------------------------------------------------------------------------
# megatron's DDP / finalize / optimizer, on the CPU


class CpuDDP(torch.nn.Module):
    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def zero_grad_buffer(self) -> None:
        self.module.zero_grad(set_to_none=True)

    # megatron's `unwrap_model` does not know this wrapper: the checkpoint's calls reach the model as through DDP's
    def sharded_state_dict(self, *args, **kwargs):
        return self.module.sharded_state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self.module.load_state_dict(*args, **kwargs)


def cpu_finalize(model_chunks, num_tokens: torch.Tensor, **_) -> None:
    """megatron-core 0.19's finalize_model_grads for our configuration (per-token loss, SUM in DDP, untied
    embeddings)."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_model_config

    dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
    tp = ps.get_tensor_model_parallel_group()
    total = num_tokens.double().reshape(1).clone()
    pp = ps.get_pipeline_model_parallel_group()
    if pp.size() > 1:  # only the last stage counted tokens: it tells the other stages
        dist.broadcast(total, src=dist.get_global_rank(pp, pp.size() - 1), group=pp)
    dist.all_reduce(total, group=dp_cp)
    for chunk in model_chunks:
        config = get_model_config(chunk)
        for name, p in chunk.named_parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=dp_cp)  # DDP's bucket reduction (gradient_scaling_factor 1)
            # _allreduce_non_tensor_model_parallel_grads: partial per-rank gradients of replicated parameters
            if getattr(p, "average_gradients_across_tp_domain", False):
                dist.all_reduce(p.grad, group=tp)
                p.grad.div_(tp.size())
            elif (config.sequence_parallel and getattr(p, "sequence_parallel", False)) or (
                config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)
            ):
                dist.all_reduce(p.grad, group=tp)
            p.grad.div_(float(total))  # scale_gradients(1 / num_tokens)


class CpuOptimizer:
    """torch AdamW with the subset of megatron's optimizer interface the backend calls.

    `main_params`: AdamW steps fp32 copies of the model's parameters taken here (`main_params`, in `params` order)
    and copies them into the model after each step, as megatron's mixed-precision optimizers (Float16Optimizer,
    DistributedOptimizer) step their fp32 main weights; weights loaded into the model reach them only through
    `reload_model_params`. Without it AdamW steps the model's parameters themselves (`main_params` is `params`)."""

    def __init__(
        self,
        model_chunks,
        lr: float,
        clip_grad: float = 1.0,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        main_params: bool = False,
    ) -> None:
        self.params = [p for chunk in model_chunks for p in chunk.parameters() if p.requires_grad]
        self.main_params = [p.detach().clone().float() for p in self.params] if main_params else self.params
        self.inner = torch.optim.AdamW(self.main_params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
        self.clip_grad = clip_grad

    @property
    def param_groups(self):
        return self.inner.param_groups

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for main in self.main_params:
            main.grad = None

    def reload_model_params(self, state_dict=None) -> None:
        """megatron's: the main weights from the model's current ones (a no-op without `main_params`)."""
        if self.main_params is not self.params:
            with torch.no_grad():
                for main, p in zip(self.main_params, self.params, strict=True):
                    main.copy_(p)

    def prepare_grads(self) -> bool:
        return False

    def grad_norm(self) -> float:
        """L2 norm over the whole model: TP-sharded tensors summed over the TP group, replicated ones once, and the
        stages' layers summed over the PP group."""
        from megatron.core import parallel_state as ps

        sharded = torch.zeros((), dtype=torch.float64)
        replicated = torch.zeros((), dtype=torch.float64)
        for p in self.params:
            if p.grad is None:
                continue
            sq = p.grad.double().pow(2).sum()
            if getattr(p, "tensor_model_parallel", False):
                sharded += sq
            else:
                replicated += sq
        dist.all_reduce(sharded, group=ps.get_tensor_model_parallel_group())
        total = sharded + replicated
        dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())  # each stage holds its own layers
        return math.sqrt(float(total))

    def get_grad_norm(self) -> float:
        return self.grad_norm()

    def step(self) -> tuple[bool, float, None]:
        """megatron's step(): clip to `clip_grad` by the global norm, then step."""
        norm = self.grad_norm()
        coeff = self.clip_grad / (norm + 1e-6)
        if coeff < 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coeff)
        if self.main_params is not self.params:
            for main, p in zip(self.main_params, self.params, strict=True):
                main.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        if self.main_params is not self.params:
            with torch.no_grad():
                for main, p in zip(self.main_params, self.params, strict=True):
                    p.copy_(main)
        return True, norm, None

    # megatron's checkpoint interface, as its FP32Optimizer has it (megatron/core/optimizer/optimizer.py): the Adam
    # moments sharded like the parameters they belong to, one common step

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata=None) -> dict:
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        if is_loading:  # the state a load fills in must exist
            for p in self.main_params:
                if p not in self.inner.state:
                    self.inner.state[p] = {
                        "step": torch.zeros(()),
                        "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.zeros_like(p),
                    }
        state = self.inner.state_dict()
        steps = {float(s["step"]) for s in state["state"].values()}
        assert len(steps) <= 1, f"one optimizer step for every parameter, found {steps}"
        id_to_sharded = get_param_id_to_sharded_param_map(model_sharded_state_dict, self.params)
        optim_state_to_sharding_state(state, id_to_sharded, exclude_keys="step")
        if steps:
            state["state"]["common_step"] = steps.pop()
        return state

    def load_state_dict(self, state: dict) -> None:
        step = state["state"].pop("common_step", None)
        for param_state in state["state"].values():
            param_state["step"] = torch.tensor(step)
        self.inner.load_state_dict(state)
        self.reload_model_params()  # this stand-in saves no main weights: the loaded (fp32) model's are theirs


def cpu_schedule():
    from miles_vl.train.megatron.step import sequential_forward_backward

    return partial(sequential_forward_backward, finalize=cpu_finalize)
