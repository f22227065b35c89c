"""The production-loop job of scripts/gpu/loop_run.sh: configs/geo3k_qwen3vl_1gpu.yaml made into a test-sized run on a
random-init checkpoint (scripts/gpu/make_tiny_qwen3vl.py) with a learnable reward.

    PYTHONPATH=. python scripts/gpu/loop_job.py SHAPE CKPT RUNS NAME NUM_STEPS [override ...]
    python scripts/gpu/loop_job.py --pixels SHAPE        # the pixel range the checkpoint's processor must have

Same as `miles-vl train configs/geo3k_qwen3vl_1gpu.yaml <overrides(...)> [override ...]`. The overrides:
generated geo3k-style problems (`data.synthetic_n`) instead of the parquet files, wandb off, no eval, a checkpoint
every 10 steps, and the reward `benchmarks.learning_smoke:digit_fraction` (the fraction of digit characters in a
response: every sampled group carries it in different amounts, so GRPO has a signal from step 1, and a tiny random
model can learn it). Per shape:
    tiny  64 vision tokens per image, 8 prompts x 8 samples, 16 new tokens, lr 5e-4 (the same job on the embedded
          backends on CPU at lr 1e-3: reward 0.011 -> 0.757 at step 5 -> 1.0 at step 9)
    2b    Qwen3-VL-2B shapes, 196 vision tokens per image, 16 prompts x 8 samples, 256 new tokens, lr 1e-6
    8b    configs/geo3k_qwen3vl_8b.yaml instead (Qwen3-VL-8B shapes) on 4 GPUs: Megatron TP=2 x CP=2 (DP=1), two
          SGLang engines of 2 GPUs each, colocated; 196 vision tokens per image, 8 prompts x 8 samples, 128 new
          tokens, one optimizer step per RL step, lr 1e-6, full recompute (memory estimate at SHAPES["8b"])
    8b_1gpu  the same 8B job full-parameter on ONE GPU, colocated: TP=CP=1, one engine of 1 GPU, the Megatron
          optimizer's state on the CPU (train.optimizer.cpu_offload=1.0), 4096-token micro-batches, full recompute
          (memory at SHAPES["8b_1gpu"]; its host needs ~131 GiB of RAM for the offloaded state)
    2b_long16k, 2b_long32k, 2b_long64k  the long-context job (docs/long_context.md): Qwen3-VL-2B shapes on the
          `many_images` task, 1024x1024 images of 1024 vision tokens, as many as make samples of 16K / 32K / 64K tokens
          (prompt + 128 new tokens), 1 prompt x 4 samples, one optimizer step per step, full recompute, the output
          layer on the response positions only (train.logits_only_where_loss: the full logits of a sample would pass
          2^31 elements a rank); the train layout comes from the command line (e.g. train.num_gpus=4 train.cp=4)
Running NAME again with a larger NUM_STEPS resumes it from its newest checkpoint (checkpoint.resume=auto). An override
`rollout.max_staleness=N` (N > 0: rollouts ahead of training, docs/async.md) adds `algo.tis.enabled=true` unless the
command line sets it.
tests/orchestration/test_one_gpu_job.py runs these same overrides on CPU stand-ins.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "geo3k_qwen3vl_1gpu.yaml"
CONFIGS = {shape: REPO / "configs" / "geo3k_qwen3vl_8b.yaml" for shape in ("8b", "8b_1gpu")}  # others: CONFIG

# The image processor's pixel range per shape: the run's data.min/max_pixels and the checkpoint's saved processor
# must agree, because SGLang 0.5.16 counts each image's tokens with the checkpoint's processor (falling back to
# re-tokenizing the decoded prompt when the counts disagree). 256x256 images: 64 tokens (tiny), 196 (2b, resized up).
PIXELS = {"tiny": (16384, 65536), "2b": (196608, 262144), "8b": (196608, 262144), "8b_1gpu": (196608, 262144)}
LONG_LENGTHS = {"2b_long16k": 16384, "2b_long32k": 32768, "2b_long64k": 65536}  # shape -> sample tokens
LONG_RESPONSE = 128
PIXELS |= {shape: (1024 * 1024, 1024 * 1024) for shape in LONG_LENGTHS}  # 1024x1024 images kept whole

SHAPES = {
    "tiny": (
        "data.max_prompt_len=512",
        "rollout.batch_size=8",
        "rollout.n_samples_per_prompt=8",
        "rollout.max_response_len=16",
        "rollout.sglang.mem_fraction_static=0.3",
        'rollout.sglang.extra_args=["--cuda-graph-max-bs-decode","64","--max-running-requests","64"]',
        "train.global_batch_size=32",
        "train.optimizer.lr=5e-4",
        "train.optimizer.weight_decay=0.0",
    ),
    "2b": (
        "data.max_prompt_len=1024",
        "rollout.batch_size=16",
        "rollout.n_samples_per_prompt=8",
        "rollout.max_response_len=256",
        "train.global_batch_size=64",
        "train.optimizer.lr=1e-6",
        # measured on an H100: without recompute an 8192-token micro-batch needs more than the 80 GB (OOM at 75.7 GB
        # in the vocab-parallel backward, docs/gpu-runs/2026-11-23-loop-2b-oom); full recompute keeps only the
        # layer inputs
        "train.recompute=full",
    ),
    # Colocated memory per GPU (80 GB card, 79.6 GiB), 8.77B parameters at TP=2 (the vision tower counted as if
    # replicated: 4.67B local parameters), megatron's distributed optimizer sharding over DP x CP = 2:
    #   bf16 weights 2 B + fp32 gradient buffer 4 B + fp32 main weights 4/2 B = 8 B/param = 35 GiB when the engines
    #   start; Adam's two fp32 moments (8/2 B/param = 17.4 GiB) are allocated at the first optimizer step, after
    #   which the trainer holds 52 GiB through every rollout (not offloaded here; 8b_1gpu offloads it).
    # An SGLang 0.5.16 engine takes mem_fraction_static of the memory FREE when it starts (~43.6 GiB) for weights
    # (8.77B x 2 B / TP 2 = 8.2 GiB) + KV cache, and leaves the rest as its runtime slack: at 0.4, 17.4 GiB
    # (9 GiB of KV, ~120K tokens of 73.7 KB per GPU; a step needs ~15K per engine) and 26 GiB left, which must hold
    # the Adam moments added later (17.4 GiB) plus SGLang's CUDA graphs and prefill activations: rollout ~71 GiB.
    # Train phase (engines released): 52 GiB + activations of a 8192-token micro-batch (4096 tokens per CP rank,
    # full recompute; the vocab-parallel logprobs ~5 GiB) ~60 GiB. Without the distributed optimizer (12 B/param
    # unsharded) the trainer alone would need 65 GiB: it does not fit next to an engine.
    "8b": (
        "train.num_gpus=4",
        "train.tp=2",
        "train.cp=2",
        "rollout.num_engines=2",
        "rollout.gpus_per_engine=2",
        "data.max_prompt_len=1024",
        "rollout.batch_size=8",
        "rollout.n_samples_per_prompt=8",
        "rollout.max_response_len=128",
        "rollout.sglang.mem_fraction_static=0.4",
        'rollout.sglang.extra_args=["--cuda-graph-max-bs-decode","32","--max-running-requests","64"]',
        "train.global_batch_size=64",
        "train.micro_batch_max_tokens=8192",
        "train.optimizer.lr=1e-6",
        "train.recompute=full",
    ),
    # ONE 80 GB GPU (79.6 GiB), 8.77B parameters, nothing sharded (`miles-vl check` prints this estimate; hand-checked
    # in tests/orchestration/test_memory.py): bf16 weights 2 B + fp32 gradient buffer 4 B = 6 B/param = 49 GiB + 3 GiB
    # CUDA/NCCL stay on the GPU through the rollout; the optimizer's state (fp32 main weights, both moments and a
    # pinned fp32 gradient copy, 16 B/param = 131 GiB) lives in host memory (megatron's HybridDeviceOptimizer), so
    # the host needs ~150 GiB of RAM with the rest of the job (the 128 GiB machines do not have it: run on a larger
    # host, one of its GPUs; loop_run.sh pins CUDA_VISIBLE_DEVICES=0). The engine starts with ~28 GiB free and takes
    # 0.7 of it: 16.3 GiB of weights + ~3.3 GiB of KV cache (~24K tokens of 144 KiB; a step needs 64 x 1152 at most,
    # ~10K in practice: the 8 samples of a prompt share its prefix) and leaves ~8 GiB for its CUDA graphs, activations
    # and the 4.2 GiB more the trainer holds from step 2 on than before step 1 (0.8 left too little: on 2026-11-28
    # the KV cache could not resume after the first sync, docs/gpu-runs/2026-11-28-8b-1gpu-weights-only-2xh200; at
    # 0.7 the card held 76.8 GiB at most of its 79.4, docs/gpu-runs/2026-11-28-8b-1gpu-4steps-2xh200). Train phase
    # (engine released to its 2 GiB): 52 GiB + a 4096-token micro-batch's activations (full recompute: 1.6 GiB) and
    # logprobs (9.3 GiB) = 65 GiB; 8192 tokens would need 76 GiB, past the 90 % the estimate allows. The sync: the
    # engine's weights are resumed alone before it (52 + 16.3 + its runtime + the sync's buckets, ~72 GiB) and its KV
    # cache only after it, which would not fit beside the sync (loop.py). A final checkpoint holds ~123 GB (bf16 weights
    # and the fp32 Adam state).
    "8b_1gpu": (
        "train.num_gpus=1",
        "train.tp=1",
        "train.cp=1",
        "train.sp=false",
        "rollout.num_engines=1",
        "rollout.gpus_per_engine=1",
        "data.max_prompt_len=1024",
        "rollout.batch_size=8",
        "rollout.n_samples_per_prompt=8",
        "rollout.max_response_len=128",
        "rollout.sglang.mem_fraction_static=0.7",
        'rollout.sglang.extra_args=["--cuda-graph-max-bs-decode","32","--max-running-requests","64"]',
        "train.global_batch_size=64",
        "train.micro_batch_max_tokens=4096",
        "train.optimizer.lr=1e-6",
        "train.optimizer.cpu_offload=1.0",
        "train.recompute=full",
        # torch's threads in every actor (factories.set_threads): the CPU Adam step over 8.77B parameters runs in the
        # train actor, which Ray may leave at one thread (its OMP_NUM_THREADS for an actor of num_cpus=0); the hosts
        # loop_run.sh accepts for this shape have 64 cores or more
        "ray.num_cpus=32",
    ),
}


def long_shape(length: int, tokens_per_image: int = 1024) -> tuple[str, ...]:
    """The overrides of a 2b_long shape: `many_images` samples of up to `length` tokens (images of `tokens_per_image`
    vision tokens), every bound that holds a sample (prompt filter, micro-batch budget) at `length`
    (tests/orchestration/test_long_job.py runs it scaled down on CPU)."""
    sys.path.insert(0, str(REPO))
    from miles_vl.data.synth import many_images_count

    return (
        "data.synthetic_task=many_images",
        f"data.synthetic_images={many_images_count(length, tokens_per_image)}",
        "data.synthetic_n=8",  # 62 images of 1024x1024 are ~1 s of PIL per prompt: generate few
        f"data.max_prompt_len={length - LONG_RESPONSE}",
        # one prompt x 4 samples a step, one optimizer step: 4 samples of 64K are ~30 s of train phase at CP=4
        "rollout.batch_size=1",
        "rollout.n_samples_per_prompt=4",
        f"rollout.max_response_len={LONG_RESPONSE}",
        "train.global_batch_size=4",
        f"train.micro_batch_max_tokens={length}",
        # the output layer on the response positions only: full logits of a 32K sample at CP=2 or a 64K one at CP=4
        # are 16,384 tokens x 151,936 = 2.49e9 elements a rank, past the 2^31 whose backward fails with `CUDA error:
        # invalid argument` (issue 32: both jobs failed so at their first backward and trained with this; `miles-vl
        # check` refuses them without it, train/megatron/step.py MAX_TRAIN_LOGITS_ELEMENTS)
        "train.logits_only_where_loss=true",
        # as the long-context runs of docs/gpu-runs ran (the one-GPU config turned it on on 2026-11-28, p13)
        "train.vision_once_per_image=false",
        "train.optimizer.lr=1e-6",
        "train.recompute=full",
    )


SHAPES |= {shape: long_shape(length) for shape, length in LONG_LENGTHS.items()}


def overrides(shape: str, ckpt: str | Path, runs: str | Path, name: str, num_steps: int) -> list[str]:
    """The `key=value` overrides of the job (module docstring).

    Raises:
        ValueError: an unknown shape.
    """
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, found {shape!r}")
    return [
        f"model.path={ckpt}",
        "data.train_path=null",
        "data.eval_path=null",
        "data.format=auto",
        "data.synthetic_n=512",
        "reward.name=benchmarks.learning_smoke:digit_fraction",
        "eval.interval=0",
        f"logging.output_dir={runs}",
        f"logging.run_name={name}",
        "logging.wandb.mode=disabled",
        "logging.progress=false",
        "checkpoint.interval=10",
        "checkpoint.keep_last=3",
        f"num_steps={num_steps}",
        f"data.min_pixels={PIXELS[shape][0]}",
        f"data.max_pixels={PIXELS[shape][1]}",
        *SHAPES[shape],
    ]


def staleness_overrides(extra: list[str]) -> list[str]:
    """`algo.tis.enabled=true` when `extra` asks for rollouts ahead of training (`rollout.max_staleness` > 0, which
    needs the correction: docs/async.md) and does not set it; the command line's own `algo.tis.enabled` wins."""
    values = dict(item.split("=", 1) for item in extra if "=" in item)
    if int(values.get("rollout.max_staleness", "0")) > 0 and "algo.tis.enabled" not in values:
        return ["algo.tis.enabled=true"]
    return []


def job(
    shape: str, ckpt: str | Path, runs: str | Path, name: str, num_steps: int, extra: list[str]
) -> tuple[Path, list[str]]:
    """The job `main` runs: its config file and every override, in order (the shape's, the derived staleness ones,
    then `extra`, which win)."""
    return CONFIGS.get(shape, CONFIG), [
        *overrides(shape, ckpt, runs, name, num_steps),
        *staleness_overrides(extra),
        *extra,
    ]


def main(argv: list[str]) -> int:
    if argv[:1] == ["--pixels"] and len(argv) == 2:  # for loop_run.sh: the checkpoint's processor range
        print(*PIXELS[argv[1]])
        return 0
    if len(argv) < 5:
        sys.stderr.write(__doc__)
        return 2
    shape, ckpt, runs, name, steps, *extra = argv
    sys.path.insert(0, str(REPO))
    from miles_vl.cli import main as cli

    if derived := staleness_overrides(extra):
        print(f"loop_job: rollout.max_staleness > 0: adding {' '.join(derived)}", flush=True)
    config, job_overrides = job(shape, ckpt, runs, name, int(steps), extra)
    return cli(["train", str(config), *job_overrides])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
