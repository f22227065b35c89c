"""Training throughput of the embedded `torch` backend on one GPU: packed THD micro-batches vs padded batches.

    PYTHONPATH=. python benchmarks/bench_train_throughput.py [--max-tokens 8192] [--prompts 8] [--steps 4]
    PYTHONPATH=. python benchmarks/bench_train_throughput.py --variants packed,padded,packed_sdpa
    PYTHONPATH=. python benchmarks/bench_train_throughput.py --profile   # one packed step under torch.profiler
    PYTHONPATH=. python benchmarks/bench_train_throughput.py --tiny      # CPU smoke run of the same code, seconds

Model: random-init Qwen3-VL with the real Qwen3-VL-2B shapes (`qwen3_vl_2b_config`), bf16 on the GPU, AdamW over
every parameter (vision tower included). Samples: geo3k-like GRPO groups (`geo3k_prompts`): `--n-per-prompt`
responses per prompt, one image of 150-250 vision tokens per prompt, ~350 prompt tokens, response lengths uniform
in 50..650. Every variant trains on the same mini-batches with the same model and optimizer; one optimizer step per
mini-batch of `--prompts * --n-per-prompt` samples:

- `packed`: `TorchTrainBackend.accumulate_gradients` (FFD micro-batches under `--max-tokens`, `pack_thd`, the packed
  forward of `miles_vl.models.qwen3_vl.forward`, the policy loss, backward), then gradient clipping and AdamW, as
  `miles_vl.train.train_step` steps. The text attention runs `flex_attention`: transformers turns the restarting
  segment-local text positions into a BlockMask, so blocks across segments are skipped. If flex fails, sdpa.
- `padded`: the same samples in arrival order, grouped greedily so that B * Lmax <= `--max-tokens`, right-padded,
  through the standard `Qwen3VLModel` forward with an attention_mask (sdpa), then the same chunked logprobs, loss,
  clipping and AdamW.
- `packed_sdpa`: `packed` with sdpa, where transformers materializes a dense [T, T] block-diagonal mask and the
  kernel computes every block: shows what flex saves.
- `packed+logits`, `packed+vision_once` (issue 33's levers, combinable: `packed+logits+vision_once`): the backend with
  `logits_only_where_loss` (the lm_head on the loss positions only) or `vision_once_per_image` (the vision tower once
  per distinct image of a micro-batch).
- `<variant>+nocudnn`: the same with PyTorch's cuDNN SDPA backend disabled. On H100 it is picked for the vision
  tower's per-image attention calls and costs ~0.4 ms of host time per backward call (seen in `--profile`), which
  leaves the GPU idle; sdpa then uses the flash / memory-efficient kernels.

Throughput counts real tokens only (pads excluded): sum of sample lengths / step time, over `--steps` timed steps
after `--warmup` steps (flex compiles during warm-up). FLOPs per step, useful work only (so MFU compares variants):

    6 * N_text * sum_i L_i                                 dense text matmuls, fwd + bwd (N_text includes the tied
                                                           embedding once: that is the lm_head matmul)
  + 6 * n_layers * n_heads * head_dim * sum_i L_i^2        causal attention: QK^T + PV = 4 L^2 d fwd, halved by the
                                                           causal mask, x3 for fwd + bwd
  + 6 * N_vit * sum_i P_i + 6 * N_merger * sum_i P_i / 4   vision blocks on P_i patches; the mergers (main and
                                                           deepstack) on the merged P_i / 4 tokens
  + 12 * depth_v * hidden_v * sum_i P_i^2                  bidirectional vision attention per image, fwd + bwd

MFU = FLOPs / step time / dense bf16 peak (989.4 TFLOP/s for H100 SXM and H200). Default budget 8192 tokens (the
backend's default): activations (saved-tensor hooks, CPU) are ~3.0 MiB per text token (110 KiB per token and layer)
plus ~0.94 MiB per image patch, and the H100 run peaked at 58.7 GiB with 8192 (~17 GiB of it bf16 weights, gradients
and AdamW state), so 16384 tokens (~100 GiB) does not fit 80 GB without activation checkpointing, which the backend
does not use. Last stdout line: one JSON object with the settings and results.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from miles_vl.algo import policy_loss
from miles_vl.models import SpecialTokens
from miles_vl.models.qwen3_vl.forward import packed_hidden_states
from miles_vl.models.qwen3_vl.model import tiny_config
from miles_vl.models.qwen3_vl.tokens import vision_token_ids
from miles_vl.packing import pack_thd, plan_micro_batches
from miles_vl.train import LossOptions, OptimizerOptions, TorchTrainBackend, TrainOptions, TrainSample
from miles_vl.train.types import MiniBatch

# Qwen3-VL processor ids (vocabulary 151936).
IMAGE, VIDEO, VSTART, VEND, PAD, EOS = 151655, 151656, 151652, 151653, 151643, 151645
TOKENS = SpecialTokens(IMAGE, VIDEO, VSTART, VEND, PAD, (EOS, PAD), vocab_size=151936)
PATCH_DIM = 3 * 2 * 16 * 16  # channels * temporal patch * patch * patch
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4}  # dense, SXM datasheets


# -------------------------------------------------------------------------------------------------------------------
# model and data (bench_decode.py imports these)


def qwen3_vl_2b_config(tokens: SpecialTokens = TOKENS) -> Qwen3VLConfig:
    """The Qwen3-VL-2B-Instruct architecture (its config.json shapes), for random init."""
    text = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16)
    vision = dict(depth=24, hidden_size=1024, intermediate_size=4096, out_hidden_size=2048)
    return _qwen3_vl_config(tokens, text, vision, deepstack=[5, 11, 17], tied=True)


def qwen3_vl_8b_config(tokens: SpecialTokens = TOKENS) -> Qwen3VLConfig:
    """The Qwen3-VL-8B-Instruct architecture (its config.json shapes), for random init: 8.77B parameters (text 8.19B
    with an untied lm_head, vision tower 0.58B)."""
    text = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32)
    vision = dict(depth=27, hidden_size=1152, intermediate_size=4304, out_hidden_size=4096)
    return _qwen3_vl_config(tokens, text, vision, deepstack=[8, 16, 24], tied=False)


def _qwen3_vl_config(
    tokens: SpecialTokens, text: dict, vision: dict, deepstack: list[int], tied: bool
) -> Qwen3VLConfig:
    """A Qwen3-VL configuration of the released family: the sizes given, the rest as every released dense model has
    it (8 KV heads of 128, interleaved MRoPE 24/20/20 at theta 5e6, a 16-pixel patch merged 2 x 2, 16 vision heads)."""
    return Qwen3VLConfig(
        text_config=dict(
            vocab_size=tokens.vocab_size,
            **text,
            num_key_value_heads=8,
            head_dim=128,
            hidden_act="silu",
            max_position_embeddings=262144,
            rms_norm_eps=1e-6,
            rope_parameters=dict(
                rope_type="default", rope_theta=5_000_000.0, mrope_section=[24, 20, 20], mrope_interleaved=True
            ),
            tie_word_embeddings=tied,
            pad_token_id=tokens.pad_token_id,
        ),
        vision_config=dict(
            **vision,
            num_heads=16,
            hidden_act="gelu_pytorch_tanh",
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
            num_position_embeddings=2304,
            deepstack_visual_indexes=deepstack,
        ),
        image_token_id=tokens.image_token_id,
        video_token_id=tokens.video_token_id,
        vision_start_token_id=tokens.vision_start_token_id,
        vision_end_token_id=tokens.vision_end_token_id,
        tie_word_embeddings=tied,
    )


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def build(tiny: bool, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Qwen3VLForConditionalGeneration:
    """Random-init model built directly on `device` (a 2B fp32 init on the CPU would take most of a minute)."""
    cfg = tiny_config(TOKENS, **TINY) if tiny else qwen3_vl_2b_config()
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3VLForConditionalGeneration(cfg)
    model = model.to(dtype)
    model.config._attn_implementation = "sdpa"  # as build_model does; sub-configs follow
    return model


@dataclass
class Prompt:
    """A canonical geo3k-like prompt (satisfies `PromptLike`)."""

    prompt_ids: Tensor  # [L] long
    pixel_values: Tensor  # [4 * n_vision, 1536]
    image_grid_thw: Tensor  # [1, 3]
    pixel_values_videos: Tensor | None = None  # no videos
    video_grid_thw: Tensor | None = None


def geo3k_prompts(
    n: int, *, seed: int, vision_tokens: tuple[int, int] = (150, 250), tail: tuple[int, int] = (80, 180)
) -> list[Prompt]:
    """n prompts: ~20 template tokens, <vision_start>, one image of `vision_tokens` merged tokens, <vision_end>,
    `tail` question tokens (~350 tokens in all with the defaults). Random pixels (never zeros)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    out = []
    for _ in range(n):
        lo, hi = vision_tokens
        mh = rnd(max(1, math.isqrt(lo) - 2), math.isqrt(hi) + 2)  # merged grid rows
        mw = rnd(max(1, -(-lo // mh)), max(1, hi // mh))  # merged grid cols: mh * mw in [lo, hi]
        n_vision = mh * mw
        ids = (
            torch.randint(10, 150000, (rnd(15, 25),), generator=g).tolist()
            + [VSTART]
            + [IMAGE] * n_vision
            + [VEND]
            + torch.randint(10, 150000, (rnd(*tail),), generator=g).tolist()
        )
        pixels = torch.randn(4 * n_vision, PATCH_DIM, generator=g)
        out.append(Prompt(torch.tensor(ids), pixels, torch.tensor([[1, 2 * mh, 2 * mw]])))
    return out


def grpo_samples(
    prompts: list[Prompt], n_per_prompt: int, *, seed: int, response: tuple[int, int], device: torch.device
) -> list[TrainSample]:
    """`n_per_prompt` responses per prompt with uniform lengths in `response`, GRPO-like advantages, and rollout
    logprobs near a random model's (-log V), so that the PPO ratio stays near 1 and every step is finite."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for p in prompts:
        pixels = p.pixel_values.to(device, torch.bfloat16)  # on the device already: no copy inside the timing
        for _ in range(n_per_prompt):
            r = int(torch.randint(response[0], response[1] + 1, (1,), generator=g))
            resp = torch.randint(10, 150000, (r,), generator=g)
            out.append(
                TrainSample(
                    input_ids=torch.cat([p.prompt_ids, resp]),
                    prompt_len=p.prompt_ids.numel(),
                    advantage=float(torch.randn((), generator=g)),
                    rollout_logprobs=-math.log(TOKENS.vocab_size) + 0.1 * torch.randn(r, generator=g),
                    image_grid_thw=p.image_grid_thw,
                    pixel_values=pixels,
                )
            )
    return out


# -------------------------------------------------------------------------------------------------------------------
# FLOPs


def flops_per_step(model: Qwen3VLForConditionalGeneration, samples: list[TrainSample]) -> float:
    """Useful training FLOPs of one optimizer step over `samples` (module docstring for the formula)."""
    text_cfg, vis_cfg = model.config.text_config, model.config.vision_config
    visual = model.model.visual
    n_vision = sum(p.numel() for p in visual.parameters())
    n_merger = sum(p.numel() for m in [visual.merger, *visual.deepstack_merger_list] for p in m.parameters())
    n_pos = visual.pos_embed.weight.numel()  # an embedding table: no matmul
    n_text = sum(p.numel() for p in model.model.language_model.parameters())
    if model.lm_head.weight is not model.model.language_model.embed_tokens.weight:
        n_text += model.lm_head.weight.numel()
    lengths = torch.tensor([s.input_ids.numel() for s in samples], dtype=torch.float64)
    patches = torch.tensor([int(s.image_grid_thw.prod()) for s in samples], dtype=torch.float64)
    attn_dim = text_cfg.num_attention_heads * text_cfg.head_dim
    return float(
        6 * n_text * lengths.sum()
        + 6 * text_cfg.num_hidden_layers * attn_dim * (lengths**2).sum()
        + 6 * (n_vision - n_merger - n_pos) * patches.sum()
        + 6 * n_merger * patches.sum() / 4
        + 12 * vis_cfg.depth * vis_cfg.hidden_size * (patches**2).sum()
    )


# -------------------------------------------------------------------------------------------------------------------
# the two training paths


def set_text_attention(model: Qwen3VLForConditionalGeneration, impl: str) -> None:
    """Attention implementation of the language model only (the vision tower stays on sdpa)."""
    model.config.text_config._attn_implementation = impl
    found = model.model.language_model.layers[0].self_attn.config._attn_implementation
    assert found == impl, f"the text layers read {found}, not {impl}"


@torch.no_grad()
def flex_vs_sdpa_error(model: Qwen3VLForConditionalGeneration, samples: list[TrainSample], max_tokens: int) -> float:
    """||h_flex - h_sdpa|| / ||h_sdpa|| of the final hidden states of the first packed micro-batch."""
    plan = plan_micro_batches([s.input_ids.numel() for s in samples], max_tokens)
    first = [samples[i] for i in plan.micro_batches[0]]
    packed = pack_thd(
        first,
        cp_size=1,
        pad_token_id=TOKENS.pad_token_id,
        spatial_merge_size=2,
        image_token_id=TOKENS.image_token_id,
        video_token_id=TOKENS.video_token_id,
        vision_start_token_id=TOKENS.vision_start_token_id,
    )
    pixels = torch.cat([s.pixel_values for s in first])
    out = {}
    for impl in ("sdpa", "flex_attention"):
        set_text_attention(model, impl)
        out[impl] = packed_hidden_states(model, packed, pixels).float()
    return float((out["flex_attention"] - out["sdpa"]).norm() / out["sdpa"].norm())


@dataclass
class StepStats:
    real_tokens: int  # sum of sample lengths
    row_tokens: int  # tokens the model ran on (packed rows, or B * Lmax per padded micro-batch)
    micro_batches: int


def finish_step(backend: TorchTrainBackend) -> None:
    norm = torch.nn.utils.clip_grad_norm_(backend.trainable, backend.options.optimizer.grad_clip)
    if not torch.isfinite(norm):
        raise RuntimeError(f"non-finite gradient norm {float(norm)}: the benchmark would time a skipped step")
    backend.optimizer.step()
    backend.optimizer.zero_grad(set_to_none=True)


def packed_step(backend: TorchTrainBackend, samples: list[TrainSample]) -> StepStats:
    """One optimizer step through the backend's own packed path (as `miles_vl.train.train_step`)."""
    old = [s.rollout_logprobs for s in samples]
    _, row_tokens, finite, n_micro = backend.accumulate_gradients(MiniBatch(samples, list(range(len(samples))), old))
    if not finite:
        raise RuntimeError("non-finite loss in the packed path")
    finish_step(backend)
    return StepStats(sum(s.input_ids.numel() for s in samples), row_tokens, n_micro)


def padded_groups(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Consecutive samples (arrival order) while B * Lmax fits `max_tokens`."""
    groups: list[list[int]] = []
    longest = 0
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise ValueError(f"sample {i} has {n} tokens, over the budget {max_tokens}")
        if groups and (len(groups[-1]) + 1) * max(longest, n) <= max_tokens:
            groups[-1].append(i)
            longest = max(longest, n)
        else:
            groups.append([i])
            longest = n
    return groups


def chunked_label_logprobs(model, hidden: Tensor, labels: Tensor, banned: Tensor, chunk: int = 4096) -> Tensor:
    """[N] log-softmax of `labels` under lm_head(hidden [N, H]), in chunks: the loop of `label_logprobs`."""
    out = []
    for start in range(0, hidden.shape[0], chunk):
        logits = model.lm_head(hidden[start : start + chunk]).float()
        if banned.numel():
            logits = logits.index_fill(-1, banned, float("-inf"))
        logp = torch.log_softmax(logits, dim=-1)
        out.append(logp.gather(-1, labels[start : start + chunk, None]).squeeze(-1))
    return torch.cat(out)


def padded_step(backend: TorchTrainBackend, samples: list[TrainSample], max_tokens: int) -> StepStats:
    """One optimizer step on right-padded batches through the standard transformers forward (attention_mask)."""
    model, device = backend.model, backend.device
    backend.optimizer.zero_grad(set_to_none=True)
    banned = torch.tensor(backend.loss.suppress_token_ids, dtype=torch.long, device=device)
    n_loss = sum(s.response_len for s in samples)  # token_mean over the mini-batch
    groups = padded_groups([s.input_ids.numel() for s in samples], max_tokens)
    row_tokens = 0
    for group in groups:
        batch = [samples[i] for i in group]
        width = max(s.input_ids.numel() for s in batch)
        ids = torch.full((len(batch), width), TOKENS.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        label_mask = torch.zeros_like(ids, dtype=torch.bool)  # logits at j score the response token at j + 1
        for b, s in enumerate(batch):
            n = s.input_ids.numel()
            ids[b, :n] = s.input_ids
            mask[b, :n] = 1
            label_mask[b, s.prompt_len - 1 : n - 1] = True
        types = (ids == TOKENS.image_token_id).long() * mask  # mm_token_type_ids: 1 on image tokens
        labels = torch.cat([ids[:, 1:], ids.new_full((len(batch), 1), TOKENS.pad_token_id)], dim=1)
        out = model.model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            pixel_values=torch.cat([s.pixel_values for s in batch]).to(device),
            image_grid_thw=torch.cat([s.image_grid_thw for s in batch]).to(device),
            mm_token_type_ids=types.to(device),
            use_cache=False,
        )
        model.model.rope_deltas = None
        hidden = out.last_hidden_state.flatten(0, 1)  # [B * Lmax, H]: the lm_head runs on pads too, as usual
        logp = chunked_label_logprobs(model, hidden, labels.flatten().to(device), banned)
        pos = label_mask.flatten().nonzero().squeeze(1).to(device)  # row-major: each sample's responses in order
        old = torch.cat([s.rollout_logprobs for s in batch]).to(device)
        adv = torch.cat([torch.full((s.response_len,), s.advantage) for s in batch]).to(device)
        loss = policy_loss(
            logp[pos],
            old,
            adv,
            torch.full_like(old, 1.0 / n_loss),
            rollout_logprobs=old,
            clip_low=backend.loss.clip_low,
            clip_high=backend.loss.clip_high,
        ).loss
        if not torch.isfinite(loss):
            raise RuntimeError("non-finite loss in the padded path")
        loss.backward()
        row_tokens += ids.numel()
    finish_step(backend)
    return StepStats(sum(s.input_ids.numel() for s in samples), row_tokens, len(groups))


# -------------------------------------------------------------------------------------------------------------------
# timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_variant(step, batches, warmup: int, device: torch.device, flops: list[float], peak: float | None) -> dict:
    """Warm up on the first `warmup` mini-batches, time the rest one step each."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for b in batches[:warmup]:
        step(b)
    sync(device)
    warmup_s = time.perf_counter() - t0
    times, stats = [], []
    for b in batches[warmup:]:
        sync(device)
        t0 = time.perf_counter()
        stats.append(step(b))
        sync(device)
        times.append(time.perf_counter() - t0)
    real = sum(s.real_tokens for s in stats)
    rows = sum(s.row_tokens for s in stats)
    useful = sum(flops[warmup:])
    out = dict(
        tokens_per_s=round(real / sum(times), 1),
        step_s=[round(t, 3) for t in times],
        warmup_s=round(warmup_s, 1),
        real_tokens_per_step=real // len(stats),
        micro_batches_per_step=sum(s.micro_batches for s in stats) / len(stats),
        useful_token_fraction=round(real / rows, 4),
        achieved_tflops=round(useful / sum(times) / 1e12, 1),
        mfu=round(useful / sum(times) / (peak * 1e12), 4) if peak else None,
    )
    if device.type == "cuda":
        out["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return out


def profile_packed(backend: TorchTrainBackend, batches, device: torch.device, top: int = 25) -> None:
    """Where one packed optimizer step spends device time (after one warm-up step), as a table on stdout."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    set_text_attention(backend.model, "flex_attention" if device.type == "cuda" else "sdpa")  # no flex backward on CPU
    packed_step(backend, batches[0])
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        packed_step(backend, batches[1])
        sync(device)
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 1e6
    print(f"[profile] packed step: wall {wall:.3f} s, device busy {busy:.3f} s ({busy / wall:.0%})")
    for key in ("self_device_time_total", "self_cpu_time_total") if device.type == "cuda" else ("self_cpu_time_total",):
        print(events.table(sort_by=key, row_limit=top))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny model and samples (CPU smoke run)")
    ap.add_argument("--max-tokens", type=int, default=8192, help="micro-batch token budget (packed T, padded B*Lmax)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per optimizer step")
    ap.add_argument("--n-per-prompt", type=int, default=8)
    ap.add_argument("--response", type=int, nargs=2, default=(50, 650), help="response length range (uniform)")
    ap.add_argument("--steps", type=int, default=4, help="timed optimizer steps per variant")
    ap.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps per variant (flex compiles here)")
    ap.add_argument(
        "--variants",
        default="packed,padded,packed+nocudnn,padded+nocudnn",
        help="comma-separated: packed, padded, packed_sdpa, each optionally with +nocudnn; packed also with +logits, "
        "+vision_once",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="only profile one packed step (flex) and print the table")
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None) if device.type == "cuda" else None
    if args.tiny:
        args.max_tokens, args.prompts, args.n_per_prompt, args.response = 1024, 2, 2, (5, 40)
        vision, tail = (4, 9), (5, 20)
    else:
        vision, tail = (150, 250), (80, 180)

    model = build(args.tiny, device, dtype, args.seed)
    loss = LossOptions(suppress_token_ids=vision_token_ids(TOKENS))
    options = TrainOptions(OptimizerOptions(lr=1e-6), loss, micro_batch_max_tokens=args.max_tokens)
    backend = TorchTrainBackend(model, TOKENS, options)
    model.train()
    n_steps = args.warmup + args.steps
    batches = []
    for k in range(n_steps):
        prompts = geo3k_prompts(args.prompts, seed=args.seed * 1000 + k, vision_tokens=vision, tail=tail)
        batches.append(grpo_samples(prompts, args.n_per_prompt, seed=k, response=tuple(args.response), device=device))
    flops = [flops_per_step(model, b) for b in batches]
    all_samples = [s for b in batches for s in b]
    if args.profile:
        profile_packed(backend, batches, device)
        return

    results: dict[str, dict] = {}
    for variant in args.variants.split(","):
        path, *opts = variant.split("+")
        unknown = set(opts) - {"nocudnn", "logits", "vision_once"}
        if unknown or ({"logits", "vision_once"} & set(opts) and path != "packed"):
            raise ValueError(
                f"--variants: unknown option(s) {sorted(unknown) or opts} in {variant!r}; +nocudnn, and for packed "
                "+logits, +vision_once"
            )
        option = "nocudnn" if "nocudnn" in opts else ""
        torch.backends.cuda.enable_cudnn_sdp(option != "nocudnn")  # the vision tower's per-image sdpa calls
        backend.options = dataclasses.replace(
            options, logits_only_where_loss="logits" in opts, vision_once_per_image="vision_once" in opts
        )
        if path == "padded":
            set_text_attention(model, "sdpa")
            attn = "sdpa"

            def step(b):
                return padded_step(backend, b, args.max_tokens)

        elif path in ("packed", "packed_sdpa"):
            attn = "flex_attention" if path == "packed" else "sdpa"
            set_text_attention(model, attn)

            def step(b):
                return packed_step(backend, b)

        else:
            raise ValueError(f"--variants: unknown variant {variant!r}; use packed, padded, packed_sdpa (+nocudnn)")
        print(f"[{variant}] attention={attn} ...", flush=True)
        check = {}
        try:
            if attn == "flex_attention":  # same function as sdpa's dense mask? (also compiles the forward)
                check["flex_vs_sdpa_rel_err"] = round(flex_vs_sdpa_error(model, batches[0], args.max_tokens), 5)
                set_text_attention(model, attn)
            res = check | run_variant(step, batches, args.warmup, device, flops, peak)
        except torch.OutOfMemoryError as e:
            res = dict(error=f"out of memory: {str(e).splitlines()[0]}")
        except Exception as e:  # flex may fail to compile; the packed path then falls back to sdpa
            if attn != "flex_attention":
                raise
            print(f"[{variant}] flex_attention failed ({type(e).__name__}: {e}); falling back to sdpa", flush=True)
            attn = "sdpa"
            set_text_attention(model, attn)
            res = check | run_variant(step, batches, args.warmup, device, flops, peak)
            res["flex_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        backend.optimizer.zero_grad(set_to_none=True)
        res["attention"] = attn
        res["cudnn_sdpa"] = option != "nocudnn"
        results[variant] = res
        print(f"[{variant}] {json.dumps(res)}", flush=True)

    torch.backends.cuda.enable_cudnn_sdp(True)
    ratios = {}
    for suffix in ("", "+nocudnn"):
        packed, padded = results.get("packed" + suffix, {}), results.get("padded" + suffix, {})
        if "tokens_per_s" in packed and "tokens_per_s" in padded:
            ratios["packed_over_padded" + suffix] = round(packed["tokens_per_s"] / padded["tokens_per_s"], 3)
    ratio = next(iter(ratios.values()), None)
    text_cfg = model.config.text_config
    summary = dict(
        benchmark="train_throughput",
        device=name,
        dtype=str(dtype).removeprefix("torch."),
        model="tiny Qwen3-VL" if args.tiny else "Qwen3-VL-2B shapes, random init",
        params_total=sum(p.numel() for p in model.parameters()),
        params_vision=sum(p.numel() for p in model.model.visual.parameters()),
        text_layers=text_cfg.num_hidden_layers,
        max_tokens=args.max_tokens,
        samples_per_step=args.prompts * args.n_per_prompt,
        n_per_prompt=args.n_per_prompt,
        response_len=list(args.response),
        vision_tokens=list(vision),
        mean_sample_tokens=round(sum(s.input_ids.numel() for s in all_samples) / len(all_samples), 1),
        mean_patches=round(sum(int(s.image_grid_thw.prod()) for s in all_samples) / len(all_samples), 1),
        tflops_per_step=round(sum(flops) / len(flops) / 1e12, 2),
        warmup=args.warmup,
        steps=args.steps,
        peak_bf16_tflops=peak,
        torch=torch.__version__,
        transformers=__import__("transformers").__version__,
        variants=results,
        **ratios,
        goal_met=None if ratio is None else ratio >= 1.5,
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
