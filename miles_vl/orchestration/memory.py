"""An estimate of GPU memory per GPU for a job's Megatron trainer and SGLang engines (`miles-vl check`).

All sizes in GiB; `P` parameters, of which `V` in the vision tower and `E` MoE experts; `t, p, c, e` = train.tp, pp,
cp, ep; `W` = train.num_gpus. The trainer (megatron, as `train/megatron/build.py` builds it):

- weights: bf16 (fp32 with model.dtype fp32), each model-parallel rank its shard:
  `2 * (P - E) / (t*p) + 2 * E / (e*t*p)` (expert tensor parallel = t, megatron's default).
- gradients: fp32 (`grad_reduce_in_fp32`), for the trainable parameters (`P - V` with train.freeze_vision), same
  sharding: 4 bytes a parameter.
- optimizer: Adam's two fp32 moments and, in bf16, an fp32 main copy: 12 bytes a trainable parameter (8 in fp32).
  Megatron's distributed optimizer (what miles_vl builds) shards them over every rank: `12 * P / W`; without it
  they sit on every data-parallel rank like the gradients. With `train.optimizer.cpu_offload` = f, megatron's
  HybridDeviceOptimizer moves f of a rank's shard to host memory: `(1 - f) * 12 * P / W` stay on the GPU and
  `f * 16 * P / W` bytes go to the host (the fp32 main weights, both moments and a pinned fp32 copy of the
  gradients; hybrid_optimizer.py) -- host memory per train rank, not counted against the GPU.
- activations of one packed micro-batch, `T = micro_batch_max_tokens / c` tokens a rank, bf16, flash attention (no
  `T^2` term), no dropout. A decoder layer keeps per token `8h + 6*(q + kv + m)` bytes (the inputs and outputs of
  both norms, 4h; Q, K, V and their QK-norm outputs, the attention output; the MLP's gate/up output, its
  activation; `h` hidden, `q` = heads * head_dim, `kv` = kv heads * head_dim, `m` = intermediate size, for MoE the
  top-k experts' together). The `8h` part is split over t with sequence parallel, the rest always. `recompute`
  none or selective (with flash attention selective recompute saves nothing this formula counts): every layer
  keeps it, `L * T * that`; full (one layer a chunk): each layer keeps only its input, `2h` a token, plus one
  layer's full set while it is recomputed; full with `train.recompute_layers` = N: N layers of each pipeline stage
  keep their input, the others their full set; language: as full (it differs in the vision tower only, which is not
  counted). With p > 1 the first stage holds p micro-batches of L/p layers: the
  same `L` layers' worth.
- logits: `T * vocab / t * 16` bytes (bf16 logits, their fp32 copy, the fp32 softmax, the fp32 and bf16 gradients:
  the vocab-parallel log-prob of the sampled token and its backward). With `train.logits_only_where_loss` the rows are
  the loss positions, which the micro-batch plan keeps under `step.max_train_logits_rows` (14,134 at Qwen3-VL's
  vocabulary and t = 1): `min(T, that)` rows, an upper bound (a micro-batch's loss positions are usually fewer).
- the colocated IPC weight sync's buffers (`rollout.sglang.colocated_sync: ipc`, rollout/sglang/weights.py): a
  rank that shares its GPU with a server's TP rank packs each bucket into one of two persistent bf16 buffers of the
  bucket bound (512 MiB), each grown for good by a tensor larger than that (the embedding or output layer, `vocab *
  h`): `2 * max(512 MiB, 2 * vocab * h)`, an upper bound (a tied model grows one of them), resident for the job
  from its first sync on: after a colocated engine sized its share, so they count in the train phase and beside
  the engine's share while it generates (`MemoryEstimate.generation_phase_gib`: trainer resident + engine share +
  the engine's processes, at most the whole GPU), not in the memory the engine starts with.
- not counted: the vision tower's activations (its patches are 4x its image tokens; the layers above count the
  image tokens only) and the allocator's fragmentation, which is why a GPU counts as full at `FIT_FRACTION` of its
  memory; plus `TRAINER_RUNTIME_GIB` outside PyTorch (CUDA context, NCCL, cuBLAS workspaces).

Calibrated on the two one-GPU runs of the 2B model (docs/gpu-runs/2026-11-23-loop-2b-h100, -2b-oom-h100): with full
recompute the train rank peaked at 54.4 GiB (estimate 55.6 + 3); without recompute it had 70.2 GiB allocated, 2.8
GiB outside PyTorch and the released engine's two processes 2.1 GiB, and ran out asking 2.3 GiB more (estimate
69.5 + 3 + 2).

An SGLang engine (`rollout.gpus_per_engine` = g GPUs, TP g) takes `mem_fraction_static` of the GPU memory that is
free when it starts for its weights (`2 * P / g`, bf16) and its KV cache (the rest); K and V of a token take
`2 * 2 * L * kv_heads/g * head_dim` bytes a GPU (kv heads replicated when g exceeds them). Colocated, the trainer
starts first and keeps its weights, gradients and optimizer state while the engines generate, so free = the GPU
less that; when an engine has released its memory for training its processes keep `RELEASED_ENGINE_GIB`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from miles_vl.config import JobConfig
from miles_vl.models.qwen3_vl.shapes import ModelShape, hf_config_dict, model_shape
from miles_vl.rollout.weight_sync import DEFAULT_BUCKET_BYTES, IPC_SYNC_BUFFERS
from miles_vl.train.megatron.step import max_train_logits_rows

GIB = 1024**3
FIT_FRACTION = 0.9  # of a GPU's memory: what the estimate may use; the rest is the allocator's fragmentation
TRAINER_RUNTIME_GIB = 3.0  # outside PyTorch in a train rank (2.8 GiB measured on an H100)
RELEASED_ENGINE_GIB = 2.0  # a colocated SGLang engine's processes after releasing their memory (2.1 GiB measured)
LOGIT_BYTES = 16  # bytes per vocabulary entry and token in the loss (module docstring)
HOST_OPTIMIZER_BYTES = 16  # per offloaded parameter: fp32 main weight, two fp32 moments, pinned fp32 gradient


@dataclass(frozen=True)
class TrainerMemory:
    """One train rank's memory, GiB (the module docstring says how each is computed)."""

    weights: float
    gradients: float
    optimizer: float
    activations: float  # the decoder layers' (module docstring)
    logits: float
    runtime: float = TRAINER_RUNTIME_GIB
    host_optimizer: float = 0.0  # the optimizer state offloaded to host memory (train.optimizer.cpu_offload)
    sync_buffers: float = 0.0  # the colocated IPC sync's two bucket buffers (module docstring)

    @property
    def resident_at_start(self) -> float:
        """What the trainer holds on the GPU when a colocated engine starts (the sync's buffers come at the first
        sync)."""
        return self.weights + self.gradients + self.optimizer + self.runtime

    @property
    def resident(self) -> float:
        """What stays on the GPU between train phases (colocated engines generate beside it)."""
        return self.resident_at_start + self.sync_buffers

    @property
    def peak(self) -> float:
        return self.resident + self.activations + self.logits


@dataclass(frozen=True)
class EngineMemory:
    """One GPU of an SGLang engine, GiB, and the KV cache in tokens of the whole engine."""

    share: float  # mem_fraction_static * free memory at start: weights + KV cache
    weights: float
    kv_cache: float  # share - weights (negative: the weights do not fit the share)
    kv_tokens: int  # the whole engine's KV cache, tokens
    step_tokens: int  # what its share of one step's samples would hold at full length at once

    @property
    def no_share(self) -> bool:
        """Nothing was free when the engine started (a colocated trainer's resident state filled the GPU)."""
        return self.share <= 0


def trainer_memory(
    shape: ModelShape,
    *,
    num_gpus: int,
    tp: int,
    pp: int,
    cp: int,
    ep: int,
    sp: bool,
    micro_batch_max_tokens: int,
    recompute: str,
    recompute_layers: int | None = None,
    freeze_vision: bool = False,
    bf16: bool = True,
    distributed_optimizer: bool = True,
    cpu_offload: float = 0.0,
    logits_only_where_loss: bool = False,
) -> TrainerMemory:
    """One Megatron train rank's memory (module docstring: the formulas and what they leave out); `cpu_offload` is
    the fraction of the rank's optimizer state on the host."""
    weight_bytes = 2 if bf16 else 4
    dense, experts = shape.params - shape.expert_params, shape.expert_params
    local = dense / (tp * pp) + experts / (ep * tp * pp)  # parameters a rank holds
    trainable_local = local - (shape.vision_params / (tp * pp) if freeze_vision else 0)
    trainable = shape.params - (shape.vision_params if freeze_vision else 0)
    optimizer_bytes = 12 if bf16 else 8
    state_params = trainable / num_gpus if distributed_optimizer else trainable_local  # this rank's optimizer shard
    optimizer = (1 - cpu_offload) * optimizer_bytes * state_params
    host_optimizer = cpu_offload * HOST_OPTIMIZER_BYTES * state_params
    tokens = micro_batch_max_tokens / cp
    h_split = tp if sp else 1
    per_layer_token = 8 * shape.hidden / h_split + 6 * (shape.q_dim + shape.kv_dim + shape.mlp_dim) / tp
    logit_rows = min(tokens, max_train_logits_rows(shape.vocab, tp)) if logits_only_where_loss else tokens
    if recompute in ("full", "language"):  # the vision tower's activations are not counted either way
        # recomputed layers (all, or recompute_layers of each of the p stages' L/p) keep their input; the rest their
        # full set; one recomputed layer's full set while it runs again
        recomputed = shape.layers if recompute_layers is None else min(pp * recompute_layers, shape.layers)
        kept = shape.layers - recomputed
        layers = tokens * (recomputed * 2 * shape.hidden / h_split + kept * per_layer_token + per_layer_token)
    else:
        layers = shape.layers * tokens * per_layer_token
    return TrainerMemory(
        weights=weight_bytes * local / GIB,
        gradients=4 * trainable_local / GIB,
        optimizer=optimizer / GIB,
        activations=layers / GIB,
        logits=logit_rows * shape.vocab / tp * LOGIT_BYTES / GIB,
        host_optimizer=host_optimizer / GIB,
    )


def ipc_sync_buffers(shape: ModelShape) -> int:
    """Bytes of the colocated IPC sync's buffers on a GPU that hosts a server's TP rank (module docstring)."""
    largest = 2 * shape.vocab * shape.hidden  # bf16: the embedding (and an untied output layer)
    return IPC_SYNC_BUFFERS * max(DEFAULT_BUCKET_BYTES, largest)


def engine_memory(
    shape: ModelShape,
    *,
    gpus_per_engine: int,
    mem_fraction_static: float,
    free_gib: float,
    samples: int,
    sample_len: int,
) -> EngineMemory:
    """One GPU of an SGLang engine of `gpus_per_engine` (TP) GPUs that starts with `free_gib` free on each, and what
    its KV cache holds against `samples` sequences of `sample_len` tokens (module docstring)."""
    share = mem_fraction_static * max(free_gib, 0.0)  # nothing free: no share (SGLang refuses to start)
    weights = 2 * shape.params / gpus_per_engine / GIB
    kv_heads = max(shape.kv_heads // gpus_per_engine, 1)
    kv_token_bytes = 2 * 2 * shape.layers * kv_heads * shape.head_dim  # K and V, bf16, on one GPU
    kv = share - weights
    return EngineMemory(
        share=share,
        weights=weights,
        kv_cache=kv,
        kv_tokens=max(int(kv * GIB / kv_token_bytes), 0),
        step_tokens=samples * sample_len,
    )


@dataclass(frozen=True)
class MemoryEstimate:
    """A job's memory per GPU: the trainer's and an engine's (None where that side is not megatron / sglang)."""

    gpu_gib: float
    colocated: bool
    trainer: TrainerMemory | None
    engine: EngineMemory | None
    source: str  # where the model's shape came from

    def generation_phase_gib(self) -> float | None:
        """A colocated GPU while its engine generates: the trainer's resident state (the IPC sync's buffers, made at
        the first sync, included), the engine's share (sized at its start, before them) and its processes; None
        when the job is not colocated with both sides on the GPU."""
        if not (self.colocated and self.trainer and self.engine):
            return None
        return self.trainer.resident + self.engine.share + RELEASED_ENGINE_GIB

    def train_phase_gib(self) -> float:
        """The fullest GPU while the trainer runs (a colocated engine's released processes beside it)."""
        assert self.trainer is not None
        return self.trainer.peak + (RELEASED_ENGINE_GIB if self.colocated and self.engine else 0.0)

    def problems(self) -> list[str]:
        """Why the job would not fit, one message each (what, found, the limit, the fixes)."""
        out: list[str] = []
        limit = FIT_FRACTION * self.gpu_gib
        if self.trainer is not None and self.train_phase_gib() > limit:
            out.append(
                f"the trainer needs about {self.train_phase_gib():.1f} GiB per GPU, more than {limit:.1f} GiB "
                f"({FIT_FRACTION:.0%} of {self.gpu_gib:g} GiB): set train.recompute=full (train.recompute_layers "
                "null or larger), lower train.micro_batch_max_tokens, or raise train.tp / train.cp / train.num_gpus"
            )
        generating = self.generation_phase_gib()
        no_share = self.engine is not None and self.engine.no_share  # its own problem below
        if generating is not None and generating > self.gpu_gib and not no_share:
            out.append(
                f"while the engines generate, a GPU holds the trainer's resident state and an engine's share: about "
                f"{generating:.1f} GiB, more than the GPU's {self.gpu_gib:g} GiB (the engine sized its share before "
                f"the weight sync's buffers of {self.trainer.sync_buffers:.1f} GiB existed): lower "
                "rollout.sglang.mem_fraction_static, or set rollout.sglang.colocated_sync=tensor"
            )
        if no_share:
            assert self.trainer is not None  # only a colocated trainer leaves an engine nothing
            out.append(
                f"a colocated SGLang engine finds no free memory: the trainer keeps about "
                f"{self.trainer.resident_at_start:.1f} GiB per GPU between its steps, the GPU has {self.gpu_gib:g} "
                "GiB: offload the optimizer (train.optimizer.cpu_offload), raise train.tp / train.num_gpus, or place "
                "the engines on GPUs of their own (ray.placement=disaggregate)"
            )
        elif self.engine is not None and self.engine.kv_cache <= 0:
            out.append(
                f"an SGLang engine's weights ({self.engine.weights:.1f} GiB per GPU) do not fit its share "
                f"({self.engine.share:.1f} GiB = rollout.sglang.mem_fraction_static of the free memory): raise "
                "rollout.sglang.mem_fraction_static or rollout.gpus_per_engine"
            )
        return out

    def lines(self) -> list[str]:
        """The estimate as text lines, for `miles-vl check`."""
        out = [f"model shape: {self.source}"]
        if (t := self.trainer) is not None:
            out.append(
                f"trainer, per GPU: weights {t.weights:.1f} + gradients {t.gradients:.1f} "
                f"+ optimizer {t.optimizer:.1f} + activations {t.activations:.1f} + logits {t.logits:.1f} "
                f"+ CUDA/NCCL {t.runtime:.1f}"
                + (f" + weight-sync buffers {t.sync_buffers:.1f}" if t.sync_buffers else "")
                + (f" + released engine {RELEASED_ENGINE_GIB:.1f}" if self.colocated and self.engine else "")
                + f" = {self.train_phase_gib():.1f} GiB"
            )
            if t.host_optimizer:
                out.append(
                    f"trainer, host memory per train rank: optimizer state {t.host_optimizer:.1f} GiB "
                    "(train.optimizer.cpu_offload; not in the GPU figures)"
                )
        if (e := self.engine) is not None:
            held = e.kv_tokens / e.step_tokens if e.step_tokens else 0.0
            if e.no_share:
                out.append("engine, per GPU: no free memory beside the trainer's resident state: no share")
            else:
                out.append(
                    f"engine, per GPU: share {e.share:.1f} GiB (mem_fraction_static of the free memory"
                    + (
                        ", beside the trainer's weights, gradients and optimizer state"
                        if self.colocated and self.trainer
                        else ""
                    )
                    + f") = weights {e.weights:.1f} + KV cache {max(e.kv_cache, 0):.1f}; the engine's KV cache holds "
                    f"{e.kv_tokens} tokens, {held:.0%} of its samples of a step at full length"
                )
        if (generating := self.generation_phase_gib()) is not None:
            out.append(
                f"while generating, per colocated GPU: trainer resident {self.trainer.resident:.1f} + engine share "
                f"{self.engine.share:.1f} + its processes {RELEASED_ENGINE_GIB:.1f} = {generating:.1f} GiB"
            )
        fits = not self.problems()
        out.append(
            f"fits {self.gpu_gib:g} GiB GPUs: {'yes' if fits else 'NO'} "
            "(an estimate: see miles_vl/orchestration/memory.py)"
        )
        return out


def estimate_memory(cfg: JobConfig, gpu_gib: float) -> MemoryEstimate | str:
    """The memory estimate of `cfg` on GPUs of `gpu_gib` GiB, or why there is none (a CPU job, an unknown shape)."""
    t, r = cfg.train, cfg.rollout
    megatron, sglang = t.backend == "megatron", r.backend == "sglang"
    if not (megatron or sglang):
        return "no GPU in this job (train.backend torch, rollout.backend hf)"
    if cfg.model.path is None:
        return "model.path is unset (a random-init model)"
    try:
        config, source = hf_config_dict(cfg.model.path)
        if config is None:
            return f"the model's shape is unknown: {source}"
        shape = model_shape(config)
    except (OSError, ValueError) as e:  # an unreadable or foreign config.json: no estimate, `check` goes on
        return f"the model's shape could not be read from {cfg.model.path}: {e}"
    colocated = cfg.ray.placement == "colocate"
    trainer = None
    if megatron:
        trainer = trainer_memory(
            shape,
            num_gpus=t.num_gpus,
            tp=t.tp,
            pp=t.pp,
            cp=t.cp,
            ep=t.ep,
            sp=t.sp,
            micro_batch_max_tokens=t.micro_batch_max_tokens,
            recompute=t.recompute,
            recompute_layers=t.recompute_layers,
            freeze_vision=t.freeze_vision,
            bf16=cfg.model.dtype != "fp32",  # auto is bf16 on GPUs
            cpu_offload=t.optimizer.cpu_offload,
            logits_only_where_loss=t.logits_only_where_loss,
        )
        if sglang and colocated and r.sglang.colocated_sync == "ipc":
            trainer = replace(trainer, sync_buffers=ipc_sync_buffers(shape) / GIB)
    engine = None
    if sglang:
        free = gpu_gib - (trainer.resident_at_start if colocated and trainer else 0.0)
        engine = engine_memory(
            shape,
            gpus_per_engine=r.gpus_per_engine,
            mem_fraction_static=r.sglang.mem_fraction_static,
            free_gib=free,
            samples=math.ceil(cfg.samples_per_step / r.num_engines),
            sample_len=cfg.data.max_prompt_len + r.max_response_len,
        )
    return MemoryEstimate(gpu_gib=gpu_gib, colocated=colocated, trainer=trainer, engine=engine, source=source)
