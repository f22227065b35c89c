"""The CPU harness runs the real megatron-bridge Qwen3-VL, and its THD/CP parity check has teeth.

Contract (DESIGN §5): with the test-only shims, a tiny random Qwen3-VL built through megatron-bridge's own
`Qwen3VLModel` gives, for samples laid out by `miles_vl.packing` (text only, one image, two images, one video, and
image + video + image in one prompt), the same logits as each sample run alone at CP=1 with transformers' reference
positions:
- packed THD at CP=1 (full row), all five in one micro-batch, and
- pre-sharded THD at CP=2 (also with `vision_dp_when_cp`) and CP=4 over gloo, with rank-local 3-D position_ids
  (fp32, atol 1e-5), for an image micro-batch (text, one image, two images) and a video one (text, video),
on megatron-bridge 0.6.2, which supports pre-sharded input natively. Without position_ids 0.6.2 raises its
ValueError, deliberately wrong positions move the logits far beyond the tolerance (so equality means something),
and a pre-sharded micro-batch mixing images and videos stops at upstream's `reorganize_inputs` (pinned here;
`miles_vl.patches` fixes it, tests/patches/test_patches_v06.py).

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
    """text, one_image, two_images, video, image_video_image (tiny.parity_samples)."""
    return tiny.parity_samples(seed=0)


def _packs(samples) -> dict:
    """The pre-sharded micro-batches 0.6.2 handles natively: one modality each."""
    return {"images": samples[:3], "video": [samples[0], samples[3]]}


@pytest.fixture(scope="module")
def cp1_062(samples):
    """0.6.2, CP=1: the unpacked reference (plus the one-image and the video sample with other pixels) and the
    packed row of all five samples."""
    _require("0.6.2")
    other_pixels = dataclasses.replace(samples[1], pixel_values=torch.randn_like(samples[1].pixel_values))
    other_video = dataclasses.replace(samples[3], pixel_values_videos=torch.randn_like(samples[3].pixel_values_videos))
    return runner.run_packed(
        samples,
        cp_size=1,
        version="0.6.2",
        with_reference=True,
        reference_samples=[*samples, other_pixels, other_video],
    )


@pytest.fixture(scope="module")
def cp2_062(samples):
    """0.6.2, CP=2, as shipped: the image pack in every position mode, the video pack, and the mixed pack."""
    _require("0.6.2")
    packs = _packs(samples)
    return runner.run_packed_many(
        {
            "images": (packs["images"], runner.POSITION_MODES),
            "video": (packs["video"], ("data", "data_vision_dp")),
            "mixed": (samples, ("data",)),
        },
        cp_size=2,
        version="0.6.2",
    )


def _reference(cp1, samples) -> list[torch.Tensor]:
    """The unpacked CP=1 logits of `samples` (by name), [L_i, V] each."""
    parity = tiny.parity_samples(seed=0)
    by_name = dict(zip([s.name for s in parity], cp1[2]["unpacked"][: len(parity)], strict=True))
    return [by_name[s.name] for s in samples]


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


def test_reference_positions_split_videos_per_frame_group(samples):
    """transformers' Qwen3-VL positions of a video: each frame group (after its timestamp text and <vs>) is its own
    (1, h/2, w/2) block, so the temporal row restarts at the group's start instead of counting frames."""
    pos = tiny.reference_positions(samples[3])  # 2 text, <vs>, then per frame: 3 timestamp, <vs>, 2x3 video, <ve>
    assert pos[:, 7:14].tolist() == [[7] * 6 + [10], [7, 7, 7, 8, 8, 8, 10], [7, 8, 9, 7, 8, 9, 10]]
    assert pos[:, 14:25].tolist() == [
        [11, 12, 13, 14] + [15] * 6 + [18],
        [11, 12, 13, 14, 15, 15, 15, 16, 16, 16, 18],
        [11, 12, 13, 14, 15, 16, 17, 15, 16, 17, 18],
    ]


def test_reference_positions_agree_with_miles_vl(samples):
    """transformers' get_rope_index and miles_vl's data-side positions agree on every parity sample (videos too)."""
    from miles_vl.packing import get_rope_index

    for s in samples:
        ours = get_rope_index(s.input_ids, s.image_grid_thw, s.video_grid_thw, media_end=s.prompt_len, **tiny.TOKENS)
        assert torch.equal(ours, tiny.reference_positions(s)), s.name


def test_cp1_packed_equals_unpacked(cp1_062, samples):
    """All five samples in one micro-batch (images and videos mixed): at CP=1 0.6.2 orders the media itself."""
    batch, runs, extras = cp1_062
    assert extras["versions"]["megatron-bridge"] == "0.6.2"
    _assert_matches_reference(batch, runs["data"], _reference(cp1_062, samples))


def test_logits_depend_on_pixels(cp1_062, samples):
    """Guards against a vacuous harness: the image really reaches the language model (vision rows and deepstack),
    so a wrong vision-row selection under CP would show in the logits. Text before the image is unaffected."""
    reference = cp1_062[2]["unpacked"]
    for index, other, token in ((1, reference[5], tiny.IMAGE), (3, reference[6], tiny.VIDEO)):
        first_media_token = int((samples[index].input_ids == token).nonzero()[0])
        assert torch.equal(other[:first_media_token], reference[index][:first_media_token])
        assert (other[first_media_token:] - reference[index][first_media_token:]).abs().max() > 1e-1


@pytest.mark.slow
@pytest.mark.parametrize("pack", ["images", "video"])
def test_cp2_presharded_equals_unpacked(cp1_062, cp2_062, samples, pack):
    batch, runs, extras = cp2_062[pack]
    assert extras["weights_checksum"][0] == extras["weights_checksum"][1] == cp1_062[2]["weights_checksum"][0]
    _assert_matches_reference(batch, runs["data"], _reference(cp1_062, _packs(samples)[pack]))


@pytest.mark.slow
def test_cp2_presharded_without_positions_raises(cp2_062):
    error = cp2_062["images"][1]["none"].error
    assert error is not None and error[0] == "ValueError"
    assert "require explicit rank-local 3D MRoPE position_ids" in error[1]


@pytest.mark.slow
def test_cp2_wrong_positions_are_detected(cp1_062, cp2_062, samples):
    """Rank-local arange positions (the classic bug) are off by far more than the tolerance."""
    batch, runs, _ = cp2_062["images"]
    diffs = runner.max_diff_per_sample(batch, runs["local_arange"].logits, _reference(cp1_062, samples[:3]))
    assert max(diffs) > 1e-2, diffs


@pytest.mark.slow
def test_cp2_presharded_mixed_media_fails_upstream(cp2_062):
    """Upstream limit: with images AND videos in one pre-sharded micro-batch, 0.6.2's `reorganize_inputs` orders
    the vision blocks by scanning the rank-local row (blocks cut or missing) and its count assertion fails. If this
    starts passing, 0.6.x handles it and `v06_mixed_media_row_order` can detect it as native."""
    error = cp2_062["mixed"][1]["data"].error
    assert error is not None
    assert (error[0], error[2]) == (
        "AssertionError",
        "megatron/bridge/models/qwen_vl/modelling_qwen3_vl/utils.py:345 in reorganize_inputs",
    )


@pytest.mark.slow
def test_cp4_presharded_equals_unpacked(cp1_062, samples):
    _require("0.6.2")
    packs = _packs(samples)
    for name, (batch, runs, _) in runner.run_packed_many(packs, cp_size=4, version="0.6.2").items():
        _assert_matches_reference(batch, runs["data"], _reference(cp1_062, packs[name]))


@pytest.mark.slow
@pytest.mark.parametrize("pack", ["images", "video"])
def test_cp2_presharded_vision_dp_equals_unpacked(cp1_062, cp2_062, samples, pack):
    """`vision_dp_when_cp`: each CP rank encodes some of the images (video frame groups), the embeddings are
    all-gathered, then the CP-local rows are selected; same logits."""
    batch, runs, _ = cp2_062[pack]
    _assert_matches_reference(batch, runs["data_vision_dp"], _reference(cp1_062, _packs(samples)[pack]))
