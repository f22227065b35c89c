"""Jobs the megatron-backend tests run inside gloo ranks (cpu_parts.spawn); no megatron import at import time.

`job_all` (2 ranks, one spawn: importing megatron costs ~13 s of CPU per process) runs
- `reference_step`: each sample alone (BSHD, transformers' positions) through the tiny model: logprobs by a plain
  log_softmax, the loss by `miles_vl.algo.policy_loss` with hand-written global weights, gradients by autograd;
- the backend at CP=2, DP=2 and TP=2 on the same samples and weights (logprobs, one mini-batch's loss and
  gradients, one full RL step);
- `job_export`: AutoBridge on a tiny HF checkpoint -> megatron model -> `export_hf_weights`, and the backend on that
  model (logprobs, one RL step) for the comparison with the torch backend.
"""

from __future__ import annotations

import contextlib

import torch

from miles_vl.train.step import train_step
from miles_vl.train.types import MiniBatch

ALGO = dict(
    clip_low=0.2,
    clip_high=0.28,
    dual_clip_c=3.0,
    kl_coef=0.1,
    kl_estimator="low_var_kl",
    entropy_coef=0.01,
    tis_mode="clip",
    tis_cap=2.0,
)
TEMPERATURE = 0.7
LR = 1e-5
# the two-rank layouts of the CPU harness that one spawn runs in turn (test_train_levers.py, test_logits_limit.py)
TWO_RANK_LAYOUTS = {
    "dp2": dict(tp=1, cp=1),
    "cp2": dict(tp=1, cp=2),
    "tp2": dict(tp=2, cp=1),
}


def tokens():
    from miles_vl.models import SpecialTokens
    from tests.patches.harness.tiny import IMAGE, PAD, VEND, VIDEO, VOCAB, VSTART

    return SpecialTokens(
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VSTART,
        vision_end_token_id=VEND,
        pad_token_id=PAD,
        eos_token_ids=(VEND,),
        vocab_size=VOCAB,
    )


def suppressed() -> tuple[int, ...]:
    from tests.patches.harness.tiny import IMAGE, VIDEO

    return (IMAGE, VIDEO)  # the engine bans vision pads in responses; they are prompt-only labels here


def train_samples(seed: int = 0):
    """Six TrainSamples (text, one image, two images; twice) with random advantages and rollout logprobs."""
    from miles_vl.train.types import TrainSample
    from tests.patches.harness.tiny import default_samples

    g = torch.Generator().manual_seed(100 + seed)
    out = []
    for s in default_samples(seed) + default_samples(seed + 1):
        n = s.input_ids.numel() - s.prompt_len
        out.append(
            TrainSample(
                input_ids=s.input_ids,
                prompt_len=s.prompt_len,
                advantage=float(torch.randn((), generator=g)),
                rollout_logprobs=-torch.rand(n, generator=g) * 3,
                image_grid_thw=s.image_grid_thw,
                pixel_values=s.pixel_values,
            )
        )
    return out


def group_train_samples(n: int = 4):
    """The two image prompts of `train_samples(0)` (one image, two images) with `n` responses each (GRPO's n): the same
    prompt and images (equal values, separate tensors), other advantages and rollout logprobs."""
    import dataclasses

    g = torch.Generator().manual_seed(7)
    return [
        dataclasses.replace(
            s,
            advantage=float(torch.randn((), generator=g)),
            rollout_logprobs=-torch.rand(s.rollout_logprobs.shape, generator=g) * 3,
            pixel_values=s.pixel_values.clone(),
            image_grid_thw=s.image_grid_thw.clone(),
        )
        for s in train_samples(0)[1:3]
        for _ in range(n)
    ]


def perturbed(logprobs: list[torch.Tensor], seed: int, scale: float = 0.3) -> list[torch.Tensor]:
    """`logprobs` + noise: "old" / "ref" logprobs that make ratios and KL non-trivial."""
    g = torch.Generator().manual_seed(seed)
    return [lp + scale * torch.randn(lp.shape, generator=g) for lp in logprobs]


def train_options(reduction: str, **kwargs):
    """The backends' options in these tests: `ALGO`, `TEMPERATURE`, the vision pads suppressed; `kwargs` override
    the batching."""
    from miles_vl.train import LossOptions, OptimizerOptions, TrainOptions

    loss = LossOptions(**ALGO, reduction=reduction, temperature=TEMPERATURE, suppress_token_ids=suppressed())
    return TrainOptions(OptimizerOptions(lr=LR), loss, **kwargs)


def build_backend(ctx, *, tp: int, cp: int, reduction: str, **kwargs):
    """The tiny real Qwen3VLModel (seed 0; identical weights for every CP/DP layout) in a MegatronTrainBackend with
    the CPU stand-ins."""
    from miles_vl.train.megatron.backend import MegatronTrainBackend
    from tests.patches.harness.tiny import build_tiny_qwen3vl
    from tests.train.megatron.cpu_parts import CpuDDP, CpuOptimizer, cpu_schedule

    ctx.init_parallel(tp=tp, cp=cp)
    model = build_tiny_qwen3vl(ctx.module, cp_size=cp, tp_size=tp, seed=0)
    chunks = [CpuDDP(model)]
    options = train_options(reduction, **({"micro_batch_max_tokens": 48} | kwargs))  # several micro-batches per rank
    return MegatronTrainBackend(
        chunks, CpuOptimizer(chunks, lr=LR), tokens(), options, schedule=cpu_schedule(), device="cpu"
    )


def _grads(backend) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in backend.model[0].module.named_parameters() if p.grad is not None}


def _step_once(backend, samples, old, ref) -> dict:
    """Gradients and metrics of one mini-batch (all samples) with given old/ref logprobs, then one full train()."""
    for chunk in backend.model:
        chunk.zero_grad_buffer()
    metrics, tokens, _, _ = backend.accumulate_gradients(MiniBatch(samples, list(range(len(samples))), old, ref))
    out = {"metrics": metrics.as_dict(), "grads": _grads(backend), "tokens": tokens}
    out["grad_norm"] = backend.optimizer.grad_norm()
    for chunk in backend.model:
        chunk.zero_grad_buffer()
    return out


def _one_mini_batch(backend, samples) -> dict:
    """`_step_once` with the old and ref logprobs `old_and_ref` makes from the backend's own: the metrics, every
    parameter's gradient of the one mini-batch (before any optimizer step) and the gradient norm."""
    old, ref = old_and_ref(backend.compute_logprobs(samples))
    return _step_once(backend, samples, old, ref)


def old_and_ref(logprobs):
    """Fixed noise around the reference logprobs: the "old" and "ref" logprobs every layout uses."""
    return perturbed(logprobs, seed=1), perturbed(logprobs, seed=2)


# ----------------------------------------------------------------------------------------------------------------
# vocab-parallel logprobs against a plain log_softmax

VP_VOCAB, VP_TOKENS, VP_TEMPERATURE = 24, 9, 0.7
VP_BANNED = (3, 13)  # one on each TP rank's half of the vocabulary
VP_REAL_VOCAB = 22  # ids 22, 23 are megatron's vocab padding


def vocab_parallel_inputs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(VP_TOKENS, VP_VOCAB, generator=g, dtype=torch.float64) * 3
    labels = torch.randint(0, VP_REAL_VOCAB, (VP_TOKENS,), generator=g)
    labels[0] = VP_BANNED[0]  # a suppressed label: -inf
    grad_lp = torch.randn(VP_TOKENS, generator=g, dtype=torch.float64)
    grad_ent = torch.randn(VP_TOKENS, generator=g, dtype=torch.float64)
    return logits, labels, grad_lp, grad_ent


def vocab_parallel_case(rank: int, world: int, group) -> tuple:
    """This TP rank's slice of the logits through `vocab_parallel_logprobs`, forward and backward."""
    from miles_vl.train.megatron.vocab_parallel import vocab_parallel_logprobs

    logits, labels, grad_lp, grad_ent = vocab_parallel_inputs()
    width = VP_VOCAB // world
    local = logits[:, rank * width : (rank + 1) * width].clone().requires_grad_(True)
    logp, entropy = vocab_parallel_logprobs(
        local,
        labels,
        tp_group=group,
        temperature=VP_TEMPERATURE,
        suppress_token_ids=VP_BANNED,
        vocab_size=VP_REAL_VOCAB,
        with_entropy=True,
        chunk_tokens=4,
    )
    finite = torch.isfinite(logp)
    ((torch.where(finite, logp, 0) * grad_lp).sum() + (entropy * grad_ent).sum()).backward()
    return logp.detach().double(), entropy.detach().double(), local.grad


def vocab_parallel_reference():
    """Plain log_softmax over the kept vocabulary, gradients by autograd."""
    logits, labels, grad_lp, grad_ent = vocab_parallel_inputs()
    logits.requires_grad_(True)
    n, v = logits.shape
    keep = torch.ones(v, dtype=torch.bool)
    keep[list(VP_BANNED)] = False
    keep[VP_REAL_VOCAB:] = False
    logp_kept = torch.log_softmax(logits[:, keep] / VP_TEMPERATURE, dim=-1)
    logp = torch.full((n, v), float("-inf"), dtype=logits.dtype).masked_scatter(keep.expand(n, v), logp_kept)
    picked = logp.gather(1, labels[:, None]).squeeze(1)
    entropy = -(logp_kept.exp() * logp_kept).sum(-1)
    finite = torch.isfinite(picked)
    ((torch.where(finite, picked, 0) * grad_lp).sum() + (entropy * grad_ent).sum()).backward()
    return picked.detach(), entropy.detach(), logits.grad


def assert_vocab_parallel_matches(ranks: list[tuple]) -> None:
    """`ranks`: `vocab_parallel_case` of every TP rank, in rank order."""
    want_lp, want_ent, want_grad = vocab_parallel_reference()
    for logp, entropy, _ in ranks:
        assert torch.equal(torch.isinf(logp), torch.isinf(want_lp)) and bool(torch.isinf(want_lp[0]))
        finite = torch.isfinite(want_lp)
        assert torch.allclose(logp[finite], want_lp[finite], atol=1e-5)
        assert torch.allclose(entropy, want_ent, atol=1e-5)
    grad = torch.cat([g for _, _, g in ranks], dim=1)
    assert torch.allclose(grad, want_grad, atol=1e-5)
    assert bool((grad[:, list(VP_BANNED)] == 0).all()) and bool((grad[:, VP_REAL_VOCAB:] == 0).all())


# ----------------------------------------------------------------------------------------------------------------
# the two-rank job


def job_all(ctx, samples, reduction: str, hf_dir: str, hf_samples) -> dict:
    """Two ranks: the independent reference (rank 0, alone), the backend at CP=2, DP=2 and TP=2, then the export
    and cross-backend run (DP=2)."""
    from megatron.core import parallel_state as ps

    from tests.patches.harness.tiny import build_tiny_qwen3vl

    ctx.init_parallel(tp=1, cp=1)
    model = build_tiny_qwen3vl(ctx.module, cp_size=1, seed=0)  # the weights every layout builds
    logprobs = reference_step(model, samples, None, None, reduction)["logprobs"]
    old, ref = old_and_ref(logprobs)
    out = {"old": old, "ref": ref}
    if ctx.rank == 0:
        out["reference"] = reference_step(model, samples, old, ref, reduction)
    del model
    for name, tp, cp in (("cp2", 1, 2), ("dp2", 1, 1), ("tp2", 2, 1)):
        backend = build_backend(ctx, tp=tp, cp=cp, reduction=reduction, global_batch_size=2)
        res = {"logprobs": backend.compute_logprobs(samples)}
        res |= _step_once(backend, samples, old, ref)
        if tp > 1:  # how each gradient is split, to reassemble the full one in the test
            res["partition"] = {  # (dim, stride) of TP-split parameters; dim -1: replicated
                n: (p.partition_dim, getattr(p, "partition_stride", 1))
                if getattr(p, "tensor_model_parallel", False)
                else (-1, 1)
                for n, p in backend.model[0].module.named_parameters()
            }
            res["tp_rank"] = ps.get_tensor_model_parallel_rank()
        res["train"] = train_step(backend, samples)
        out[name] = res
    # TP=2 is live: the vocab-parallel unit case over the real TP group
    tp_group = ps.get_tensor_model_parallel_group()
    out["vocab_parallel"] = vocab_parallel_case(ps.get_tensor_model_parallel_rank(), 2, tp_group)
    out["export"] = job_export(ctx, hf_dir, hf_samples)
    return out


def reference_step(model, samples, old, ref, reduction: str) -> dict:
    """Each sample alone through the model; logprobs, loss and gradients computed here, independently."""
    from miles_vl.algo import policy_loss
    from tests.patches.harness.runner import _logits
    from tests.patches.harness.tiny import reference_positions

    model.zero_grad(set_to_none=True)
    logps, ents = [], []
    for s in samples:
        logits = _logits(
            model(
                input_ids=s.input_ids[None],
                position_ids=reference_positions(s)[:, None, :],
                pixel_values=s.pixel_values,
                image_grid_thw=s.image_grid_thw,
            )
        )[0].float()  # [L, V]
        x = logits[s.prompt_len - 1 : -1] / TEMPERATURE  # rows that predict the response tokens
        x[:, list(suppressed())] = float("-inf")
        logp = torch.log_softmax(x, dim=-1)
        logps.append(logp.gather(1, s.input_ids[s.prompt_len :, None]).squeeze(1))
        p = logp.exp()
        ents.append(-(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1))
    if old is None:
        return {"logprobs": [lp.detach() for lp in logps]}
    lens = [lp.numel() for lp in logps]
    if reduction == "token_mean":
        weights = [torch.full((n,), 1.0 / sum(lens)) for n in lens]
    else:  # seq_mean_token_mean: mean over each response, then over responses
        weights = [torch.full((n,), 1.0 / (n * len(lens))) for n in lens]
    adv = [torch.full((n,), s.advantage) for s, n in zip(samples, lens, strict=True)]
    out = policy_loss(
        torch.cat(logps),
        torch.cat(old),
        torch.cat(adv),
        torch.cat(weights),
        ref_logprobs=torch.cat(ref),
        entropy=torch.cat(ents),
        rollout_logprobs=torch.cat([s.rollout_logprobs for s in samples]),
        **ALGO,
    )
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return {"logprobs": [lp.detach() for lp in logps], "loss": float(out.loss), "grads": grads}


# ----------------------------------------------------------------------------------------------------------------
# export: AutoBridge on the CPU


def job_export(ctx, hf_dir: str, hf_samples) -> dict:
    """AutoBridge -> provider (build_provider) -> megatron model on the CPU with HF weights loaded by the bridge ->
    export_hf_weights; and the megatron backend on that model: logprobs and one RL step on `hf_samples`, to compare
    with the torch backend on the same checkpoint. TE layer specs are swapped for CPU ones whose parameter names
    are TE's (fused norms)."""
    import megatron.bridge.models.qwen_vl.qwen3_vl_provider as provider_module

    from miles_vl.rollout.weight_sync import iter_buckets
    from miles_vl.train.megatron.backend import MegatronTrainBackend
    from miles_vl.train.megatron.build import build_provider
    from miles_vl.train.megatron.export import export_hf_weights
    from tests.train.megatron.cpu_parts import CpuDDP, CpuOptimizer, cpu_schedule

    provider_module.get_gpt_layer_with_transformer_engine_spec = lambda **kw: cpu_te_named_gpt_spec()
    ctx.module.get_vit_layer_with_transformer_engine_spec = cpu_te_named_vit_spec
    ctx.init_parallel(tp=1, cp=1)  # DP = world size
    bridge, provider = build_provider(hf_dir, bf16=False)
    model = provider.provide_distributed_model(
        wrap_with_ddp=False, use_cpu_initialization=True, bf16=False, fp16=False, mixed_precision_wrapper=None
    )
    full = {n: t.clone() for n, t in export_hf_weights(bridge, model)}  # on the CPU these alias the parameters
    trainable = dict(export_hf_weights(bridge, model, skip_prefixes=("vision_model.",)))
    buckets = [[n for n, _ in b] for b in iter_buckets(export_hf_weights(bridge, model), 64 << 10)]
    out = {"full": full, "trainable_names": sorted(trainable), "buckets": buckets}

    exact_gelu_in_patch_mergers(model[0])
    chunks = [CpuDDP(m) for m in model]
    backend = MegatronTrainBackend(
        chunks, CpuOptimizer(chunks, lr=LR), tokens(), cross_backend_options(), schedule=cpu_schedule(), device="cpu"
    )
    out["logprobs"] = backend.compute_logprobs(hf_samples)
    out["train"] = train_step(backend, hf_samples)
    return out


def job_bridge_tp2(ctx, checkpoints: dict[str, str], hf_samples) -> dict:
    """Per HF checkpoint (name -> directory): megatron-bridge loads it at TP=2 over the two ranks, as a train rank of
    a TP=2 job does (each rank its share of every QKV, gate/up and vocabulary split; the driver's CPU stand-in,
    tests/orchestration/megatron_cpu.py); then the export back to HF names (what a weight sync sends: gathered over
    TP), cloned, and the backend's logprobs on `hf_samples`."""
    from megatron.core import parallel_state as ps

    from miles_vl.train.megatron.parallel import ParallelOptions
    from tests.orchestration import megatron_cpu

    out = {}
    for name, hf_dir in checkpoints.items():
        if ps.model_parallel_is_initialized():  # the previous checkpoint's
            ps.destroy_model_parallel()
        backend = megatron_cpu.build(hf_dir, tokens(), cross_backend_options(), ParallelOptions(tp_size=2, bf16=False))
        local_qkv = {
            n: tuple(p.shape)
            for n, p in backend.model[0].module.named_parameters()
            if n.endswith("self_attention.linear_qkv.weight")
        }
        out[name] = {
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "local_qkv": local_qkv,
            "export": {n: t.clone() for n, t in backend.hf_weights()},
            "logprobs": backend.compute_logprobs(hf_samples),
        }
    return out


def job_pipeline(ctx, hf_dir: str, hf_samples) -> dict:
    """The backend at PP=2 on the HF checkpoint (each stage loads its layers through AutoBridge): logprobs and one RL
    step with megatron's real pipeline schedule (1F1B, variable sequence lengths) over gloo, to compare with the
    torch backend. CPU stand-ins as in `job_export`, plus: `torch.cuda.synchronize` a no-op and the schedule's
    token counter on the CPU."""
    import megatron.bridge.models.qwen_vl.qwen3_vl_provider as provider_module
    import megatron.core.pipeline_parallel.schedules as schedules
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_model_config

    from miles_vl.train.megatron.backend import MegatronTrainBackend
    from miles_vl.train.megatron.build import build_provider
    from tests.train.megatron.cpu_parts import CpuDDP, CpuOptimizer, cpu_finalize

    torch.cuda.synchronize = lambda *args, **kwargs: None
    schedules.torch = _CpuTorch()
    provider_module.get_gpt_layer_with_transformer_engine_spec = lambda **kw: cpu_te_named_gpt_spec()
    ctx.module.get_vit_layer_with_transformer_engine_spec = cpu_te_named_vit_spec
    ctx.init_parallel(pp=2)
    _, provider = build_provider(hf_dir, pp_size=2, bf16=False)
    model = provider.provide_distributed_model(
        wrap_with_ddp=False, use_cpu_initialization=True, bf16=False, fp16=False, mixed_precision_wrapper=None
    )
    if ps.is_pipeline_first_stage():
        exact_gelu_in_patch_mergers(model[0])
    chunks = [CpuDDP(m) for m in model]
    get_model_config(chunks[0]).finalize_model_grads_func = cpu_finalize
    backend = MegatronTrainBackend(chunks, CpuOptimizer(chunks, lr=LR), tokens(), cross_backend_options(), device="cpu")
    return {
        "stage": ps.get_pipeline_model_parallel_rank(),
        "variable_seq_lengths": provider.variable_seq_lengths,
        "params": sorted(n for n, _ in model[0].named_parameters()),
        "logprobs": backend.compute_logprobs(hf_samples),
        "train": train_step(backend, hf_samples),
    }


class _CpuTorch:
    """`torch` for megatron's schedules module, whose token counter is made with device="cuda"."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def exact_gelu_in_patch_mergers(model) -> int:
    """megatron-bridge 0.6.2's Qwen3VLVisionPatchMerger (merger and deepstack mergers) applies the vision config's
    tanh-approximated GELU where transformers' Qwen3VLVisionPatchMerger uses exact `nn.GELU()`: a ~1e-3 difference
    of the image samples' logprobs in fp32 that has nothing to do with the backend. Aligned here (to transformers)
    so that the cross-backend comparison isolates the train backend. Returns how many mergers were changed."""
    import torch.nn.functional as F

    count = 0
    for module in model.modules():
        if type(module).__name__ == "Qwen3VLVisionPatchMerger":
            module.activation_func = F.gelu
            count += 1
    assert count > 0, "no Qwen3VLVisionPatchMerger found"
    return count


def cross_backend_options():
    """Backend options shared by the torch and megatron backends in the cross-backend test.

    No entropy term: the torch backend's entropy (models.qwen3_vl.forward.label_logprobs) has a NaN gradient wherever a
    token is suppressed (`where(p > 0, p * logp, 0)` back-propagates 0 * -inf), so it would skip every step."""
    import dataclasses

    options = train_options("token_mean", micro_batch_max_tokens=64, global_batch_size=2)
    return dataclasses.replace(options, loss=dataclasses.replace(options.loss, entropy_coef=0.0))


def hf_train_samples(seed: int = 3):
    """`train_samples` with pixel rows of the real patch size (the tiny HF config keeps patch 16, temporal 2)."""
    g = torch.Generator().manual_seed(seed)
    out = train_samples(seed)
    for s in out:
        if s.pixel_values is not None:
            s.pixel_values = torch.randn(s.pixel_values.shape[0], 3 * 2 * 16 * 16, generator=g)
    return out


def _norm_linear():
    """ColumnParallelLinear with the norm of its input fused in, named as TE's LayerNormColumnParallelLinear
    (`layer_norm_weight`, `layer_norm_bias`), which megatron-bridge's Qwen3-VL name mapping expects."""
    import torch.nn.functional as F
    from megatron.core.tensor_parallel import ColumnParallelLinear

    # the name holds TE's "LayerNormColumnParallelLinear": megatron-bridge's AutoMapping reads module type names to
    # split a TP>1 load (its weight column-parallel, its norm replicated; any other name with "Norm" in it is
    # taken for a norm and replicated whole)
    class CpuLayerNormColumnParallelLinear(ColumnParallelLinear):
        def __init__(self, input_size, output_size, *, config, **kwargs):
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.rms = config.normalization == "RMSNorm"
            self.eps = config.layernorm_epsilon
            self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))
            if not self.rms:
                self.layer_norm_bias = torch.nn.Parameter(torch.zeros(input_size, dtype=config.params_dtype))

        def forward(self, x, *args, **kwargs):
            if self.rms:
                x = F.rms_norm(x, (x.shape[-1],), self.layer_norm_weight, self.eps)
            else:
                x = F.layer_norm(x, (x.shape[-1],), self.layer_norm_weight, self.layer_norm_bias, self.eps)
            return super().forward(x, *args, **kwargs)

    return CpuLayerNormColumnParallelLinear


def _fuse_norms(spec):
    import dataclasses
    from functools import partial

    from megatron.core.transformer.identity_op import IdentityOp

    from tests.patches.harness.attention import ReferenceCoreAttention

    linear = _norm_linear()
    sub = spec.submodules
    sub.input_layernorm = IdentityOp
    sub.pre_mlp_layernorm = IdentityOp
    sub.self_attention.submodules.linear_qkv = linear
    sub.self_attention.submodules.core_attention = ReferenceCoreAttention
    mlp = sub.mlp
    sub.mlp = partial(
        mlp.func,
        *mlp.args,
        **(mlp.keywords | {"submodules": dataclasses.replace(mlp.keywords["submodules"], linear_fc1=linear)}),
    )
    return spec


def cpu_te_named_gpt_spec():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return _fuse_norms(get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"))


def cpu_te_named_vit_spec():
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec

    return _fuse_norms(get_vit_layer_with_local_spec())


def write_tiny_hf_checkpoint(directory: str, seed: int = 0, **tiny) -> dict:
    """A tiny random Qwen3-VL (transformers; `tiny` overrides its config) saved to `directory`; returns its state
    dict."""
    from miles_vl.models.qwen3_vl.model import build_model

    tiny = {"initializer_range": 0.2, "deepstack_visual_indexes": [0, 1]} | tiny
    model = build_model(tokens(), tiny=tiny, seed=seed)
    model.save_pretrained(directory)
    return {k: v.clone() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------------------------------------------
# MoE: the provider megatron-bridge makes of a Qwen3-VL-MoE checkpoint


def write_tiny_moe_checkpoint(directory: str, seed: int = 0) -> None:
    """A tiny random Qwen3-VL-MoE (transformers; the dense tiny config plus 4 experts, top-2) saved to `directory`."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    from miles_vl.models.qwen3_vl.model import tiny_config

    dense = tiny_config(tokens()).to_dict()
    text = dense["text_config"] | dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[]
    )
    keep = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id", "tie_word_embeddings")
    config = Qwen3VLMoeConfig(text_config=text, vision_config=dense["vision_config"], **{k: dense[k] for k in keep})
    torch.manual_seed(seed)
    Qwen3VLMoeForConditionalGeneration(config).save_pretrained(directory)


def job_moe_provider(ctx, hf_dir: str) -> dict:
    """`build_provider` on the MoE checkpoint for a few layouts: what it leaves trainable and how it lays rows out."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    from miles_vl.train.megatron.build import build_provider

    # the provider asks for TE's fused token permutation, which the TE stub lacks; only the config is built here
    for fn in (
        "fused_permute",
        "fused_permute_with_probs",
        "fused_sort_chunks_by_index",
        "fused_sort_chunks_by_index_with_probs",
        "fused_unpermute",
    ):
        setattr(moe_utils, fn, getattr(moe_utils, fn) or object())
    out = {}
    for name, kw in {
        "tp2_ep2": dict(tp_size=2, ep_size=2, sp=False),
        "pp2": dict(pp_size=2),
        "frozen_vision": dict(freeze_vision=True),
    }.items():
        _, p = build_provider(hf_dir, load_weights=False, bf16=False, **kw)
        out[name] = {
            key: getattr(p, key)
            for key in (
                "num_moe_experts",
                "moe_router_topk",
                "expert_model_parallel_size",
                "sequence_parallel",
                "variable_seq_lengths",
                "moe_token_dispatcher_type",
                "freeze_language_model",
                "freeze_vision_model",
                "freeze_vision_projection",
                "calculate_per_token_loss",
            )
        }
    return out


# ----------------------------------------------------------------------------------------------------------------
# save_hf: the megatron backend's HF directory


def job_save_hf(ctx, hf_dir: str, hf_samples, out_dir: str, freeze_vision: bool = False) -> dict:
    """The backend at DP=2 as the driver's CPU stand-in builds it (tests/orchestration/megatron_cpu.py; TP=1 here,
    the bridge's load and export at TP=2 are job_bridge_tp2's): one RL step with a large learning rate (the weights
    move away from the checkpoint), its logprobs of `hf_samples`, then `save_hf` in small shards (every rank exports,
    rank 0 writes). `freeze_vision`: built as `train.freeze_vision` builds it (the vision tower neither trained nor
    synced)."""
    import dataclasses
    from pathlib import Path

    from miles_vl.train.megatron.parallel import ParallelOptions
    from tests.orchestration import megatron_cpu

    options = cross_backend_options()
    options = dataclasses.replace(
        options, optimizer=dataclasses.replace(options.optimizer, lr=1e-2), freeze_vision=freeze_vision
    )
    backend = megatron_cpu.build(hf_dir, tokens(), options, ParallelOptions(bf16=False))
    train_step(backend, hf_samples)
    logprobs = backend.compute_logprobs(hf_samples)
    backend.save_hf(Path(out_dir), max_shard_bytes=200_000)
    return {"logprobs": logprobs}


# ----------------------------------------------------------------------------------------------------------------
# set_lr: the peak learning rate changed between RL steps (the format warm-up's own lr)


def job_set_lr(ctx, samples) -> dict:
    """One rank, an LR warm-up of 4 optimizer steps (step k runs at lr * (k + 1) / 4): `set_lr(10 * LR)`, one RL step
    (one optimizer step), `set_lr(LR)`; the param groups' lr and `lr()` after each, and the options before and
    after."""
    import dataclasses

    backend = build_backend(ctx, tp=1, cp=1, reduction="token_mean")
    built = dataclasses.replace(
        backend.options, optimizer=dataclasses.replace(backend.options.optimizer, warmup_steps=4)
    )
    backend.options = built
    groups = backend.optimizer.param_groups
    backend.set_lr(10 * LR)
    out = {"set": [float(g["lr"]) for g in groups], "lr_set": backend.lr()}
    out["train_lr"] = train_step(backend, samples)["train/lr"]
    out["stepped"] = [float(g["lr"]) for g in groups]  # the lr the optimizer step ran at
    backend.set_lr(LR)
    out |= {"reset": [float(g["lr"]) for g in groups], "lr_reset": backend.lr()}
    out |= {"built_lr": built.optimizer.lr, "options": dataclasses.asdict(backend.options.optimizer)}
    return out


def job_vision_trainable(ctx, samples) -> dict:
    """One rank, weight decay 0: a step with `set_vision_trainable(False)`, then one with True; for each, which
    parameters moved (megatron names, DDP prefix stripped)."""
    backend = build_backend(ctx, tp=1, cp=1, reduction="token_mean")

    def snapshot() -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in backend.model[0].module.named_parameters()}

    def moved(before) -> list[str]:
        return sorted(n for n, p in snapshot().items() if not torch.equal(p, before[n]))

    before = snapshot()
    backend.set_vision_trainable(False)
    train_step(backend, samples)
    out = {"frozen_step": moved(before), "names": sorted(before)}
    before = snapshot()
    backend.set_vision_trainable(True)
    train_step(backend, samples)
    out["trainable_step"] = moved(before)
    return out


# ----------------------------------------------------------------------------------------------------------------
# the train-phase levers (issue 33): each variant is one RL step from the same initial weights


def job_levers(ctx, samples, layouts: dict[str, dict], variants: dict[str, dict]) -> dict:
    """For each layout (`build_backend`'s tp/cp) and variant (TrainOptions overrides): one `train_step` from the tiny
    model's seed-0 weights; its metrics, the gradients of each optimizer step and this rank's weights after it
    (megatron names), how many separate old-logprob passes (`compute_logprobs` calls) it made, how many patches
    the vision tower ran on and how many positions the output layer projected.
    {layout: {variant: {...}}}"""
    out: dict = {}
    for layout, sizes in layouts.items():
        for name, overrides in variants.items():
            backend = build_backend(ctx, **sizes, reduction="token_mean", **overrides)
            calls = {"scoring": 0, "ref": 0}  # compute_ref_logprobs scores through compute_logprobs too

            def count(method, key, calls=calls):
                return lambda s: calls.__setitem__(key, calls[key] + 1) or method(s)

            backend.compute_logprobs = count(backend.compute_logprobs, "scoring")
            backend.compute_ref_logprobs = count(backend.compute_ref_logprobs, "ref")
            patches = []  # what the vision tower ran on (after vision_once_per_image's deduplication)
            tower = backend.model[0].module.vision_model
            tower.register_forward_pre_hook(
                lambda m, args, kwargs, patches=patches: patches.append(kwargs["hidden_states"].shape[0]),
                with_kwargs=True,
            )
            logit_rows = []  # hidden states the output layer projected
            backend.model[0].module.language_model.output_layer.register_forward_hook(
                lambda m, args, out, logit_rows=logit_rows: logit_rows.append(args[0].shape[0])
            )
            grads = []  # each optimizer step's gradients (reduced and scaled: what the optimizer reads)
            stepping = backend.optimizer_step
            backend.optimizer_step = lambda finite, stepping=stepping, grads=grads, b=backend: (
                grads.append(_grads(b)) or stepping(finite)
            )
            metrics = train_step(backend, samples)
            weights = {n: p.detach().clone() for n, p in backend.model[0].module.named_parameters()}
            old_passes = calls["scoring"] - calls["ref"]
            run = {"metrics": metrics, "weights": weights, "old_passes": old_passes, "grads": grads}
            run["vision_patches"], run["logit_rows"] = sum(patches), sum(logit_rows)
            out.setdefault(layout, {})[name] = run
    return out


def job_train_logits_limit(ctx, samples, layouts: dict[str, dict]) -> dict:
    """The limit on one rank's train logits (`step.MAX_TRAIN_LOGITS_ELEMENTS`), lowered around what each layout and
    `logits_only_where_loss` setting forms. Per run (one `train_step` from the seed-0 weights) the rows the output
    layer projected in training mode on this rank; first at the real limit, which measures them, then with the limit
    at exactly the largest rows over all ranks x V/TP (refused) and one element above it (trains).
    {layout: {"full" | "only": {"rows": this rank's largest, "largest": over all ranks, "vocab": V/TP,
    "at": {"error", "train_rows", "eval_rows", "metrics"}, "above": {...}}}} (eval_rows: the forward-only logprob
    pass's; metrics: `train_step`'s, of a step that trained)"""
    import torch.distributed as dist

    from miles_vl.train.megatron import step
    from tests.patches.harness.tiny import VOCAB

    real = step.MAX_TRAIN_LOGITS_ELEMENTS
    out: dict = {}
    for layout, sizes in layouts.items():
        for name, only in (("full", False), ("only", True)):

            def run(limit: int, sizes=sizes, only=only) -> dict:
                step.MAX_TRAIN_LOGITS_ELEMENTS = limit
                backend = build_backend(ctx, **sizes, reduction="token_mean", logits_only_where_loss=only)
                rows: list[int] = []  # hidden states the output layer projected in a train forward (not the scoring)
                eval_rows: list[int] = []  # and in the forward-only logprob pass (every position's logits)
                backend.model[0].module.language_model.output_layer.register_forward_hook(
                    lambda m, args, out, rows=rows, eval_rows=eval_rows: (rows if m.training else eval_rows).append(
                        args[0].shape[0]
                    )
                )
                metrics: dict = {}
                try:
                    metrics = train_step(backend, samples)
                    error = None
                except ValueError as err:
                    error = str(err)
                finally:
                    step.MAX_TRAIN_LOGITS_ELEMENTS = real
                return {"error": error, "train_rows": rows, "eval_rows": eval_rows, "metrics": metrics}

            measured = run(real)
            assert measured["error"] is None, measured["error"]
            mine = max(measured["train_rows"])
            largest = torch.tensor([mine])
            dist.all_reduce(largest, op=dist.ReduceOp.MAX)
            vocab = VOCAB // sizes["tp"]
            limit = int(largest) * vocab
            out.setdefault(layout, {})[name] = {
                "rows": mine,
                "largest": int(largest),
                "vocab": vocab,
                "measured_eval_rows": measured["eval_rows"],
                "at": run(limit),
                "above": run(limit + 1),
            }
    return out


RECOMPUTE_FIELDS = ("recompute_granularity", "recompute_method", "recompute_num_layers")


def job_recompute(ctx, hf_dir: str) -> dict:
    """`build_provider` for each `train.recompute`: the provider's recompute fields and its pre-wrap hooks; then those
    hooks run on the tiny model (CPU specs) whose configs carry the provider's fields, as megatron-bridge builds them
    (the tower's config copies the language model's): the fields of the language model's config and of every config
    object inside the vision tower."""
    from miles_vl.train.megatron.build import build_provider
    from tests.patches.harness.tiny import build_tiny_qwen3vl

    ctx.init_parallel()
    out = {}
    for key, mode, layers in (
        ("none", "none", None),
        ("selective", "selective", None),
        ("full", "full", None),
        ("vision", "vision", None),
        ("full_first_1", "full", 1),  # train.recompute_layers=1
        ("language", "language", None),
        ("language_first_1", "language", 1),
        ("language_shared", "language", None),  # a tower module holding the language model's config
        ("first_1_shared", "full", 1),
    ):
        _, p = build_provider(hf_dir, load_weights=False, bf16=False, recompute=mode, recompute_layers=layers)
        hooks = list(getattr(p, "_pre_wrap_hooks", []))
        model = build_tiny_qwen3vl(ctx.module, cp_size=1, seed=0)
        if key.endswith("_shared"):  # as megatron-bridge 0.6.2 builds one with Transformer Engine's layers
            model.vision_model.decoder.config = model.language_model.config
        for config in {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values():
            for name in RECOMPUTE_FIELDS:  # the configs as megatron-bridge builds them from the provider's
                setattr(config, name, getattr(p, name))
        for hook in hooks:
            model = hook([model])[0]
        vision = {
            tuple(getattr(m.config, f) for f in RECOMPUTE_FIELDS)
            for m in model.vision_model.modules()
            if hasattr(m, "config")
        }
        out[key] = {
            "num_layers": p.num_layers,
            "provider": {f: getattr(p, f) for f in RECOMPUTE_FIELDS},
            "hooks": [getattr(h, "__name__", repr(h)) for h in hooks],
            "language": tuple(getattr(model.language_model.config, f) for f in RECOMPUTE_FIELDS),
            "vision": sorted(vision, key=repr),
        }
    refusals = {}
    past = out["full"]["num_layers"] + 1
    for name, mode, layers in (
        ("past", "full", past),
        ("language_past", "language", past),
        ("not_full", "selective", 1),
    ):
        try:
            build_provider(hf_dir, load_weights=False, bf16=False, recompute=mode, recompute_layers=layers)
            refusals[name] = None
        except ValueError as err:
            refusals[name] = str(err)
    out["refusals"] = refusals
    return out


def job_lever_refusals(ctx) -> dict:
    """The levers the backend refuses, with their messages: logits_only_where_loss under sequence parallelism (the
    groups say so; the CPU layers cannot run it) and old_logprobs_from_train_forward with dropout."""
    from miles_vl.train.megatron.backend import MegatronTrainBackend
    from miles_vl.train.megatron.parallel import ParallelGroups
    from tests.patches.harness.tiny import build_tiny_qwen3vl
    from tests.train.megatron.cpu_parts import CpuDDP, CpuOptimizer, cpu_schedule

    ctx.init_parallel()
    out = {}
    for name, overrides, sp, dropout in (
        ("sp", dict(logits_only_where_loss=True), True, 0.0),
        ("dropout", dict(old_logprobs_from_train_forward=True), False, 0.1),
    ):
        model = build_tiny_qwen3vl(ctx.module, cp_size=1, seed=0)
        model.config.hidden_dropout = dropout
        chunks = [CpuDDP(model)]
        try:
            MegatronTrainBackend(
                chunks,
                CpuOptimizer(chunks, lr=LR),
                tokens(),
                train_options("token_mean", **overrides),
                groups=ParallelGroups.from_megatron(sequence_parallel=sp),
                schedule=cpu_schedule(),
                device="cpu",
            )
            out[name] = None
        except ValueError as err:
            out[name] = str(err)
    return out


# ----------------------------------------------------------------------------------------------------------------
# checkpoints written in the background (megatron-core's async save, train/megatron/checkpoint.py)


def _trainer_state(backend) -> dict:
    """This rank's weights, Adam moments (empty before the optimizer's first step) and counters, copied."""
    optim = backend.optimizer.inner.state
    moments = [{k: v.clone() for k, v in optim.get(p, {}).items()} for p in backend.optimizer.main_params]
    weights = {n: p.detach().clone() for n, p in backend.model[0].module.named_parameters()}
    return {"weights": weights, "moments": moments, "counters": backend._counters()}


def _hold_the_writers(gate: str) -> None:
    """megatron-core's writer (run in the forked writer process) waits for the file `gate` before it writes, so the
    test decides when the write ends; both ranks' writers wait for the same file."""
    import os
    import time

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    write = FileSystemWriterAsync.write_preloaded_data_multithread

    def held(*args, **kwargs):
        while not os.path.exists(gate):  # a file: the writer is another process
            time.sleep(0.01)
        return write(*args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data_multithread = staticmethod(held)


def job_async_save(ctx, samples, root: str) -> dict:
    """TP=2: one RL step; a synchronous save (`sync`) and a background one (`async`) of that state, the latter held
    in its writer while a second RL step changes every weight; then resumes from each into the trained backend
    and the second step again. Returns what each rank saw."""
    import os
    from pathlib import Path

    import torch.distributed as dist

    backend = build_backend(ctx, tp=2, cp=1, reduction="token_mean")
    train_step(backend, samples)
    at_save = _trainer_state(backend)
    backend.save_checkpoint(Path(root) / "sync")
    gate = os.path.join(root, "go")
    _hold_the_writers(gate)
    write = backend.start_checkpoint(Path(root) / "async")
    out = {"done_while_held": write.done(), "files_while_held": sorted(os.listdir(Path(root) / "async"))}
    train_step(backend, samples)  # training goes on while the write is in flight
    straight = _trainer_state(backend)
    out["done_after_step"] = write.done()
    dist.barrier()
    if ctx.rank == 0:
        Path(gate).touch()
    write.wait()
    out["done_after_wait"] = write.done()
    for name in ("async", "sync"):
        backend.load_checkpoint(Path(root) / name)
        out[f"{name}_loaded"] = _trainer_state(backend)
        train_step(backend, samples)
        out[f"{name}_resumed"] = _trainer_state(backend)
    out |= {"at_save": at_save, "straight": straight}
    return out


def job_async_save_fails(ctx, samples, root: str) -> dict:
    """TP=2 (each rank writes its own shards): a background save whose write fails in megatron-core's writer process
    on rank 1 only (a directory stands where its shard file goes: `IsADirectoryError`): `done()`'s answers until it
    says the write ended (it never raises), `wait()`'s error and what `out_of_space` says of it, the files left; then
    a save that works."""
    import os
    from pathlib import Path

    import torch.distributed as dist

    from miles_vl.orchestration.checkpoint import out_of_space

    backend = build_backend(ctx, tp=2, cp=1, reduction="token_mean")
    train_step(backend, samples)
    out = {}
    blocked = Path(root) / "blocked"
    if ctx.rank == 1:
        (blocked / "__1_0.distcp").mkdir(parents=True)  # the name megatron's writer gives rank 1's shard file
    dist.barrier()
    write = backend.start_checkpoint(blocked)
    polls = []
    while not polls or not polls[-1]:
        polls.append(write.done())  # collective: the same answers on both ranks, and it never raises
    out["polls"] = polls[-1:]
    try:
        write.wait()
        out["blocked"] = None
    except Exception as err:  # noqa: BLE001 - what is raised is what is checked
        out["blocked"] = (type(err).__name__, str(err), out_of_space(err, blocked))
    out["blocked_files"] = sorted(os.listdir(blocked))
    after = Path(root) / "after"
    backend.start_checkpoint(after).wait()
    out["after_files"] = sorted(os.listdir(after))
    return out


def job_async_save_on_a_full_disk(ctx, disk: str) -> dict:
    """TP=2: a background save into `disk` (a tmpfs smaller than a rank's shard file): `wait()`'s error and
    what `out_of_space` says of it while the partial files still fill the disk, and the files left."""
    import os
    from pathlib import Path

    from miles_vl.orchestration.checkpoint import out_of_space

    backend = build_backend(ctx, tp=2, cp=1, reduction="token_mean")
    directory = Path(disk) / "ckpt"
    write = backend.start_checkpoint(directory)
    try:
        write.wait()
        return {"raised": None}
    except Exception as err:  # noqa: BLE001 - what is raised is what is checked
        return {"raised": (type(err).__name__, str(err), out_of_space(err, directory)), "files": os.listdir(directory)}


# ----------------------------------------------------------------------------------------------------------------
# checkpoints without the optimizer's state (checkpoint.optimizer_state=false)


def _main_params_backend(ctx, weights: dict[str, torch.Tensor] | None = None):
    """The tiny real Qwen3VLModel at TP=2 (seed 0, or `weights` copied in before the optimizer is built) in a
    MegatronTrainBackend whose stand-in optimizer steps fp32 main weights of its own (`CpuOptimizer(main_params=
    True)`); megatron's parallel state (TP=2) is the caller's."""
    from miles_vl.train.megatron.backend import MegatronTrainBackend
    from tests.patches.harness.tiny import build_tiny_qwen3vl
    from tests.train.megatron.cpu_parts import CpuDDP, CpuOptimizer, cpu_schedule

    model = build_tiny_qwen3vl(ctx.module, cp_size=1, tp_size=2, seed=0)
    if weights is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(weights[name])
    chunks = [CpuDDP(model)]
    options = train_options("token_mean", micro_batch_max_tokens=48)
    optimizer = CpuOptimizer(chunks, lr=LR, main_params=True)
    return MegatronTrainBackend(chunks, optimizer, tokens(), options, schedule=cpu_schedule(), device="cpu")


def _main_weights(backend) -> list[torch.Tensor]:
    return [m.detach().clone() for m in backend.optimizer.main_params]


def job_model_only_checkpoint(ctx, samples, root: str) -> dict:
    """TP=2, the optimizer stepping fp32 main weights apart from the model's: one RL step, then a save with the
    optimizer's state (`full`) and one without (`model_only`, backend.save_checkpoint(optimizer_state=False)) of that
    state. A fresh backend (its main weights the initial ones) loads `model_only` and trains a step; the reference is
    a backend built on the saved weights (so its optimizer starts from them), at the saved counters, trained a step.
    Another fresh backend loads `full`. Returns what each rank saw."""
    from pathlib import Path

    ctx.init_parallel(tp=2, cp=1)
    trained = _main_params_backend(ctx)
    train_step(trained, samples)
    at_save = _trainer_state(trained)
    trained.save_checkpoint(Path(root) / "full")
    trained.save_checkpoint(Path(root) / "model_only", optimizer_state=False)
    out = {"at_save": at_save}

    resumed = _main_params_backend(ctx)
    out["main_before_load"] = _main_weights(resumed)
    resumed.load_checkpoint(Path(root) / "model_only")
    out["loaded"] = _trainer_state(resumed) | {"main": _main_weights(resumed)}
    train_step(resumed, samples)
    out["resumed"] = _trainer_state(resumed)

    reference = _main_params_backend(ctx, at_save["weights"])
    reference.optimizer_steps, reference.skipped_steps = trained.optimizer_steps, trained.skipped_steps
    reference.ref_weights = resumed.ref_weights  # the KL term's reference policy: the run's initial weights in both
    train_step(reference, samples)
    out["reference"] = _trainer_state(reference)

    full = _main_params_backend(ctx)
    full.load_checkpoint(Path(root) / "full")
    out["full_loaded"] = _trainer_state(full) | {"main": _main_weights(full)}
    return out


# ----------------------------------------------------------------------------------------------------------------
# the export's conversion tasks, cached across syncs (train/megatron/export.py: ExportPlan)


def _bridge_model(hf_dir: str):
    """(bridge, model chunks) of the HF checkpoint, built as `job_export` builds them (fp32, CPU stand-ins)."""
    import megatron.bridge.models.qwen_vl.qwen3_vl_provider as provider_module

    from miles_vl.train.megatron.build import build_provider

    provider_module.get_gpt_layer_with_transformer_engine_spec = lambda **kw: cpu_te_named_gpt_spec()
    bridge, provider = build_provider(hf_dir, bf16=False)
    model = provider.provide_distributed_model(
        wrap_with_ddp=False, use_cpu_initialization=True, bf16=False, fp16=False, mixed_precision_wrapper=None
    )
    return bridge, model


def job_export_plan(ctx, hf_dir: str, hf_samples) -> dict:
    """One rank: the backend's export (its `ExportPlan`) against a fresh, uncached `export_hf_weights` of the same
    model, before and after an RL step changed the weights; then the plan handed another model object of the same
    checkpoint (other values), and the first model with one parameter object replaced. Every export is cloned as it
    is read (on the CPU the exported tensors alias the parameters)."""
    from miles_vl.train.megatron.backend import MegatronTrainBackend
    from miles_vl.train.megatron.build import FROZEN_VISION_PREFIXES
    from miles_vl.train.megatron.export import export_hf_weights
    from tests.train.megatron.cpu_parts import CpuDDP, CpuOptimizer, cpu_schedule

    ctx.module.get_vit_layer_with_transformer_engine_spec = cpu_te_named_vit_spec
    ctx.init_parallel(tp=1, cp=1)
    bridge, model = _bridge_model(hf_dir)

    class Backend(MegatronTrainBackend):
        def hf_weights(self, skip_prefixes=(), *, cpu=True):
            # megatron-bridge unwraps megatron's DDP itself; CpuDDP is not one of the wrappers it knows
            return self.export_plan(skip_prefixes).weights([c.module for c in self.model], cpu=cpu)

    def read(weights) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in weights}

    chunks = [CpuDDP(m) for m in model]
    backend = Backend(
        chunks,
        CpuOptimizer(chunks, lr=1e-2),  # large enough that every trained weight moves visibly in one step
        tokens(),
        cross_backend_options(),
        schedule=cpu_schedule(),
        bridge=bridge,
        device="cpu",
        frozen_prefixes=FROZEN_VISION_PREFIXES,
    )
    out = {"before": read(backend.export_weights())}  # the first sync builds the tasks
    train_step(backend, hf_samples)
    out["cached"] = read(backend.export_weights())
    out["uncached"] = read(export_hf_weights(bridge, model, skip_prefixes=FROZEN_VISION_PREFIXES))
    plan = backend.export_plan(FROZEN_VISION_PREFIXES)
    out["builds_after_two_syncs"] = plan.builds

    _, other = _bridge_model(hf_dir)  # a model rebuilt (as after a relaunch), other values
    with torch.no_grad():
        for p in other[0].parameters():
            p.add_(1.0)
    out["other"] = read(plan.weights(other))
    out["other_uncached"] = read(export_hf_weights(bridge, other, skip_prefixes=FROZEN_VISION_PREFIXES))
    out["builds_after_other"] = plan.builds

    norm = model[0].language_model.decoder.final_layernorm
    norm.weight = torch.nn.Parameter(norm.weight.detach() + 5.0)  # a new parameter object in the first model
    out["replaced"] = read(plan.weights(model))
    out["replaced_uncached"] = read(export_hf_weights(bridge, model, skip_prefixes=FROZEN_VISION_PREFIXES))
    out["builds_after_replaced"] = plan.builds
    return out


def _set_on_every_config(module: torch.nn.Module, fields: dict) -> None:
    """`fields` (megatron's recompute settings) on every config object of `module`, as megatron-bridge builds them
    from the provider's (the tower's config copies the language model's)."""
    for config in {id(m.config): m.config for m in module.modules() if hasattr(m, "config")}.values():
        for field, value in fields.items():
            setattr(config, field, value)


def job_recompute_layers(ctx, samples) -> dict:
    """One mini-batch's gradients of the tiny model (seed 0) per recompute setting, its configs set as `build_provider`
    sets them (the language model's, which the tower copies; then its pre-wrap hooks): the metrics, the gradients,
    and how many layer runs each block checkpointed (megatron-bridge's Qwen3-VL blocks call
    `tensor_parallel.checkpoint` once per recomputed layer, with one layer a chunk: counted here on the way to
    megatron-core's own, `megatron_checkpoint_on_cpu`). {setting: {...}}"""
    from miles_vl.train.megatron.build import (
        FULL_RECOMPUTE,
        NO_RECOMPUTE,
        keep_vision_tower_recomputed,
        no_recompute_in_vision_tower,
    )

    first_1 = {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1}
    settings = {
        "none": (NO_RECOMPUTE, []),
        "full": (FULL_RECOMPUTE, []),
        "first_1": (first_1, [keep_vision_tower_recomputed]),
        "language": (FULL_RECOMPUTE, [no_recompute_in_vision_tower]),  # train.recompute=language
        "language_first_1": (first_1, [no_recompute_in_vision_tower]),
    }
    from megatron.core import tensor_parallel

    checkpoint = tensor_parallel.checkpoint  # what the blocks call, through miles_vl's bridge_recompute patch
    out = {}
    for name, (fields, hooks) in settings.items():
        backend = build_backend(ctx, tp=1, cp=1, reduction="token_mean", micro_batch_max_tokens=4096)
        module = backend.model[0].module
        _set_on_every_config(module, fields)
        for hook in hooks:
            hook([module])
        runs = {"language": 0, "vision": 0}

        def counted(fn, distribute_saved_activations, *args, runs=runs):  # fn: the calling block's closure
            runs["vision" if fn.__qualname__.startswith("Qwen3VLVision") else "language"] += 1
            return checkpoint(fn, distribute_saved_activations, *args)

        tensor_parallel.checkpoint = counted
        try:
            with megatron_checkpoint_on_cpu():
                step = _one_mini_batch(backend, samples)
        finally:
            tensor_parallel.checkpoint = checkpoint
        out[name] = {
            "metrics": step["metrics"],
            "grads": step["grads"],
            "checkpointed": runs,
            "layers": {
                "language": len(module.language_model.decoder.layers),
                "vision": len(module.vision_model.decoder.layers),
            },
        }
    return out


def job_vision_recompute_grads(ctx, samples) -> dict:
    """One mini-batch's gradients of the tiny model (seed 0) with no recompute and with full recompute (every layer,
    language model and vision tower), through megatron-core's own `CheckpointFunction` (its CUDA RNG states stubbed
    to the CPU's: the rest of it, the no-grad forward and the backward's recompute, is megatron's), once with
    miles_vl's `vision_recompute_deepstack_grads` patch and once with upstream's `tensor_parallel` put back: the
    metrics and every parameter's gradient. {"none" | "full" | "full_upstream": {"metrics", "grads"}}"""
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl import transformer_block

    from miles_vl.train.megatron.build import FULL_RECOMPUTE, NO_RECOMPUTE

    patched = transformer_block.tensor_parallel
    assert hasattr(patched, "__miles_vl_original__"), "the bridge_recompute patch is not installed"
    out = {}
    try:
        for name, fields, tp in (
            ("none", NO_RECOMPUTE, patched),
            ("full", FULL_RECOMPUTE, patched),
            ("full_upstream", FULL_RECOMPUTE, patched.__miles_vl_original__),
        ):
            transformer_block.tensor_parallel = tp
            backend = build_backend(ctx, tp=1, cp=1, reduction="token_mean", micro_batch_max_tokens=4096)
            _set_on_every_config(backend.model[0].module, fields)
            with megatron_checkpoint_on_cpu():
                step = _one_mini_batch(backend, samples)
            out[name] = {"metrics": step["metrics"], "grads": step["grads"]}
    finally:
        transformer_block.tensor_parallel = patched
    return out


@contextlib.contextmanager
def megatron_checkpoint_on_cpu():
    """megatron-core's `CheckpointFunction` on the CPU: it saves and restores the CUDA RNG states around the
    recompute (`_get_all_rng_states`, `_set_all_rng_states`), which need CUDA; inside, they save and restore the CPU's
    only. The rest of it (the forward under no_grad, the backward's recompute and which outputs get gradients) runs
    as megatron's."""
    from megatron.core.tensor_parallel import random

    states = random._get_all_rng_states, random._set_all_rng_states
    random._get_all_rng_states = lambda: (torch.get_rng_state(),)
    random._set_all_rng_states = torch.set_rng_state
    try:
        yield
    finally:
        random._get_all_rng_states, random._set_all_rng_states = states
