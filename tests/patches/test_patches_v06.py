"""Contract (megatron-bridge >= 0.6, real Qwen3VLModel on the CPU harness): with miles_vl.patches installed, a
pre-sharded THD call WITHOUT position_ids gets rank-local per-segment positions rebuilt model-side, and its logits
equal both the call with data-side positions and each sample run alone at CP=1 (fp32, atol 1e-5), over 2 and 4
gloo processes, also with `vision_dp_when_cp`; the micro-batch mixes images and videos (text, one image, two
images, a video, image + video + image), which upstream 0.6.2 cannot order on a local row
(test_harness_qwen3vl.py pins that) and `v06_mixed_media_row_order` fixes; calls with positions are untouched;
install is idempotent and status() reports every patch. Unsupported releases (a module missing a target) fail
loudly at install."""

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
    return tiny.parity_samples(seed=0)


@pytest.fixture(scope="module")
def reference(samples):
    return runner.unpacked_logits(samples, version="0.6.2")


@pytest.mark.parametrize("cp_size", [2, 4])
def test_positions_rebuilt_when_missing(samples, reference, cp_size):
    modes = ("none", "data", "data_vision_dp")
    batch, runs, _ = runner.run_packed(
        samples, cp_size=cp_size, version="0.6.2", position_modes=modes, setup=install_twice
    )
    report = {}
    for mode in modes:  # unpatched 0.6.2 raises for all three (test_harness_qwen3vl.py pins that)
        run = runs[mode]
        assert run.error is None, (mode, run.error)
        assert torch.equal(run.lm_position_ids, batch.position_ids), mode  # what the language model received
        report[mode] = max(runner.max_diff_per_sample(batch, run.logits, reference))
    print(f"0.6.2 + miles_vl.patches, CP={cp_size}: max |packed - unpacked| per mode {report}")
    assert max(report.values()) <= ATOL, report


def test_status_on_the_real_module(samples):
    (rank0, rank1) = runner.run_cp(job_status, 2, version="0.6.2", setup=install_twice)
    states = dict(rank0["patches"])
    assert states["v06_positions_when_missing"] == states["v06_mixed_media_row_order"] == "installed"
    assert all(state in ("installed", "not needed (native)") for state in states.values()), states
    assert rank0["forward_wrappers"] == rank1["forward_wrappers"] == 2  # one per v06 patch, after three installs
    assert rank0["install_is_noop"] and rank1["install_is_noop"]


def test_missing_target_is_a_loud_error():
    fake = ModuleType("megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model")
    fake._is_packed_input_pre_sharded = lambda *a, **k: False  # looks like 0.6 ...
    with pytest.raises(PatchTargetMissing, match=r"has no 'Qwen3VLModel.forward'.*not supported"):
        install(fake)  # ... but has no model class
    states = {s.name: s.state for s in patch_status(__import__("miles_vl.patches").patches.PATCHES, fake)}
    assert states["v06_positions_when_missing"] == "target missing"
