"""scripts/gpu/plans/owed.sh: every run a planned device call makes is a job that starts, checked here on the CPU
before device time is spent on it. Each run's overrides (loop_job.py's, the staleness ones it derives, the plan's)
validate as the job's config; the job's GPUs are the ones the plan gives it; runs of one call use disjoint GPUs and
distinct names; each stops inside the device tool's 600 s per call."""

import importlib.util
import subprocess
from pathlib import Path

import pytest

from miles_vl.config.loader import load_config

REPO = Path(__file__).resolve().parents[1]
OWED = REPO / "scripts" / "gpu" / "plans" / "owed.sh"
CALLS = ("p1", "p2", "p3", "p4", "p5", "p6")
DEVICE_CALL_S = 600


def _loop_job():
    spec = importlib.util.spec_from_file_location("loop_job", REPO / "scripts" / "gpu" / "loop_job.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def planned_runs(call: str) -> list[list[str]]:
    out = subprocess.run(["bash", str(OWED), "--dry-run", call], capture_output=True, text=True, check=True, cwd=REPO)
    return [line.split() for line in out.stdout.splitlines()]


def gpus_of(cfg) -> int:
    """GPUs a job takes (miles_vl/orchestration/placement.py): colocated engines share the trainer's."""
    engines = cfg.rollout.num_engines * cfg.rollout.gpus_per_engine
    if cfg.ray.placement == "disaggregate":
        return cfg.train.num_gpus + engines
    assert engines <= cfg.train.num_gpus, "colocated engines need no more GPUs than the trainer has"
    return cfg.train.num_gpus


@pytest.mark.parametrize("call", CALLS)
def test_each_planned_run_is_a_valid_job_on_its_own_gpus(call, tmp_path):
    loop_job = _loop_job()
    runs = planned_runs(call)
    assert runs, f"owed.sh {call} plans no run"
    taken: set[str] = set()
    names = [run[3] for run in runs]
    assert len(set(names)) == len(names), f"two runs of {call} share a name: {names}"
    for gpus, end_s, shape, name, steps, *extra in runs:
        devices = gpus.split(",")
        assert not taken & set(devices), f"{name} shares GPUs {sorted(taken & set(devices))} with another run"
        taken |= set(devices)
        assert int(end_s) <= DEVICE_CALL_S - 10, f"{name} stops at {end_s} s: no room before the call's limit"
        config = loop_job.CONFIGS.get(shape, loop_job.CONFIG)
        overrides = [
            *loop_job.overrides(shape, tmp_path / "ckpt", tmp_path / "runs", name, int(steps)),
            *loop_job.staleness_overrides(extra),
            *extra,
        ]
        cfg = load_config(config, overrides)
        assert gpus_of(cfg) == len(devices), f"{name}: the job takes {gpus_of(cfg)} GPUs, the plan gives it {gpus}"


def test_an_unknown_call_is_refused_before_anything_runs():
    result = subprocess.run(["bash", str(OWED), "p9"], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2 and "unknown call p9 (p1 | p2 | p3 | p4 | p5 | p6)" in result.stderr
