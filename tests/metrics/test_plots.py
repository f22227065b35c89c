"""Contract: every metric the report plots is one the driver really logs (checked against a CPU run of the tiny job
with the geo3k reward and eval, and the committed GPU run for the GPU-only memory figures), so no panel looks up a
name that never exists; the health metric gets its own log-scale panel with the healthy band; steps are integers,
axes have units, titles name the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray

from miles_vl.metrics import PANELS, read_metrics, write_report
from miles_vl.metrics.plots import panel_figure
from miles_vl.orchestration import run_job
from tests.orchestration.jobs import REPO, tiny_job

GPU_RUN = REPO / "docs" / "gpu-runs" / "2026-11-23-loop-tiny-h100" / "metrics.jsonl"


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory) -> Path:
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    try:
        cfg = tiny_job(tmp_path_factory.mktemp("plots"), "plots", "num_steps=2", "reward.name=geo3k", "eval.interval=1")
        return run_job(cfg)
    finally:
        ray.shutdown()


def test_every_plotted_metric_is_logged(cpu_run):
    logged = {k for r in read_metrics(cpu_run) for k in r}
    logged |= {k for line in GPU_RUN.read_text().splitlines() for k in json.loads(line)}
    plotted = {m for p in PANELS for m in p.metrics}
    assert plotted <= logged, sorted(plotted - logged)
    # and the health metrics an RL engineer looks for first are among them
    assert {"train/train_rollout_logprob_abs_diff", "train/clip_frac", "eval/accuracy", "time/reward_s"} <= plotted


def test_panels_read_well(cpu_run):
    records = read_metrics(cpu_run)
    written = write_report(cpu_run)
    assert {p.name for p in written} >= {"reward.png", "logprob_diff.png", "policy.png", "time.png"}
    by_name = {p.name: p for p in PANELS}
    fig = panel_figure(by_name["logprob_diff"], records, "myrun")
    ax = fig.axes[0]
    assert ax.get_yscale() == "log" and "myrun" in ax.get_title()
    assert any(patch.get_label().startswith("healthy") for patch in ax.patches)  # the shaded band
    assert all(float(t).is_integer() for t in ax.get_xticks())
    for panel in PANELS:
        fig = panel_figure(panel, records, "myrun")
        if fig is not None:
            assert fig.axes[0].get_ylabel() and fig.axes[0].get_xlabel() == "RL step", panel.name
    assert panel_figure(by_name["memory"], records, "myrun") is None  # a CPU run logs no GPU memory
