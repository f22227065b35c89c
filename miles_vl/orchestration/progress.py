"""A one-line rich progress display of the RL steps with the health metrics an RL engineer watches."""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress

SHOWN = [  # (metric, label, format)
    ("reward/mean", "reward", "{:.3f}"),
    ("reward/accuracy", "acc", "{:.2f}"),
    ("train/train_rollout_logprob_abs_diff", "|dlogp|", "{:.4f}"),
    ("train/clip_frac", "clip", "{:.3f}"),
    ("train/grad_norm", "gnorm", "{:.2f}"),
    ("rollout/response_len_mean", "len", "{:.0f}"),
    ("time/step_s", "s/step", "{:.1f}"),
]


class Progress:
    def __init__(self, total: int, start: int, enabled: bool = True):
        self.enabled = enabled
        if not enabled:
            return
        self.bar = RichProgress(
            TextColumn("[bold]RL steps"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
        )
        self.bar.start()
        self.task = self.bar.add_task("steps", total=total, completed=start, info="")

    def update(self, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        info = "  ".join(f"{label} {fmt.format(metrics[k])}" for k, label, fmt in SHOWN if k in metrics)
        self.bar.update(self.task, completed=metrics["step"], info=info)

    def close(self) -> None:
        if self.enabled:
            self.bar.stop()
