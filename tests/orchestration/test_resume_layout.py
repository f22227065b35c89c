"""Issue 35.4: a megatron checkpoint resumes on another number of GPUs (data-parallel size: its optimizer state is
saved "dp_reshardable") but not at other tensor/pipeline/context/expert-parallel sizes; such a resume is refused
before Ray starts, naming the sizes it was saved at and the two ways on (those sizes, or an export)."""

import json
from pathlib import Path

import pytest

from miles_vl.config import load_config, redacted
from miles_vl.orchestration.checkpoint import CheckpointError, step_dir_name
from miles_vl.orchestration.loop import check_start

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "geo3k_qwen3vl_2b.yaml")  # megatron, 8 GPUs, TP=2 x CP=2 (DP=2)


def saved_run(tmp_path: Path, *overrides: str) -> tuple[Path, Path, Path]:
    """A run directory with the driver state of a step-3 checkpoint saved by the config with `overrides`."""
    run_dir, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    step = root / step_dir_name(3)
    step.mkdir(parents=True)
    state = {"step": 3, "config": redacted(load_config(CONFIG, list(overrides)))}
    (step / "driver.json").write_text(json.dumps(state))
    return run_dir, root, step


def test_another_number_of_gpus_resumes(tmp_path):
    run_dir, root, step = saved_run(tmp_path)
    cfg = load_config(CONFIG, ["train.num_gpus=4", "rollout.num_engines=2"])  # DP=1 instead of 2
    assert check_start(cfg, run_dir, root, step)["step"] == 3


@pytest.mark.parametrize("change", [["train.tp=4", "train.cp=1"], ["train.cp=1", "train.num_gpus=4"]])
def test_other_model_parallel_sizes_are_refused(tmp_path, change):
    run_dir, root, step = saved_run(tmp_path)
    cfg = load_config(CONFIG, [*change, "rollout.num_engines=2"])
    with pytest.raises(CheckpointError) as refused:
        check_start(cfg, run_dir, root, step)
    message = str(refused.value)
    saved = {"tp": 2, "cp": 2}
    changed = [k for k in ("tp", "cp") if getattr(cfg.train, k) != saved[k]]
    assert f"the checkpoint of step 3 was saved at {' '.join(f'train.{k}={saved[k]}' for k in changed)}" in message
    assert f"this job has {' '.join(f'train.{k}={getattr(cfg.train, k)}' for k in changed)}" in message
    assert "miles-vl export RUN_DIR OUT_DIR --step 3" in message and str(step) in message


def test_a_torch_checkpoint_is_not_judged(tmp_path):
    """The embedded backend has no model parallelism: nothing to compare."""
    run_dir, root, step = saved_run(tmp_path)
    state = json.loads((step / "driver.json").read_text())
    state["config"]["train"]["backend"] = "torch"
    (step / "driver.json").write_text(json.dumps(state))
    accept = "checkpoint.accept_changes=[train]"  # backend and layout differ: config changes the resume accepts
    cfg = load_config(CONFIG, ["train.tp=4", "train.cp=1", "rollout.num_engines=2", accept])
    assert check_start(cfg, run_dir, root, step)["step"] == 3
