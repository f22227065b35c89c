"""Does the embedded job learn to look? `configs/vision_tiny_cpu.yaml` (what `make run` trains) on several seeds, and
the same job with blank images.

    .venv/bin/python benchmarks/vision_learning.py                          # seeds 1234 1 2, blank images on 1234
    .venv/bin/python benchmarks/vision_learning.py --seeds 7 --blank-seeds 7 --out runs/vision
    .venv/bin/python benchmarks/vision_learning.py --plot docs/images/vision_learning.png   # + the curves as a PNG
    .venv/bin/python benchmarks/vision_learning.py --seeds 1 --blank-seeds -- train.optimizer.lr=1e-3  # + overrides

The job: a random-init tiny Qwen3-VL, hf rollouts, the torch trainer, the real driver loop (Ray actors, packed THD
training, weight sync), on `data.synthetic_task=background_colour` ("What colour is the background? Choices: A. red,
B. green, C. blue, D. black.", the same text for every problem), a format warm-up with random answers and the vision
tower frozen, then GRPO. For each run: the held-out greedy accuracy after the warm-up (step 0: chance, 1/4, since
the warm-up carries no image information) and at the end. The blank-image runs (`data.blank_images=true`) are the
control measured in the same invocation: with the pixels gone the job can only learn the answer distribution, so it
must stay at chance. One JSON object on the last line; `learns` is true when every real run ends at least 0.2 above
its own start and above every blank run's end.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from miles_vl.config import load_config  # noqa: E402
from miles_vl.logs import setup_logging  # noqa: E402
from miles_vl.metrics import read_metrics  # noqa: E402
from miles_vl.orchestration import run_job  # noqa: E402

CONFIG = REPO / "configs" / "vision_tiny_cpu.yaml"


def run(seed: int, blank: bool, out: str, overrides: list[str]) -> dict:
    name = f"seed{seed}{'-blank' if blank else ''}"
    cfg = load_config(
        CONFIG,
        [
            f"seed={seed}",
            f"data.blank_images={str(blank).lower()}",
            "checkpoint.resume=never",
            "checkpoint.interval=0",
            f"logging.output_dir={out}",
            f"logging.run_name={name}-{time.strftime('%Y%m%d-%H%M%S')}",
            "logging.progress=false",
            "logging.wandb.mode=disabled",
            *overrides,
        ],
    )
    t0 = time.perf_counter()
    run_dir = run_job(cfg, "vision_learning")
    records = read_metrics(run_dir)
    evals = [(r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]
    return {
        "seed": seed,
        "blank_images": blank,
        "eval_start": evals[0][1],
        "eval_end": evals[-1][1],
        "eval": [[s, round(a, 4)] for s, a in evals],
        "reward": [[r["step"], round(r["reward/mean"], 4)] for r in records if "reward/mean" in r],
        "wall_s": round(time.perf_counter() - t0, 1),
        "run_dir": str(run_dir),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2])
    ap.add_argument("--blank-seeds", type=int, nargs="*", default=[1234])
    ap.add_argument("--out", default=str(REPO / "runs" / "vision_learning"))
    ap.add_argument("--plot", default=None, help="write the eval accuracy and reward curves to this PNG")
    ap.add_argument("overrides", nargs="*", help="key=value overrides applied after the config")
    args = ap.parse_args()
    setup_logging("WARNING")
    real = [run(s, False, args.out, args.overrides) for s in args.seeds]
    blank = [run(s, True, args.out, args.overrides) for s in args.blank_seeds]
    for r in real + blank:
        print(f"seed {r['seed']} blank={r['blank_images']}: eval accuracy {r['eval_start']:.3f} -> {r['eval_end']:.3f}")
    ceiling = max([r["eval_end"] for r in blank], default=0.25)
    learns = all(r["eval_end"] >= r["eval_start"] + 0.2 and r["eval_end"] > ceiling for r in real)
    if args.plot:
        plot(real + blank, args.plot)
    print(json.dumps({"benchmark": "vision_learning", "chance": 0.25, "learns": learns, "runs": real + blank}))


def plot(runs: list[dict], path: str) -> None:
    """Held-out accuracy (left) and the mean reward of the RL batches (right) per step, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, rew) = plt.subplots(1, 2, figsize=(10, 3.8))
    for r in runs:
        style = {"linestyle": "--", "color": "grey"} if r["blank_images"] else {}
        label = f"seed {r['seed']}" + (", blank images" if r["blank_images"] else "")
        acc.plot(*zip(*r["eval"], strict=True), marker="o", label=label, **style)
        rew.plot(*zip(*r["reward"], strict=True), label=label, alpha=0.8, **style)
    acc.axhline(0.25, color="black", linewidth=0.8, linestyle=":", label="chance")
    acc.set(title="held-out accuracy (greedy, 128 problems)", xlabel="RL step (0: after the format warm-up)",
            ylabel="accuracy", ylim=(0, 1.05))  # fmt: skip
    rew.set(title="mean reward of the RL batch (answer + 0.1 format)", xlabel="RL step", ylabel="reward")
    acc.legend(fontsize=8)
    fig.suptitle(f"{CONFIG.name}: a random-init tiny Qwen3-VL learns to read the colour (2 CPU cores)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
