"""Megatron (megatron-bridge Qwen3VLModel, Transformer Engine) training throughput and memory: CP=1 vs CP=2.

    python benchmarks/bench_megatron_cp.py [--lengths 8192,16384,32768] [--images 4] [--steps 4] [--gpus 2]
                                           [--layouts cp1,cp2,cp2_vdp]

Needs CUDA, Transformer Engine and megatron-bridge (scripts/gpu_check.sh --bench installs the bundle and runs it).
Model: random-init Qwen3-VL-2B shapes (`bench_train_throughput.qwen3_vl_2b_config`) through the production path
`AutoBridge.from_hf_config(...).to_megatron_provider(load_weights=False)` + `miles_vl.patches.configure_provider`,
bf16, TE specs, megatron DDP (fp32 grad buffers), no activation recompute.

Samples: one long multimodal sample per packed row: `--images` images of 1024x1024 (4096 patches, 1024 vision tokens
each) at the start, the rest text; total length L from `--lengths`. On `--gpus` GPUs (2):

- CP=1: data parallel, every GPU runs its own sample of length L (the whole sample's activations on one GPU);
- CP=2: one sample split over 2 GPUs (zigzag THD shards from `miles_vl.packing.pack_thd`, rank-local positions);
- CP=2 with `vision_dp_when_cp` (`cp2_vdp`, `train.vision_dp_when_cp`): the same, the vision tower's images split
  across the CP ranks instead of every rank encoding all of them.

One step = forward with next-token labels (megatron's vocab-parallel cross entropy), backward, DDP grad sync; timed
over `--steps` steps after one warm-up. Throughput counts real tokens processed by all GPUs per second; peak memory
is `torch.cuda.max_memory_allocated` per GPU (max over GPUs). A length that runs out of memory is reported as "oom".
Last stdout line: one JSON object.
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


def long_sample(length: int, images: int, seed: int):
    """A sample of exactly `length` tokens: `images` image blocks, then text (prompt = all but the last 1024)."""
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
    ids += torch.randint(0, 151000, (length - len(ids),), generator=g).tolist()
    grid = torch.tensor([GRID] * images)
    pixels = torch.randn(images * GRID[0] * GRID[1] * GRID[2], PATCH_DIM, generator=g)
    return Sample(torch.tensor(ids), grid, None, length - 1024), pixels


LAYOUTS = {"cp1": (1, False), "cp2": (2, False), "cp2_vdp": (2, True)}  # name -> (cp size, vision_dp_when_cp)


def build(cp: int, vision_dp: bool = False):
    from megatron.bridge import AutoBridge
    from megatron.core.distributed import DistributedDataParallelConfig

    from miles_vl.patches import install
    from miles_vl.patches.provider import configure_provider

    install()
    config = qwen3_vl_2b_config()
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    provider = AutoBridge.from_hf_config(config).to_megatron_provider(load_weights=False)
    provider.tensor_model_parallel_size = 1
    provider.pipeline_model_parallel_size = 1
    provider.bf16, provider.params_dtype = True, torch.bfloat16
    provider.gradient_accumulation_fusion = False  # needs APEX's fused_weight_gradient_mlp_cuda for the lm head
    configure_provider(provider, cp_size=cp, vision_dp_when_cp=vision_dp)
    provider.finalize()
    ddp = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
    )
    return provider.provide_distributed_model(ddp_config=ddp, wrap_with_ddp=True, bf16=True)[0]


def job(ctx, lengths: list[int], images: int, steps: int, layouts: list[str]) -> dict:
    from megatron.core import parallel_state as ps

    from miles_vl.packing import pack_thd
    from tests.patches.harness.runner import thd_params

    out: dict = {}
    for layout in layouts:
        cp, vision_dp = LAYOUTS[layout]
        ctx.init_parallel(tp=1, cp=cp)
        model = build(cp, vision_dp)
        cp_rank = ps.get_context_parallel_rank()
        for length in lengths:
            # CP=1: each GPU its own sample (seed by DP rank); CP=2: one sample shared by the CP group.
            sample, pixels = long_sample(length, images, seed=ps.get_data_parallel_rank())
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
            key = f"{layout}_L{length}"
            try:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                times = []
                for i in range(steps + 1):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    model.zero_grad_buffer()
                    output = model(**inputs)
                    loss = output[0] if isinstance(output, tuple) else output  # [1, T/C] per-token loss
                    (loss.float() * shard.label_mask.cuda()).sum().backward()
                    model.finish_grad_sync()
                    torch.cuda.synchronize()
                    if i:  # the first step warms up
                        times.append(time.perf_counter() - t0)
                step_s = sum(times) / len(times)
                out[key] = {
                    "step_s": step_s,
                    "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                    "tokens_per_step_all_gpus": length * ctx.world_size // cp,
                }
            except torch.OutOfMemoryError:
                out[key] = "oom"
            del inputs
        del model
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="8192,16384,32768")
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--layouts", default="cp1,cp2", help=f"which of {', '.join(LAYOUTS)} to run, in order")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    layouts = args.layouts.split(",")
    if unknown := set(layouts) - set(LAYOUTS):
        raise SystemExit(f"--layouts: unknown {sorted(unknown)}; choose from {sorted(LAYOUTS)}")
    per_rank = run_ranks(job, args.gpus, args=(lengths, args.images, args.steps, layouts), timeout_s=560)
    results = {}
    for key in per_rank[0]:
        runs = [r[key] for r in per_rank]
        if any(r == "oom" for r in runs):
            results[key] = "oom"
            continue
        step_s = max(r["step_s"] for r in runs)  # the slowest GPU sets the pace
        results[key] = {
            "tokens_per_s": round(runs[0]["tokens_per_step_all_gpus"] / step_s),
            "step_s": round(step_s, 4),
            "peak_gib_per_gpu": round(max(r["peak_gib"] for r in runs), 2),
        }
    for length in lengths:
        for new, base in (("cp2", "cp1"), ("cp2_vdp", "cp2")):
            a, b = results.get(f"{base}_L{length}"), results.get(f"{new}_L{length}")
            if isinstance(a, dict) and isinstance(b, dict):
                results[f"L{length}_{new}_over_{base}"] = {
                    "throughput": round(b["tokens_per_s"] / a["tokens_per_s"], 3),
                    "peak_memory": round(b["peak_gib_per_gpu"] / a["peak_gib_per_gpu"], 3),
                }
    print(
        json.dumps(
            {
                "bench": "megatron_cp",
                "gpu": torch.cuda.get_device_name(0),
                "gpus": args.gpus,
                "model": "Qwen3-VL-2B shapes, random init, bf16, TE",
                "images_per_sample": args.images,
                "vision_tokens_per_image": GRID[1] * GRID[2] // 4,
                "steps": args.steps,
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
