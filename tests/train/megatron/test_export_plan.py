"""Contract: the megatron backend's weight export (`ExportPlan`, train/megatron/export.py) builds megatron-bridge's
conversion tasks once and reuses them on later syncs, and what it exports is exactly what a fresh, uncached export of
the same model gives: after an optimizer step changed the values (the tasks reference the parameter objects, whose
values change in place), for another model object (a rebuilt model gets its own tasks), and after a parameter
object was replaced inside the model.

One gloo rank on the CPU: the tiny HF checkpoint through AutoBridge (tests/train/megatron/jobs.py: job_export_plan),
the vision tower frozen as `train.freeze_vision` freezes it, one RL step with the CPU optimizer stand-in.
"""

from __future__ import annotations

import pytest
import torch

from tests.patches.harness.shims import require_bridge
from tests.train.megatron import cpu_parts, jobs


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    require_bridge("0.6.2")
    directory = str(tmp_path_factory.mktemp("tiny_qwen3vl"))
    jobs.write_tiny_hf_checkpoint(directory)
    return cpu_parts.spawn(jobs.job_export_plan, 1, args=(directory, jobs.hf_train_samples()))[0]


def _assert_same(got: dict, want: dict) -> None:
    assert list(got) == list(want)  # the same HF names in the same order (the buckets depend on it)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_cached_tasks_export_the_values_after_an_optimizer_step(run):
    """Second sync, after one RL step: the plan's reused tasks export bit-exactly the uncached export, and the step
    did move the weights (else the comparison would not show that the cached path reads current values)."""
    assert run["builds_after_two_syncs"] == 1
    assert not any(name.startswith("model.visual.") for name in run["cached"])  # the frozen tower is skipped
    _assert_same(run["cached"], run["uncached"])
    moved = [n for n in run["before"] if not torch.equal(run["before"][n], run["cached"][n])]
    assert len(moved) > len(run["before"]) // 2, moved


def test_a_new_model_object_gets_fresh_tasks(run):
    """The plan handed another model (same structure, other values): new tasks, that model's values."""
    _assert_same(run["other"], run["other_uncached"])
    assert run["builds_after_other"] == 2
    assert not torch.equal(
        run["other"]["model.language_model.norm.weight"], run["cached"]["model.language_model.norm.weight"]
    )


def test_a_replaced_parameter_object_gets_fresh_tasks(run):
    """A parameter object replaced inside the model (not updated in place): new tasks, the new parameter's values."""
    _assert_same(run["replaced"], run["replaced_uncached"])
    assert run["builds_after_replaced"] == 3
    name = "model.language_model.norm.weight"
    assert torch.equal(run["replaced"][name], run["cached"][name] + 5.0)
