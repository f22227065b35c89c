"""Contract: a backward pass through the real Qwen3VLModel on pre-sharded packed THD at CP=2 gives the same
parameter gradients (summed over ranks) as running each sample alone at CP=1 (fp32), vision tower included."""

import pytest

from tests.patches.harness import runner, tiny
from tests.patches.harness.shims import bridge_available
from tests.patches.patch_jobs import install, job_grads


def test_packed_cp2_gradients_equal_unpacked():
    if reason := bridge_available("0.6.2"):
        pytest.fail(f"harness cannot load megatron-bridge 0.6.2: {reason}")
    samples = tiny.default_samples(seed=0)
    (reference,) = runner.run_cp(job_grads, 1, version="0.6.2", args=(samples, "unpacked"), setup=install)
    ranks = runner.run_cp(job_grads, 2, version="0.6.2", args=(samples, "packed"), setup=install)
    assert set(ranks[0]) == set(reference) and any("vision" in n for n in reference)
    worst = 0.0
    for name, ref in reference.items():
        total = sum(r[name] for r in ranks)
        scale = ref.abs().max().clamp(min=1.0)
        worst = max(worst, float((total - ref).abs().max() / scale))
    assert worst < 1e-4, worst
    # negative control: one rank's gradient alone is far from the total
    name = next(n for n in reference if "output_layer" in n)
    assert (ranks[0][name] - reference[name]).abs().max() > 1e-2 * reference[name].abs().max()
