"""GPU memory the megatron backend's build leaves cached, and what the train actor's `release_build_memory` returns
to the device (issue 33.5: the 8B trainer held 67.5 GiB after its build where its tensors need ~51, and the colocated
engine could not load its weights beside it, docs/gpu-runs/2026-11-28-8b-1gpu-2xh200).

    python benchmarks/bench_build_memory.py --hf-dir CKPT [--cpu-offload 1.0]     (one GPU, the GPU stack)

Builds the backend as a train rank does (one rank, TP = CP = 1, bf16, the distributed optimizer; `--cpu-offload`: its
state on the host, as the 8b_1gpu job) from the Hugging Face checkpoint CKPT, then calls `release_build_memory`.
Last line: one JSON object with `params`, `bf16_weights_gib` (2 bytes a parameter: the loaded copy DDP frees),
`allocated_gib`, `reserved_before_gib` (what the device counts as the trainer's before the release), `returned_gib`
and `reserved_after_gib`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf-dir", required=True, help="a Qwen3-VL checkpoint (scripts/gpu/make_tiny_qwen3vl.py)")
    ap.add_argument("--cpu-offload", type=float, default=0.0, help="train.optimizer.cpu_offload (0..1)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_build_memory: needs a GPU (it measures CUDA's caching allocator)")

    import torch.distributed as dist

    from benchmarks.bench_megatron_cp import special_tokens
    from miles_vl.orchestration.trainer import release_build_memory
    from miles_vl.train.megatron import build_megatron_backend
    from miles_vl.train.megatron.parallel import ParallelOptions
    from miles_vl.train.types import LossOptions, OptimizerOptions, TrainOptions

    with tempfile.TemporaryDirectory() as folder:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"file://{folder}/pg", rank=0, world_size=1)  # the build's own
        options = TrainOptions(
            OptimizerOptions(lr=1e-6, weight_decay=0.01, cpu_offload=args.cpu_offload),
            LossOptions(max_response_len=256),
        )
        backend = build_megatron_backend(
            args.hf_dir, special_tokens(), options, ParallelOptions(tp_size=1, cp_size=1, bf16=True, seed=0)
        )
        params = sum(p.numel() for chunk in backend.model for p in chunk.parameters())
        allocated, reserved = torch.cuda.memory_allocated() / 2**30, torch.cuda.memory_reserved() / 2**30
        _, returned = release_build_memory()
        print(
            json.dumps(
                {
                    "params": params,
                    "cpu_offload": args.cpu_offload,
                    "bf16_weights_gib": round(2 * params / 2**30, 2),
                    "allocated_gib": round(allocated, 2),
                    "reserved_before_gib": round(reserved, 2),
                    "returned_gib": round(returned, 2),
                    "reserved_after_gib": round(torch.cuda.memory_reserved() / 2**30, 2),
                }
            )
        )
        dist.destroy_process_group()  # without it the first runs (2026-11-28) did not exit after their result


if __name__ == "__main__":
    main()
