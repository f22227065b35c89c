"""Contract (megatron-bridge 0.5.1, real Qwen3VLModel on the CPU harness): with miles_vl.patches installed, a
pre-sharded THD call under CP (input_ids [1, T/C] zigzag-local, the full row's cu_seqlens, every image and video on
every rank) gives the same logits as each sample run alone at CP=1 (fp32, atol 1e-5), over 2 and 4 gloo processes,
with data-side positions, without positions (model-side reconstruction) and with `vision_dp_when_cp` on, for a
micro-batch of text only, one image, two images, a video and image + video + image (images and videos mixed:
`v05_mixed_media_row_order`); the language model receives exactly the data-side positions. With
`vision_dp_when_cp` and a single image, the ranks that encode nothing build their placeholder in the model's dtype
(`v05_empty_vision_rank_dtype`). Every v05 patch reports installed on 0.5.1 and native on 0.6.2. Without the
patches the same calls fail: test_bridge_051_upstream.py and test_source_patch.py pin that (the negative control)."""

from __future__ import annotations

import pytest
import torch

from tests.patches.harness import runner, tiny
from tests.patches.harness.shims import bridge_available

pytestmark = pytest.mark.slow

ATOL = 1e-5
MODES = ("data", "none", "data_vision_dp")


def install(module) -> None:
    """`setup` for runner.run_cp: miles_vl.patches.install (twice: idempotent) plus the v05 list, in case the
    package's PATCHES does not carry it (test_v05_patches_are_registered says whether it does)."""
    import miles_vl.patches
    from miles_vl.patches import bridge_v05
    from miles_vl.patches.core import install_patches

    for _ in range(2):
        miles_vl.patches.install(module)
        install_patches(bridge_v05.PATCHES, module)


def job_status_and_reference(ctx, samples) -> dict:
    """Per-patch detection on the loaded release; at CP=1 also the unpacked reference and a CP=1 packed run."""
    from miles_vl.patches import bridge_v05
    from miles_vl.patches.core import patch_status

    out = {"status": {s.name: s.state for s in patch_status(bridge_v05.PATCHES, ctx.module)}}
    if samples is not None:
        batch = runner.pack(samples, 1)
        out["batch"] = batch
        pixels, videos = tiny.concat_pixels(samples), tiny.concat_video_pixels(samples)
        out["packed"] = runner.job_packed(ctx, batch, pixels, ("data",), samples, videos)
    return out


def job_detect_only(ctx) -> dict:
    from miles_vl.patches import bridge_v05

    return {p.name: p.detect(ctx.module) for p in bridge_v05.PATCHES}


@pytest.fixture(scope="module")
def samples():
    for version in ("0.5.1", "0.6.2"):
        if reason := bridge_available(version):
            pytest.fail(f"harness cannot load megatron-bridge {version}: {reason}")
    return tiny.parity_samples(seed=0)


@pytest.fixture(scope="module")
def cp1(samples):
    return runner.run_cp(job_status_and_reference, 1, version="0.5.1", args=(samples,), setup=install)[0]


@pytest.fixture(scope="module")
def reference(cp1):
    return cp1["packed"]["unpacked"]


def test_v05_patches_are_registered():
    import miles_vl.patches
    from miles_vl.patches import bridge_v05

    names = {p.name for p in miles_vl.patches.PATCHES}
    missing = [p.name for p in bridge_v05.PATCHES if p.name not in names]
    assert not missing, f"miles_vl.patches.PATCHES lacks the 0.5.x patches {missing}"


def test_status_051_installed(cp1):
    assert set(cp1["status"].values()) == {"installed"}, cp1["status"]


def test_detect_062_native(samples):
    (states,) = runner.run_cp(job_detect_only, 1, version="0.6.2")
    assert set(states.values()) == {"native"}, states


def test_cp1_packed_matches_unpacked(cp1, reference):
    """CP=1 is not pre-sharded: upstream's whole-row path stays (positions shifted per segment by up to ~90 here:
    float noise of ~1e-5, hence the looser tolerance than the pre-sharded runs get)."""
    logits, _ = cp1["packed"]["modes"]["data"]
    diffs = runner.max_diff_per_sample(cp1["batch"], logits, reference)
    assert max(diffs) <= 1e-4, diffs


@pytest.mark.parametrize("cp_size", [2, 4])
def test_presharded_cp_matches_unpacked(samples, reference, cp_size):
    single_image = [samples[0], samples[1]]  # vision_dp_when_cp: ranks >= 1 get no image to encode
    # both packs are prefixes of `samples`, so reference[:n] are their unpacked logits
    packs = {"mixed": (samples, MODES), "single_image": (single_image, ("data_vision_dp",))}
    results = runner.run_packed_many(packs, cp_size=cp_size, version="0.5.1", setup=install)
    report = {}
    for name, (batch, runs, extras) in results.items():
        assert extras["versions"] == {"megatron-bridge": "0.5.1", "megatron-core": "0.18.2"}
        for mode, run in runs.items():
            assert run.error is None, (name, mode, run.error)
            assert torch.equal(run.lm_position_ids, batch.position_ids), mode  # per-segment, zigzag-sliced
            report[name, mode] = max(runner.max_diff_per_sample(batch, run.logits, reference[: len(packs[name][0])]))
    print(f"CP={cp_size} max |packed - unpacked| per pack and mode: {report}")
    assert max(report.values()) <= ATOL, report
