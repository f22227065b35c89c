"""Contract (megatron-bridge >= 0.6, real Qwen3VLModel on the CPU harness): with miles_vl.patches installed, a
pre-sharded THD call WITHOUT position_ids gets rank-local per-segment positions rebuilt model-side, and its logits
equal both the call with data-side positions and each sample run alone at CP=1 (fp32, atol 1e-5), over 2 and 4
gloo processes; calls with positions are untouched; install is idempotent and status() reports every patch.
Unsupported releases (a module missing a target) fail loudly at install."""

from types import ModuleType

import pytest
import torch

from miles_vl.patches import PatchTargetMissing, install
from miles_vl.patches.core import patch_status
from tests.patches.harness import runner, tiny
from tests.patches.harness.shims import bridge_available
from tests.patches.patch_jobs import install as install_twice
from tests.patches.patch_jobs import job_status

ATOL = 1e-5


@pytest.fixture(scope="module")
def samples():
    if reason := bridge_available("0.6.2"):
        pytest.fail(f"harness cannot load megatron-bridge 0.6.2: {reason}")
    return tiny.default_samples(seed=0)


@pytest.fixture(scope="module")
def reference(samples):
    return runner.unpacked_logits(samples, version="0.6.2")


@pytest.mark.parametrize("cp_size", [2, 4])
def test_positions_rebuilt_when_missing(samples, reference, cp_size):
    batch, runs, _ = runner.run_packed(
        samples, cp_size=cp_size, version="0.6.2", position_modes=("none", "data"), setup=install_twice
    )
    none, data = runs["none"], runs["data"]
    assert none.error is None, none.error  # unpatched 0.6.2 raises here (test_harness_qwen3vl.py pins that)
    assert torch.equal(none.lm_position_ids, batch.position_ids)  # what the language model received
    assert max(runner.max_diff_per_sample(batch, none.logits, reference)) <= ATOL
    assert max(runner.max_diff_per_sample(batch, data.logits, reference)) <= ATOL


def test_status_on_the_real_module(samples):
    (rank0, rank1) = runner.run_cp(job_status, 2, version="0.6.2", setup=install_twice)
    states = dict(rank0["patches"])
    assert states["v06_positions_when_missing"] == "installed"
    assert all(state in ("installed", "not needed (native)") for state in states.values()), states
    assert rank0["wrapped_once"] and rank1["wrapped_once"]


def test_missing_target_is_a_loud_error():
    fake = ModuleType("megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model")
    fake._is_packed_input_pre_sharded = lambda *a, **k: False  # looks like 0.6 ...
    with pytest.raises(PatchTargetMissing, match=r"has no 'Qwen3VLModel.forward'.*not supported"):
        install(fake)  # ... but has no model class
    states = {s.name: s.state for s in patch_status(__import__("miles_vl.patches").patches.PATCHES, fake)}
    assert states["v06_positions_when_missing"] == "target missing"
