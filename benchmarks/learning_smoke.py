"""Learning check: GRPO on the embedded backends must raise the mean reward of a task a tiny model can learn.

    .venv/bin/python benchmarks/learning_smoke.py [--steps 20] [--out runs/learning_smoke]

The tiny random Qwen3-VL gets geo3k-style prompts (with their images) and is rewarded for the fraction of digit
characters in its response, a signal every sampled group carries in different amounts, so GRPO has a gradient
from the first step. The run goes through the real driver loop (Ray actors, hf rollouts, packed THD training,
weight sync). Output: the reward curve (PNG under the run dir) and one JSON object on the last line with the mean
reward of the first and last steps.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from miles_vl.config import load_config  # noqa: E402
from miles_vl.logs import setup_logging  # noqa: E402
from miles_vl.metrics import read_metrics  # noqa: E402
from miles_vl.orchestration import run_job  # noqa: E402
from miles_vl.reward import RewardSample  # noqa: E402


def digit_fraction(sample: RewardSample) -> float:
    text = sample.response
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default=str(REPO / "runs"))
    args = ap.parse_args()
    setup_logging("WARNING")
    cfg = load_config(
        REPO / "configs" / "geo3k_tiny_cpu.yaml",
        [
            f"num_steps={args.steps}",
            "rollout.batch_size=4",
            "rollout.n_samples_per_prompt=8",
            "rollout.max_response_len=12",
            "train.optimizer.lr=1e-2",
            "algo.clip_high=0.28",
            "eval.interval=0",
            "checkpoint.interval=0",
            "checkpoint.resume=never",
            f"logging.output_dir={args.out}",
            "logging.progress=false",
            "logging.wandb.mode=disabled",
            "reward.name=benchmarks.learning_smoke:digit_fraction",
        ],
    )
    run_dir = run_job(cfg, "learning_smoke")
    rewards = [r["reward/mean"] for r in read_metrics(run_dir)]
    k = min(3, len(rewards))  # mean of the first and of the last three steps
    start, end = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    print(
        json.dumps(
            {
                "benchmark": "learning_smoke",
                "steps": len(rewards),
                "reward_start": round(start, 4),
                "reward_end": round(end, 4),
                "ratio": round(end / max(start, 1e-9), 2),
                "rewards": [round(r, 4) for r in rewards],
                "plot": str(run_dir / "plots" / "reward.png"),
                "samples_per_step": cfg.samples_per_step,
            }
        )
    )


if __name__ == "__main__":
    main()
