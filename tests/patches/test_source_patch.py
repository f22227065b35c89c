"""Contract: patches/megatron-bridge-0.5.1-qwen3vl-thd-cp.patch is miles_vl.patches' 0.5.x fixes as source.

- It applies cleanly (`patch -p1`, no offset or fuzz; `git apply --check` too) from the root of a copy of the released
  megatron-bridge 0.5.1 tree (the folder holding `megatron/bridge`, as pip installs it); the installed tree is left
  untouched.
- The PATCHED SOURCE, with no `miles_vl.patches` installed (the run calls `miles_vl.patches.install()`, which must
  detect every fix as native on the patched tree and install nothing, so both can be combined safely), makes the real
  Qwen3VLModel on pre-sharded THD input at CP=2 (two gloo processes, the CPU harness) give the same logits as each
  sample alone at CP=1 in the unpatched release (fp32, atol 1e-5): with data-side positions, without positions
  (the patch rebuilds them), and with `vision_dp_when_cp`, on a micro-batch of text only, one image, two images, one
  video and image + video + image; the language model receives exactly the data-side per-segment positions. With
  `vision_dp_when_cp` and a single image, one rank encodes nothing (the empty-rank dtype hunk).
- Negative controls: deliberately wrong positions move the patched logits far beyond the tolerance, and the
  unpatched release on the same calls does not produce them (it raises; where is pinned below).

Three harness runs (CP=1 reference, CP=2 patched, CP=2 unpatched): about a minute on 2 cores.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.patches.harness import runner, tiny
from tests.patches.harness.shims import bridge_051_dir, bridge_available
from tests.patches.patch_jobs import install

pytestmark = pytest.mark.slow

PATCH = Path(__file__).resolve().parents[2] / "patches" / "megatron-bridge-0.5.1-qwen3vl-thd-cp.patch"
ATOL = 1e-5
MODES = ("data", "none", "data_vision_dp", "local_arange")
GOOD_MODES = ("data", "none", "data_vision_dp")


def _tree_digest(root: Path) -> str:
    """sha256 over the relative paths and contents of every .py file under root/megatron/bridge."""
    digest = hashlib.sha256()
    for path in sorted((root / "megatron" / "bridge").rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def trees(tmp_path_factory) -> dict:
    """A copy of the 0.5.1 side install with the patch applied; what `patch` and `git apply` said."""
    if reason := bridge_available("0.5.1"):
        pytest.fail(f"harness cannot load megatron-bridge 0.5.1: {reason}")
    for tool in ("patch", "git"):
        if shutil.which(tool) is None:
            pytest.fail(f"`{tool}` is not installed; this test applies {PATCH.name} with it")
    original = bridge_051_dir()
    root = tmp_path_factory.mktemp("bridge051") / "site-packages"
    digest = _tree_digest(original)
    shutil.copytree(original, root, ignore=shutil.ignore_patterns("__pycache__"))
    out = {"original": original, "digest": digest, "root": root}
    out["git_check"] = _run(["git", "apply", "--check", "-v", str(PATCH)], root)
    out["dry_run"] = _run(["patch", "-p1", "--dry-run", "-i", str(PATCH)], root)
    if out["dry_run"].returncode == 0:
        out["apply"] = _run(["patch", "-p1", "--forward", "--no-backup-if-mismatch", "-i", str(PATCH)], root)
    return out


@pytest.fixture(scope="module")
def samples():
    return tiny.parity_samples(seed=0)


def _packs(samples) -> dict:
    single_image = [samples[0], samples[1]]  # vision_dp_when_cp at CP=2: rank 1 gets no image to encode
    return {"mixed": (samples, MODES), "single_image": (single_image, ("data_vision_dp",))}


@pytest.fixture(scope="module")
def reference(samples, trees):
    """Each sample alone at CP=1 in the unpatched release."""
    return dict(zip([s.name for s in samples], runner.unpacked_logits(samples, version="0.5.1"), strict=True))


@pytest.fixture(scope="module")
def patched(samples, trees):
    assert trees["dry_run"].returncode == 0, "the patch does not apply; see test_patch_applies_cleanly"
    return runner.run_packed_many(
        _packs(samples), cp_size=2, version="0.5.1", bridge_root=str(trees["root"]), setup=install
    )


def _unpatched_packs(samples) -> dict:
    """The patched run's packs, plus one modality at a time: each stops at a different upstream bug."""
    return _packs(samples) | {"images": (samples[:3], ("data",)), "text": ([samples[0], samples[0]], ("data",))}


@pytest.fixture(scope="module")
def unpatched(samples, trees):
    return runner.run_packed_many(_unpatched_packs(samples), cp_size=2, version="0.5.1")


def _diffs(batch, run, reference, samples) -> list[float]:
    return runner.max_diff_per_sample(batch, run.logits, [reference[s.name] for s in samples])


def test_patch_applies_cleanly(trees):
    root = trees["root"]
    dry, git = trees["dry_run"], trees["git_check"]
    assert dry.returncode == 0, f"patch -p1 --dry-run failed in {root}:\n{dry.stdout}\n{dry.stderr}"
    assert "offset" not in dry.stdout and "fuzz" not in dry.stdout, f"the patch applies only loosely:\n{dry.stdout}"
    assert git.returncode == 0, f"git apply --check failed in {root}:\n{git.stdout}\n{git.stderr}"
    applied = trees["apply"]
    assert applied.returncode == 0, f"patch -p1 failed in {root}:\n{applied.stdout}\n{applied.stderr}"
    assert not list(root.rglob("*.rej")) and not list(root.rglob("*.orig"))
    model_dir = root / "megatron/bridge/models/qwen_vl/modelling_qwen3_vl"
    assert (model_dir / "thd_cp.py").is_file()
    source = (model_dir / "model.py").read_text() + (model_dir / "thd_cp.py").read_text()
    assert "miles_vl" not in source.replace("Added by the miles_vl source patch", "")  # self-contained
    readme = (PATCH.parent / "README.md").read_text()  # the checksums users verify against
    for path in (
        trees["original"] / model_dir.relative_to(root) / "model.py",
        model_dir / "model.py",
        model_dir / "thd_cp.py",
    ):
        assert hashlib.sha256(path.read_bytes()).hexdigest() in readme, f"patches/README.md lacks the sha256 of {path}"


@pytest.mark.parametrize("pack", ["mixed", "single_image"])
def test_patched_source_presharded_cp2_matches_unpacked(patched, reference, samples, trees, pack):
    batch, runs, extras = patched[pack]
    assert extras["versions"] == {"megatron-bridge": "0.5.1", "megatron-core": "0.18.2"}
    assert Path(extras["model_file"]).is_relative_to(trees["root"]), extras["model_file"]  # the patched copy ...
    # ... and install() found every THD/CP fix native there (the deepstack-gradient fix is not in the source patch)
    assert extras["miles_vl_patches"] == ["vision_recompute_deepstack_grads"]
    pack_samples = _packs(samples)[pack][0]
    report = {}
    for mode in (m for m in _packs(samples)[pack][1] if m in GOOD_MODES):
        run = runs[mode]
        assert run.error is None, (mode, run.error)
        assert torch.equal(run.lm_position_ids, batch.position_ids), mode  # per-segment, zigzag-sliced
        report[mode] = max(_diffs(batch, run, reference, pack_samples))
    print(f"patched 0.5.1 source, CP=2, pack {pack}: max |packed - unpacked| per mode {report}")
    assert max(report.values()) <= ATOL, report


def test_patched_source_wrong_positions_are_detected(patched, reference, samples):
    batch, runs, _ = patched["mixed"]
    diff = max(_diffs(batch, runs["local_arange"], reference, samples))
    print(f"patched 0.5.1 source, CP=2, rank-local arange positions: max diff {diff}")
    assert diff > 1e-2, diff


def test_unpatched_source_does_not_match(unpatched, reference, samples):
    """The release as shipped, same calls: the mixed micro-batch stops at `reorganize_inputs` (it scans the local
    row for vision blocks), the single image with `vision_dp_when_cp` at the keyword all-gather; images alone at the
    scatter of every image's rows into the local row, text alone after the double split (the language model gets
    T/C^2 tokens, which the harness attention rejects). Any mode that ran would have to differ by far more than the
    tolerance."""
    outcome = {}
    for pack, (batch, runs, _) in unpatched.items():
        for mode, run in runs.items():
            if run.error is None:
                diff = max(_diffs(batch, run, reference, _unpatched_packs(samples)[pack][0]))
                assert diff > 1e-2, (pack, mode, diff)
                outcome[pack, mode] = f"max diff {diff:.3g}"
            else:
                outcome[pack, mode] = f"{run.error[0]} at {run.error[2]}"
    print(f"unpatched 0.5.1 source, CP=2: {outcome}")
    where = "megatron/bridge/models/qwen_vl/modelling_qwen3_vl/"
    assert outcome == {
        **{("mixed", mode): f"AssertionError at {where}utils.py:345 in reorganize_inputs" for mode in MODES},
        ("single_image", "data_vision_dp"): f"TypeError at {where}model.py:482 in forward",
        ("images", "data"): f"RuntimeError at {where}model.py:501 in forward",
        ("text", "data"): f"ValueError at {where}attention.py:233 in forward",  # raised by the core attention it calls
    }


def test_installed_tree_is_unchanged(trees, patched, unpatched):
    assert _tree_digest(trees["original"]) == trees["digest"]
    assert not (trees["original"] / "megatron/bridge/models/qwen_vl/modelling_qwen3_vl/thd_cp.py").exists()
