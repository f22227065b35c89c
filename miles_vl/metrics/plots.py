"""`miles-vl report RUN_DIR`: PNG plots of a run's curves from its metrics.jsonl.

Every panel plots metrics the driver logs (tests/metrics/test_plots.py checks each name against real runs); a panel
whose metrics are all absent from a run (e.g. GPU memory on a CPU run) is skipped. The health metric
`train/train_rollout_logprob_abs_diff` has its own log-scale panel with the healthy range shaded: ~1e-7 in fp32,
about 0.01 in bf16, and ~0.7 when positions, rope or vision inputs differ between trainer and engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from miles_vl.metrics.sinks import read_metrics  # noqa: E402


@dataclass(frozen=True)
class Panel:
    """One PNG: `metrics` against the step, on a `ylabel` axis (log-scaled when `log`); `band` shades a range."""

    name: str
    title: str
    metrics: tuple[str, ...]
    ylabel: str
    log: bool = False
    band: tuple[float, float, str] | None = None  # (low, high, label)


PANELS = (
    Panel("reward", "reward", ("reward/mean", "reward/accuracy", "reward/format", "eval/reward_mean", "eval/accuracy"),
          "reward"),
    Panel("logprob_diff", "trainer vs rollout engine: mean |logprob difference|",
          ("train/train_rollout_logprob_abs_diff",), "|logprob difference| (nats)", log=True,
          band=(1e-8, 0.03, "healthy (fp32 ~1e-7, bf16 ~0.01); ~0.7 = positions/rope/vision differ")),
    Panel("policy", "policy update", ("train/clip_frac", "train/approx_kl", "train/kl_loss", "train/entropy_loss"),
          "value"),
    Panel("grad_norm", "gradient norm", ("train/grad_norm",), "norm"),
    Panel("fractions", "fractions of the batch", ("rollout/zero_adv_group_fraction", "rollout/truncated_fraction"),
          "fraction"),
    Panel("lengths", "lengths", ("rollout/response_len_mean", "rollout/visual_tokens_per_sample"), "tokens"),
    Panel("time", "time per step", ("time/rollout_s", "time/reward_s", "time/train_s", "time/sync_s", "time/step_s"),
          "seconds"),
    Panel("throughput", "throughput", ("perf/train_tokens_per_s", "perf/rollout_tokens_per_s"), "tokens/s"),
    Panel("memory", "GPU memory", ("perf/gpu_used_gib_rollout", "perf/train_peak_mem_gib"), "GiB"),
)  # fmt: skip
MARKERS = ("o", "s", "^", "D", "v")
LINESTYLES = ("-", "--", "-.", ":", (0, (5, 1)))


def panel_figure(panel: Panel, records: list[dict], run_name: str):
    """The figure of one panel, or None when the run logged none of its metrics."""
    series = []
    for name in panel.metrics:
        pts = [(r["step"], r[name]) for r in records if isinstance(r.get(name), int | float)]
        if panel.log:
            pts = [(s, v) for s, v in pts if v > 0]
        if pts:
            series.append((name, pts))
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for i, (name, pts) in enumerate(series):  # distinct markers and dashes: equal curves stay visible
        ax.plot(*zip(*pts, strict=True), marker=MARKERS[i % 5], linestyle=LINESTYLES[i % 5], markersize=3, label=name)
    if panel.log:
        ax.set_yscale("log")
    if panel.band:
        low, high, label = panel.band
        ax.axhspan(low, high, color="tab:green", alpha=0.12, label=label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("RL step")
    ax.set_ylabel(panel.ylabel)
    ax.set_title(f"{run_name}: {panel.title}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """One PNG per panel with data under `<run_dir>/plots` (or `out_dir`); returns the files written.

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
    for panel in PANELS:
        fig = panel_figure(panel, records, Path(run_dir).name)
        if fig is None:
            continue
        path = out / f"{panel.name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
