"""Progress of the RL steps with the health metrics an RL engineer watches.

On a terminal: one live line whose step counter and time left come first, so that they stay visible at 80 columns
(the metrics after them are cut with an ellipsis when the line is too long). Anywhere else (a log file, `ray job
submit`, a CI log): one plain line per step, e.g.

    step 3/30  eta 0:01:10  reward 0.316  |dlogp| 0.0097  clip 0  gnorm 0.41  len 16  s/step 1.9  eval 0.25@step 2

`reward` and `acc` are the step's training rollouts; `eval` is the latest eval's accuracy (its mean reward when the
reward function reports no accuracy) and the step it was taken after.
Numbers use 3 significant digits, so a logprob difference of 1.2e-07 shows as such.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

from rich.console import Console
from rich.progress import Progress as RichProgress
from rich.progress import TextColumn
from rich.table import Column

SHOWN = [  # (metric, label)
    ("reward/mean", "reward"),
    ("reward/accuracy", "acc"),
    ("train/train_rollout_logprob_abs_diff", "|dlogp|"),
    ("train/clip_frac", "clip"),
    ("train/grad_norm", "gnorm"),
    ("rollout/response_len_mean", "len"),
    ("time/step_s", "s/step"),
]


def metrics_text(metrics: dict[str, float]) -> str:
    """The shown metrics of one step, 3 significant digits each."""
    return "  ".join(f"{label} {metrics[k]:.3g}" for k, label in SHOWN if isinstance(metrics.get(k), int | float))


class Progress:
    """Args:
    total: the job's num_steps.
    start: steps already done (a resumed run).
    enabled: False: print nothing.
    console: where to write (default: stderr); a terminal gets the live line, anything else plain lines.
    """

    def __init__(self, total: int, start: int, enabled: bool = True, console: Console | None = None):
        self.enabled, self.total, self.start = enabled, total, start
        self.last_eval = ""  # `eval <accuracy>@step <n>` of the latest eval
        if not enabled:
            return
        self.console = console or Console(file=sys.stderr)
        self.live = self.console.is_terminal
        self.t0 = time.monotonic()
        if self.live:
            # one column: the counter and the time left lead, the metrics after them are cut at the console's width
            self.bar = RichProgress(
                TextColumn("{task.fields[line]}", table_column=Column(no_wrap=True, overflow="ellipsis")),
                console=self.console,
            )
            self.bar.start()
            self.task = self.bar.add_task("steps", total=total, completed=start, line=f"step {start}/{total}")

    def line(self, metrics: dict[str, float]) -> str:
        """`step k/total  eta h:mm:ss  <metrics>`; the time left from the mean step time of this run so far."""
        step = int(metrics["step"])
        eta = (time.monotonic() - self.t0) / max(step - self.start, 1) * (self.total - step)
        score = metrics.get("eval/accuracy", metrics.get("eval/reward_mean"))
        if isinstance(score, int | float):
            label = "eval" if "eval/accuracy" in metrics else "eval reward"
            self.last_eval = f"  {label} {score:.3g}@step {step}"
        return f"step {step}/{self.total}  eta {timedelta(seconds=round(eta))}  {metrics_text(metrics)}{self.last_eval}"

    def update(self, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        if self.live:
            self.bar.update(self.task, completed=int(metrics["step"]), line=self.line(metrics))
        else:
            self.console.print(self.line(metrics), highlight=False, markup=False, soft_wrap=True)

    def close(self) -> None:
        if self.enabled and self.live:
            self.bar.stop()
