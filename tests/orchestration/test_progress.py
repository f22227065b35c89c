"""Contract: without a terminal the progress prints one plain line per step with the counter, the time left and the
health metrics (3 significant digits: a 1.2e-07 logprob difference is shown as such); on an 80-column terminal the
step counter and the time left stay visible however many metrics follow."""

from __future__ import annotations

import io
import re

from rich.console import Console

from miles_vl.orchestration.progress import Progress, metrics_text

METRICS = {
    "step": 3,
    "reward/mean": 0.3164,
    "reward/accuracy": 0.25,
    "train/train_rollout_logprob_abs_diff": 1.234e-07,
    "train/clip_frac": 0.0,
    "train/grad_norm": 0.41,
    "rollout/response_len_mean": 16.0,
    "time/step_s": 1.93,
}


def test_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    progress = Progress(30, 2, console=Console(file=out, width=80))
    progress.update(METRICS)
    progress.update(METRICS | {"step": 4})
    progress.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("step 3/30  eta ") and "|dlogp| 1.23e-07" in lines[0] and "reward 0.316" in lines[0]
    assert lines[1].startswith("step 4/30")


def test_counter_and_eta_survive_80_columns():
    out = io.StringIO()
    progress = Progress(30, 0, console=Console(file=out, force_terminal=True, width=80))
    progress.update(METRICS)
    progress.close()
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())  # drop ANSI control sequences
    lines = [line for line in plain.replace("\r", "\n").splitlines() if "step 3/30" in line]
    assert lines, plain
    last = lines[-1]
    assert len(last) <= 80, last
    assert re.search(r"\d+:\d\d:\d\d", last), last  # the time left
    assert "…" in last or "s/step" in last  # metrics are cut, never the counter


def test_metrics_text_skips_missing():
    assert metrics_text({"reward/mean": 0.5, "train/clip_frac": None}) == "reward 0.5"
