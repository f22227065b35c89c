"""The CPU harness runs the real megatron-bridge Qwen3-VL, and its THD/CP parity check has teeth.

Contract (DESIGN §5): with the test-only shims, a tiny random Qwen3-VL built through megatron-bridge's own
`Qwen3VLModel` gives, for a pack of samples (text only, one image, two images) laid out by `miles_vl.packing`,
the same logits as each sample run alone at CP=1 with transformers' reference positions:
- packed THD at CP=1 (full row), and
- pre-sharded THD at CP=2 (also with `vision_dp_when_cp`) and CP=4 over gloo, with rank-local 3-D position_ids
  (fp32, atol 1e-5),
on megatron-bridge 0.6.2, which supports pre-sharded input natively. Without position_ids 0.6.2 raises its
ValueError, and deliberately wrong positions move the logits far beyond the tolerance (so equality means something).

megatron-bridge 0.5.1 (side install) is pinned as it ships: it runs the unpacked reference and the CP=1 pack, and
fails on pre-sharded CP input; tests/patches/test_bridge_051_upstream.py pins how.

Each fixture spawns fresh worker processes (importing megatron takes ~10 s each); the file takes ~3 min on 2 cores.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.patches.harness import runner, tiny
from tests.patches.harness.shims import bridge_available

ATOL = 1e-5


def _require(version: str) -> None:
    reason = bridge_available(version)
    if reason:
        pytest.fail(f"harness cannot load megatron-bridge {version}: {reason}")


@pytest.fixture(scope="module")
def samples():
    return tiny.default_samples(seed=0)


@pytest.fixture(scope="module")
def cp1_062(samples):
    """0.6.2, CP=1: the unpacked reference (plus the one-image sample with other pixels) and the packed row."""
    _require("0.6.2")
    other_pixels = dataclasses.replace(samples[1], pixel_values=torch.randn_like(samples[1].pixel_values))
    return runner.run_packed(
        samples, cp_size=1, version="0.6.2", with_reference=True, reference_samples=[*samples, other_pixels]
    )


@pytest.fixture(scope="module")
def cp2_062(samples):
    _require("0.6.2")
    return runner.run_packed(samples, cp_size=2, version="0.6.2", position_modes=runner.POSITION_MODES)


def _reference(cp1):
    return cp1[2]["unpacked"][:3]


def _assert_matches_reference(batch, run, reference):
    assert run.error is None, run.error
    diffs = runner.max_diff_per_sample(batch, run.logits, reference)
    assert max(diffs) <= ATOL, f"max |packed - unpacked| per sample: {diffs}"
    # and the language model received exactly the data-side per-segment positions
    torch.testing.assert_close(run.lm_position_ids, batch.position_ids, rtol=0, atol=0)


def test_reference_positions_are_per_sample(samples):
    """The reference positions restart at 0 per sample and follow the image grids (not a plain arange)."""
    pos = tiny.reference_positions(samples[1])  # 3 text, <vs>, 2x3 merged image, <ve>, ...
    assert pos[:, :4].tolist() == [[0, 1, 2, 3]] * 3
    assert pos[:, 4:10].tolist() == [[4] * 6, [4, 4, 4, 5, 5, 5], [4, 5, 6, 4, 5, 6]]
    assert pos[:, 10].tolist() == [7, 7, 7]


def test_cp1_packed_equals_unpacked(cp1_062):
    batch, runs, extras = cp1_062
    assert extras["versions"]["megatron-bridge"] == "0.6.2"
    _assert_matches_reference(batch, runs["data"], _reference(cp1_062))


def test_logits_depend_on_pixels(cp1_062, samples):
    """Guards against a vacuous harness: the image really reaches the language model (vision rows and deepstack),
    so a wrong vision-row selection under CP would show in the logits. Text before the image is unaffected."""
    reference = cp1_062[2]["unpacked"]
    same_ids_other_pixels = reference[3]
    first_image_token = int((samples[1].input_ids == tiny.IMAGE).nonzero()[0])
    assert torch.equal(same_ids_other_pixels[:first_image_token], reference[1][:first_image_token])
    assert (same_ids_other_pixels[first_image_token:] - reference[1][first_image_token:]).abs().max() > 1e-1


@pytest.mark.slow
def test_cp2_presharded_equals_unpacked(cp1_062, cp2_062):
    batch, runs, extras = cp2_062
    assert extras["weights_checksum"][0] == extras["weights_checksum"][1] == cp1_062[2]["weights_checksum"][0]
    _assert_matches_reference(batch, runs["data"], _reference(cp1_062))


@pytest.mark.slow
def test_cp2_presharded_without_positions_raises(cp2_062):
    error = cp2_062[1]["none"].error
    assert error is not None and error[0] == "ValueError"
    assert "require explicit rank-local 3D MRoPE position_ids" in error[1]


@pytest.mark.slow
def test_cp2_wrong_positions_are_detected(cp1_062, cp2_062):
    """Rank-local arange positions (the classic bug) are off by far more than the tolerance."""
    batch, runs, _ = cp2_062
    diffs = runner.max_diff_per_sample(batch, runs["local_arange"].logits, _reference(cp1_062))
    assert max(diffs) > 1e-2, diffs


@pytest.mark.slow
def test_cp4_presharded_equals_unpacked(cp1_062, samples):
    _require("0.6.2")
    batch, runs, _ = runner.run_packed(samples, cp_size=4, version="0.6.2")
    _assert_matches_reference(batch, runs["data"], _reference(cp1_062))


@pytest.mark.slow
def test_cp2_presharded_vision_dp_equals_unpacked(cp1_062, cp2_062):
    """`vision_dp_when_cp`: each CP rank encodes some of the images, the embeddings are all-gathered, then the
    CP-local rows are selected; same logits."""
    batch, runs, _ = cp2_062
    _assert_matches_reference(batch, runs["data_vision_dp"], _reference(cp1_062))
