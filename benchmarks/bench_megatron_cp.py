"""Megatron (megatron-bridge Qwen3VLModel, Transformer Engine) training throughput and memory per layout and length:
CP=1, CP=2, CP=4, TP=2 x CP=2, each with and without `vision_dp_when_cp`, at 16K / 32K / 64K tokens.

    python benchmarks/bench_megatron_cp.py [--lengths 16384,32768,65536] [--images task] [--steps 2] [--gpus 2]
                                           [--layouts cp1,cp2] [--recompute none|full] [--timeout-s 540] [--out F]
                                           [--path bench|rl_loss|rl_step] [--response N] [--samples N] [--env K=V]
                                           [--logits-only-where-loss]
    bash benchmarks/megatron_cp_ladder.sh     # the whole ladder on 4 GPUs (docs/long_context.md)

Needs CUDA, Transformer Engine and megatron-bridge (inside scripts/gpu/stack.sh, or scripts/gpu_check.sh --bench).
Model: random-init Qwen3-VL-2B shapes (`bench_train_throughput.qwen3_vl_2b_config`) through the production path
`AutoBridge.from_hf_config(...).to_megatron_provider(load_weights=False)` + `miles_vl.patches.configure_provider`,
bf16, TE specs, megatron DDP (fp32 grad buffers); `--recompute full` recomputes every layer of both towers (the
setting of the GPU loop jobs; megatron-bridge's vision config copies it).

Samples: one long multimodal sample per packed row: images of 1024x1024 (4096 patches, 1024 vision tokens each) at
the start, the rest text; total length L from `--lengths`. `--images task` (default) puts as many images as the
`many_images` task's prompt of that length holds (15 / 31 / 62 at 16K / 32K / 64K: nearly all vision tokens), an int
that many. Layouts (`LAYOUTS`: tp, cp, vision_dp_when_cp) over the launch's `--gpus` GPUs, the rest data parallel:

- `cp1`: every GPU runs its own sample of length L (the whole sample's activations on one GPU);
- `cp2`, `cp4`: one sample split over 2 / 4 GPUs (zigzag THD shards from `miles_vl.packing.pack_thd`, rank-local
  positions); `tp2cp2`: tensor parallel 2 inside each of 2 CP ranks (no sequence parallelism: `train.sp` is off by
  default);
- `_vdp` (`train.vision_dp_when_cp`): the vision tower's images split across the CP ranks instead of every rank
  encoding all of them.

One step = forward with next-token labels (megatron's vocab-parallel cross entropy), backward, DDP grad sync; timed
over `--steps` steps after one warm-up. Throughput counts real tokens processed by all GPUs per second (and per GPU);
peak memory is `torch.cuda.max_memory_allocated` per GPU (max over GPUs). A length that runs out of memory on any
rank is "oom" on all of them and the longer lengths of that layout are skipped ("skipped: oom at L"); the launch is
killed after `--timeout-s` and reports what it measured until then ("timeout" for the rest; exit 1). Last stdout
line: one JSON object (also appended to `--out`).

`--path` says what one step runs, to find what the RL job's train step does that this bench does not
(benchmarks/diagnose_cp_backward.py switches them on one at a time; docs/long_context.md):
- `bench` (default): the step above, the loss over the last `--response` tokens (default 1024);
- `rl_loss`: the RL job's loss on the same model: no labels to the model, its bf16 logits `[T/C, V]`
  (`fp32_output=False`), the rows of the response's label positions picked (`index_select`), label logprobs by
  `vocab_parallel_logprobs` with the vision tokens suppressed, the PPO loss at zero advantage (as the failing job's
  first step) through the backend's own `forward_step` / `train_loss_func` on a `pack_micro_batch` micro-batch with
  fp32 pixels and the vision input mask, then a plain backward;
- `rl_step`: the RL job's whole train step, `miles_vl.train.step.train_step` on a `MegatronTrainBackend` over this
  model: `--samples` samples of one prompt (its images, `--response` tokens each, one micro-batch each at a budget of
  the length), the old-logprob pass first (forward only, eval mode), megatron's pipeline schedule, the distributed
  optimizer (`build.optimizer_config`, DDP with `use_distributed_optimizer`) and its step.
`--logits-only-where-loss` (rl paths): `train.logits_only_where_loss`, the output layer runs on the hidden states of
the loss positions only, so no `[T/C, V]` logits (nor their gradient) exist in the train step. `--env KEY=VALUE`
(repeatable) sets a variable for both ranks from process start, e.g. the RL trainer's
`CUDA_DEVICE_MAX_CONNECTIONS=1` (trainer.py) and `NCCL_CUMEM_ENABLE=0` (gpu_env.nccl_peer_env).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_train_throughput import IMAGE, PAD, PATCH_DIM, VSTART, qwen3_vl_2b_config  # noqa: E402
from tests.gpu.nccl import run_ranks  # noqa: E402

VEND, VIDEO = 151653, 151656
GRID = (1, 64, 64)  # one 1024x1024 image: 64x64 patches of 16 px, 1024 merged tokens


def long_sample(length: int, images: int, seed: int, response: int = 1024):
    """A sample of exactly `length` tokens: `images` image blocks, then text. The response is the last `response`
    tokens, or fewer where the images leave less text: a vision block always lies whole inside the prompt (the packing
    refuses a block cut by the prompt's end)."""
    from dataclasses import dataclass

    @dataclass
    class Sample:
        input_ids: torch.Tensor
        image_grid_thw: torch.Tensor
        video_grid_thw: None
        prompt_len: int
        loss_mask: None = None

    g = torch.Generator().manual_seed(seed)
    n_vision = GRID[0] * GRID[1] * GRID[2] // 4
    ids: list[int] = []
    for _ in range(images):
        ids += [VSTART] + [IMAGE] * n_vision + [VEND]
    if len(ids) >= length:
        raise ValueError(f"--images {images} need {len(ids)} tokens, more than the length {length}")
    response = min(response, length - len(ids) - 1)  # at least one text token of prompt after the last image
    ids += torch.randint(0, 151000, (length - len(ids),), generator=g).tolist()
    grid = torch.tensor([GRID] * images)
    pixels = torch.randn(images * GRID[0] * GRID[1] * GRID[2], PATCH_DIM, generator=g)
    return Sample(torch.tensor(ids), grid, None, length - response), pixels


# name -> (tp, cp, vision_dp_when_cp); the rest of the GPUs of a launch is data parallel
LAYOUTS = {
    "cp1": (1, 1, False),
    "cp2": (1, 2, False),
    "cp2_vdp": (1, 2, True),
    "cp4": (1, 4, False),
    "cp4_vdp": (1, 4, True),
    "tp2cp2": (2, 2, False),
    "tp2cp2_vdp": (2, 2, True),
}


# what one step runs (module docstring)
PATHS = ("bench", "rl_loss", "rl_step")


def parse_env(items: list[str]) -> dict[str, str]:
    """`--env KEY=VALUE` items as a dict.

    Raises:
        ValueError: an item without `=` or with an empty key.
    """
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--env: KEY=VALUE, found {item!r}")
        env[key] = value
    return env


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (module docstring), checked: known layouts that fit --gpus, positive lengths.

    Raises:
        SystemExit: (argparse, exit 2) an unknown layout, a layout whose tp * cp does not divide --gpus, a bad length.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="16384,32768,65536", help="sample lengths in tokens, ascending")
    parser.add_argument(
        "--images",
        default="task",
        help="images per sample: an int, or `task` = the many_images task's count per length",
    )
    parser.add_argument(
        "--steps", type=int, default=2, help="timed steps per length, after one warm-up (0: the warm-up only)"
    )
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--layouts", default="cp1,cp2", help=f"which of {', '.join(LAYOUTS)} to run, in order")
    parser.add_argument("--recompute", choices=("none", "full"), default="none", help="activation recompute")
    parser.add_argument("--timeout-s", type=float, default=540.0, help="hard bound of the whole launch")
    parser.add_argument("--out", default=None, help="also append the JSON line to this file")
    parser.add_argument("--path", choices=PATHS, default="bench", help="what one step runs (module docstring)")
    parser.add_argument("--response", type=int, default=1024, help="response tokens of a sample (the loss's)")
    parser.add_argument("--samples", type=int, default=4, help="rl_step: samples of the prompt per step")
    parser.add_argument(
        "--logits-only-where-loss", action="store_true", help="rl paths: train.logits_only_where_loss (docstring)"
    )
    parser.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="an environment variable of both ranks"
    )
    args = parser.parse_args(argv)
    if args.steps < 0:
        parser.error(f"--steps must be >= 0, found {args.steps}")
    if args.logits_only_where_loss and args.path == "bench":
        parser.error("--logits-only-where-loss is an option of the RL paths (--path rl_loss or rl_step)")
    if args.response < 1 or args.samples < 1:
        parser.error(f"--response and --samples must be >= 1, found {args.response} and {args.samples}")
    try:
        args.env = parse_env(args.env)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        args.lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        parser.error(f"--lengths: comma-separated integers, found {args.lengths!r}")
    if any(n <= 0 for n in args.lengths) or args.lengths != sorted(args.lengths):
        parser.error(f"--lengths must be positive and ascending (a length that runs out of memory skips the longer "
                     f"ones), found {args.lengths}")  # fmt: skip
    args.layouts = args.layouts.split(",")
    if unknown := [name for name in args.layouts if name not in LAYOUTS]:
        parser.error(f"--layouts: unknown {unknown}; choose from {', '.join(LAYOUTS)}")
    for name in args.layouts:
        tp, cp, _ = LAYOUTS[name]
        if args.gpus % (tp * cp):
            parser.error(f"--layouts {name} needs tp * cp = {tp * cp} to divide --gpus {args.gpus}")
    if args.images != "task":
        try:
            args.images = int(args.images)
        except ValueError:
            parser.error(f"--images: an integer or `task`, found {args.images!r}")
    for length in args.lengths:
        images_for(length, args.images)  # an impossible length/images pair fails here, before any GPU work
    return args


def images_for(length: int, images: int | str) -> int:
    """Images of a sample of `length` tokens: `images`, or with "task" as many as the many_images task puts in a prompt
    of that length (`miles_vl.data.synth.many_images_count`: 1024 vision tokens each).

    Raises:
        SystemExit: the images do not fit the length.
    """
    from miles_vl.data.synth import many_images_count

    n = many_images_count(length) if images == "task" else images
    needed = n * (GRID[1] * GRID[2] // 4 + 2) + 1
    if needed > length:
        raise SystemExit(f"--images {n} need {needed} tokens, more than the length {length}; lower --images")
    return n


def build(tp: int, cp: int, vision_dp: bool = False, recompute: str = "none", distributed_optimizer: bool = False):
    """The model chunks (megatron DDP); `distributed_optimizer`: DDP as the RL backend builds it (build.py)."""
    from megatron.bridge import AutoBridge
    from megatron.core.distributed import DistributedDataParallelConfig

    from miles_vl.patches import install
    from miles_vl.patches.provider import configure_provider

    install()
    config = qwen3_vl_2b_config()
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    provider = AutoBridge.from_hf_config(config).to_megatron_provider(load_weights=False)
    provider.tensor_model_parallel_size = tp
    provider.pipeline_model_parallel_size = 1
    provider.bf16, provider.params_dtype = True, torch.bfloat16
    provider.gradient_accumulation_fusion = False  # needs APEX's fused_weight_gradient_mlp_cuda for the lm head
    if recompute == "full":  # as miles_vl/train/megatron/build.py; the vision tower copies these settings
        provider.recompute_granularity, provider.recompute_method, provider.recompute_num_layers = "full", "uniform", 1
    configure_provider(provider, cp_size=cp, vision_dp_when_cp=vision_dp)
    provider.finalize()
    ddp = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=distributed_optimizer,
        **({"average_in_collective": False, "check_for_nan_in_grad": False} if distributed_optimizer else {}),
    )
    return provider.provide_distributed_model(ddp_config=ddp, wrap_with_ddp=True, bf16=True)


TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART, vision_end_token_id=VEND)


def rl_samples(length: int, images: int, response: int, n: int):
    """`n` `TrainSample`s of one prompt as the RL job trains them: the same prompt and images (fp32 pixels, as the
    processor gives them), each its own response of `response` tokens, zero advantage (the failing job's first step:
    every group had one reward), the engine's logprobs zero."""
    from miles_vl.algo.samples import TrainSample

    sample, pixels = long_sample(length, images, seed=0, response=response)
    out = []
    for seed in range(n):
        ids = sample.input_ids.clone()
        g = torch.Generator().manual_seed(1000 + seed)
        ids[sample.prompt_len :] = torch.randint(0, 151000, (length - sample.prompt_len,), generator=g)
        out.append(
            TrainSample(
                input_ids=ids,
                prompt_len=sample.prompt_len,
                advantage=0.0,
                rollout_logprobs=torch.zeros(length - sample.prompt_len),
                image_grid_thw=sample.image_grid_thw,
                pixel_values=pixels,
            )
        )
    return out


def special_tokens():
    """The special tokens of the bench's samples (Qwen3-VL's ids; the vocabulary of the 2B shapes)."""
    from miles_vl.models import SpecialTokens

    return SpecialTokens(**TOKENS, pad_token_id=PAD, eos_token_ids=(PAD,), vocab_size=151936)


def rl_options(length: int, n_samples: int, response: int, where: bool = False):
    """The `TrainOptions` the RL job's backend gets (`factories.train_options` of `scripts/gpu/loop_job.py`'s long
    shape at `length`, tests/benchmarks checks it): AdamW at lr 1e-6, weight decay 0.01, clipping at 1; the PPO loss
    (clip 0.2 / 0.28, token mean, no KL, no TIS) scoring the distribution without the vision tokens; one micro-batch
    budget of `length`; all `n_samples` samples in one optimizer step; `where`: train.logits_only_where_loss."""
    from miles_vl.models.qwen3_vl.tokens import vision_token_ids
    from miles_vl.train.types import LossOptions, OptimizerOptions, TrainOptions

    return TrainOptions(
        optimizer=OptimizerOptions(lr=1e-6, weight_decay=0.01),
        # rollout.ban_vision_tokens (the default): the engine never samples them
        loss=LossOptions(max_response_len=response, suppress_token_ids=vision_token_ids(special_tokens())),
        micro_batch_max_tokens=length,
        global_batch_size=n_samples,
        logits_only_where_loss=where,
    )


def step_function(
    path: str, chunks: list, length: int, images: int, response: int, n_samples: int, seed: int, where: bool = False
):
    """One step of `path` (module docstring) on the model `chunks`, `where`: `--logits-only-where-loss`; (step, real
    tokens per step of this rank's DP group)."""
    from megatron.core import parallel_state as ps

    from miles_vl.packing import pack_thd
    from tests.patches.harness.runner import thd_params

    model = chunks[0]
    cp_rank, cp = ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()
    tokens = special_tokens()
    options = rl_options(length, n_samples, response, where)
    loss = options.loss
    if path == "bench":
        # DP ranks: each its own sample (seed by DP rank); a TP x CP group shares one sample
        sample, pixels = long_sample(length, images, seed=seed, response=response)
        batch = pack_thd(
            [sample], cp_size=cp, pad_token_id=PAD, spatial_merge_size=2, image_token_id=IMAGE,
            video_token_id=VIDEO, vision_start_token_id=VSTART,
        )  # fmt: skip
        shard = batch.shard(cp_rank)
        inputs = dict(
            input_ids=shard.input_ids.cuda(),
            position_ids=shard.position_ids.cuda(),
            labels=shard.labels.cuda(),
            packed_seq_params=thd_params(shard.cu_seqlens.cuda()),
            pixel_values=pixels.cuda().to(torch.bfloat16),
            image_grid_thw=batch.image_grid_thw.cuda(),
        )
        label_mask = shard.label_mask.cuda()

        def step() -> None:
            model.zero_grad_buffer()
            output = model(**inputs)
            out = output[0] if isinstance(output, tuple) else output  # [1, T/C] per-token loss
            (out.float() * label_mask).sum().backward()
            model.finish_grad_sync()

        return step, length
    if path == "rl_loss":
        from megatron.core.utils import get_model_config

        from miles_vl.algo import loss_denominators
        from miles_vl.train.megatron.batch import attach_loss_inputs, pack_micro_batch, sample_loss_tokens
        from miles_vl.train.megatron.parallel import ParallelGroups
        from miles_vl.train.megatron.plan import MicroBatchSpec
        from miles_vl.train.megatron.step import ForwardOptions, forward_step

        (sample,) = rl_samples(length, images, response, 1)
        groups = ParallelGroups.from_megatron()
        mb = pack_micro_batch(
            [sample], MicroBatchSpec([0]), tokens=tokens, spatial_merge_size=2, cp_size=cp, cp_rank=cp_rank
        )
        denominators = loss_denominators(torch.tensor([sample_loss_tokens(sample)]))
        mb = attach_loss_inputs(mb, [sample], None, None, denominators, reduction=loss.reduction)
        forward = ForwardOptions(
            mode="train", groups=groups, device=torch.device("cuda", torch.cuda.current_device()), loss=loss,
            samples=[sample], vocab_size=getattr(get_model_config(model), "vocab_size", None),  # as the backend
            token_norm=float(mb.packed.num_tokens),
            logits_only_where_loss=where, model_kwargs={"fp32_output": False},
        )  # fmt: skip

        def step() -> None:
            model.zero_grad_buffer()
            output, loss_func = forward_step(forward, iter([mb]), model)
            value, _, _ = loss_func(output)
            value.backward()
            model.finish_grad_sync()

        return step, length
    # rl_step: the backend build.py makes, on this model
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.utils import get_model_config

    from miles_vl.train.megatron.backend import MegatronTrainBackend
    from miles_vl.train.megatron.build import optimizer_config
    from miles_vl.train.step import train_step

    optimizer = get_megatron_optimizer(optimizer_config(options.optimizer, bf16=True), chunks)
    config = get_model_config(model)
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    backend = MegatronTrainBackend(chunks, optimizer, tokens, options)
    samples = rl_samples(length, images, response, n_samples)
    return (lambda: train_step(backend, samples)), length * n_samples // ps.get_data_parallel_world_size()


def job(
    ctx,
    lengths: list[int],
    images: int | str,
    steps: int,
    layouts: list[str],
    recompute: str,
    log_dir: str,
    path: str = "bench",
    response: int = 1024,
    n_samples: int = 4,
    where: bool = False,
):
    """Every layout, every length, on this rank; each result is also appended to `log_dir/rank{r}.jsonl` as soon as
    it is known, so that a launch killed by its time bound still reports what it measured."""
    from megatron.core import parallel_state as ps

    def record(key: str, value) -> None:
        out[key] = value
        with open(os.path.join(log_dir, f"rank{ctx.rank}.jsonl"), "a") as f:
            f.write(json.dumps({"key": key, "value": value}) + "\n")

    out: dict = {}
    for layout in layouts:
        tp, cp, vision_dp = LAYOUTS[layout]
        ctx.init_parallel(tp=tp, cp=cp)
        chunks = build(tp, cp, vision_dp, recompute, distributed_optimizer=path == "rl_step")
        dp = ps.get_data_parallel_world_size()
        failed_at = None
        for length in lengths:
            key = f"{layout}_L{length}"
            if failed_at is not None:  # longer than a length that ran out of memory: would too
                record(key, f"skipped: oom at {failed_at}")
                continue
            n_images = images_for(length, images)
            step, tokens = step_function(
                path, chunks, length, n_images, response, n_samples, seed=ps.get_data_parallel_rank(), where=where
            )
            oom = torch.zeros(1, device="cuda")
            try:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                times = []
                for i in range(steps + 1):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    step()
                    torch.cuda.synchronize()
                    if i:  # the first step warms up
                        times.append(time.perf_counter() - t0)
                result = {
                    "step_s": sum(times) / len(times) if times else None,
                    "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                    "tokens_per_step_all_gpus": tokens * dp,
                    "images": n_images,
                }
            except torch.OutOfMemoryError:
                oom += 1
                result = "oom"
            del step  # the step's inputs (and a failed step's tensors) before the next length
            for chunk in chunks:
                chunk.zero_grad_buffer()
            torch.cuda.empty_cache()
            torch.distributed.all_reduce(oom)  # every rank agrees: one rank out of memory fails the length for all
            if oom.item():
                result, failed_at = "oom", length
            record(key, result)
        del chunks
        torch.cuda.empty_cache()
    return out


def aggregate(per_rank: list[dict], lengths: list[int], layouts: list[str], gpus: int, missing: str) -> dict:
    """The results over ranks: per layout and length tokens/s (all GPUs) and per GPU, the step time of the slowest
    rank, the peak memory of the fullest; "oom" / "skipped: ..." as the ranks reported; `missing` (e.g. "timeout")
    for a length no rank reported. Then each layout's ratios to cp1 / its layout without vision_dp."""
    results: dict = {}
    for layout in layouts:
        tp, cp, _ = LAYOUTS[layout]
        for length in lengths:
            key = f"{layout}_L{length}"
            runs = [r[key] for r in per_rank if key in r]
            if not runs or len(runs) < len(per_rank):
                results[key] = missing
                continue
            if any(isinstance(r, str) for r in runs):
                results[key] = next(r for r in runs if isinstance(r, str))
                continue
            timed = all(r["step_s"] is not None for r in runs)  # --steps 0: the warm-up step only, not timed
            step_s = max(r["step_s"] for r in runs) if timed else None  # the slowest GPU sets the pace
            tokens_per_s = runs[0]["tokens_per_step_all_gpus"] / step_s if timed else None
            results[key] = {
                "tokens_per_s": round(tokens_per_s) if timed else None,
                "tokens_per_s_per_gpu": round(tokens_per_s / gpus) if timed else None,
                "step_s": round(step_s, 4) if timed else None,
                "peak_gib_per_gpu": round(max(r["peak_gib"] for r in runs), 2),
                "images": runs[0]["images"],
                "tp": tp,
                "cp": cp,
            }
    for length in lengths:
        for layout in layouts:
            base = "cp1" if not layout.endswith("_vdp") else layout.removesuffix("_vdp")
            a, b = results.get(f"{base}_L{length}"), results.get(f"{layout}_L{length}")
            if layout != base and isinstance(a, dict) and isinstance(b, dict) and a["step_s"] and b["step_s"]:
                results[f"L{length}_{layout}_over_{base}"] = {
                    "throughput_per_gpu": round(b["tokens_per_s_per_gpu"] / a["tokens_per_s_per_gpu"], 3),
                    "peak_memory": round(b["peak_gib_per_gpu"] / a["peak_gib_per_gpu"], 3),
                }
    return results


def read_partial(log_dir: str, world: int) -> list[dict]:
    """What each rank recorded before the launch ended (`job`'s per-rank files)."""
    per_rank = []
    for r in range(world):
        path = os.path.join(log_dir, f"rank{r}.jsonl")
        rows = open(path).read().splitlines() if os.path.exists(path) else []
        per_rank.append({row["key"]: row["value"] for row in map(json.loads, rows)})
    return per_rank


def main() -> None:
    import tempfile

    args = parse_args()
    os.environ.update(args.env)  # before the ranks start: NCCL and CUDA read some of them once per process
    error = None
    with tempfile.TemporaryDirectory() as log_dir:
        try:
            run_ranks(
                job,
                args.gpus,
                args=(
                    args.lengths,
                    args.images,
                    args.steps,
                    args.layouts,
                    args.recompute,
                    log_dir,
                    args.path,
                    args.response,
                    args.samples,
                    args.logits_only_where_loss,
                ),
                timeout_s=args.timeout_s,
            )
        except Exception as exc:  # noqa: BLE001  (a timeout or a rank's error: report what was measured)
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            print(str(exc), file=sys.stderr, flush=True)  # a rank's traceback: with CUDA_LAUNCH_BLOCKING=1, its op
        per_rank = read_partial(log_dir, args.gpus)
    missing = "timeout" if error and error.startswith("TimeoutError") else "error"
    line = json.dumps(
        {
            "bench": "megatron_cp",
            "gpu": torch.cuda.get_device_name(0),
            "gpus": args.gpus,
            "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "model": "Qwen3-VL-2B shapes, random init, bf16, TE",
            "recompute": args.recompute,
            "images_per_sample": args.images,
            "vision_tokens_per_image": GRID[1] * GRID[2] // 4,
            "steps": args.steps,
            "path": args.path,
            "response": args.response,
            "samples": args.samples if args.path == "rl_step" else None,
            "env": args.env,
            "logits_only_where_loss": args.logits_only_where_loss,
            "error": error,
            "results": aggregate(per_rank, args.lengths, args.layouts, args.gpus, missing),
        }
    )
    print(line)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    if error:
        sys.exit(1)


if __name__ == "__main__":
    main()
