"""`miles-vl report RUN_DIR`: PNG plots of a run's curves from its metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from miles_vl.metrics.sinks import read_metrics  # noqa: E402

# The panels of the report: (title, metric names); metrics absent from the run are skipped.
PANELS = [
    ("reward", ["reward/mean", "reward/accuracy", "reward/format", "eval/reward_mean"]),
    ("policy", ["train/clip_fraction", "train/approx_kl", "train/kl", "train/entropy"]),
    ("health", ["train/train_rollout_logprob_abs_diff", "train/grad_norm", "rollout/zero_adv_group_fraction"]),
    ("lengths", ["rollout/response_len_mean", "rollout/visual_tokens_per_sample"]),
    ("time", ["time/rollout_s", "time/reward_s", "time/train_s", "time/sync_s", "time/step_s"]),
    ("throughput", ["perf/train_tokens_per_s", "perf/rollout_tokens_per_s"]),
]


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """One PNG per panel under `<run_dir>/plots` (or `out_dir`); returns the files written.

    Raises:
        FileNotFoundError: no metrics.jsonl in run_dir.
        ValueError: the file has no step records.
    """
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir}: metrics.jsonl has no records yet")
    out = Path(out_dir or Path(run_dir) / "plots")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for title, names in PANELS:
        present = [n for n in names if any(n in r for r in records)]
        if not present:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name in present:
            pts = [(r["step"], r[name]) for r in records if isinstance(r.get(name), int | float)]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", markersize=3, label=name)
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"{title}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
