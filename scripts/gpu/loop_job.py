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
    2b_long16k, 2b_long32k, 2b_long64k  the long-context job (docs/long_context.md): Qwen3-VL-2B shapes on the
          `many_images` task, 1024x1024 images of 1024 vision tokens, as many as make samples of 16K / 32K / 64K tokens
          (prompt + 128 new tokens), 1 prompt x 4 samples, one optimizer step per step, full recompute; the train
          layout comes from the command line (e.g. train.num_gpus=4 train.cp=4)
Running NAME again with a larger NUM_STEPS resumes it from its newest checkpoint (checkpoint.resume=auto).
tests/orchestration/test_one_gpu_job.py runs these same overrides on CPU stand-ins.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "geo3k_qwen3vl_1gpu.yaml"

# The image processor's pixel range per shape: the run's data.min/max_pixels and the checkpoint's saved processor
# must agree, because SGLang 0.5.16 counts each image's tokens with the checkpoint's processor (falling back to
# re-tokenizing the decoded prompt when the counts disagree). 256x256 images: 64 tokens (tiny), 196 (2b, resized up).
PIXELS = {"tiny": (16384, 65536), "2b": (196608, 262144)}
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

    return cli(["train", str(CONFIG), *overrides(shape, ckpt, runs, name, int(steps)), *extra])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
