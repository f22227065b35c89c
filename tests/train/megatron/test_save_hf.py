"""Contract: the megatron backend's `save_hf` (megatron-bridge's HF export, every rank exporting, rank 0 writing) is a
directory transformers loads with `from_pretrained`, and that model scores samples as the megatron model does; with
`train.freeze_vision` it still holds the whole model, the frozen vision tower as the checkpoint had it.

Independent reference: the megatron model itself (DP=2, CPU harness, after one RL step with a large learning rate so
that the weights are no longer the checkpoint's), against transformers' Qwen3-VL loaded from the exported directory
alone and run by the torch backend's `compute_logprobs` (one process). Tolerance: fp32 sums in different orders.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.train.megatron import cpu_parts, jobs

pytestmark = pytest.mark.usefixtures("megatron_bridge")


def test_megatron_save_hf_loads_in_transformers_with_the_megatron_logprobs(tmp_path):
    from transformers import AutoModelForImageTextToText

    from miles_vl.train import TorchTrainBackend

    hf_dir, out = tmp_path / "start", tmp_path / "hf"
    start = jobs.write_tiny_hf_checkpoint(str(hf_dir))
    samples = jobs.hf_train_samples()
    runs = cpu_parts.spawn(jobs.job_save_hf, 2, args=(str(hf_dir), samples, str(out)))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(start) and len(set(index["weight_map"].values())) > 1
    model = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    moved = max(float((model.state_dict()[n] - t).abs().max()) for n, t in start.items())
    assert moved > 1e-3  # the export holds the trained weights, not the checkpoint's
    exported = TorchTrainBackend(model, jobs.tokens(), jobs.cross_backend_options()).compute_logprobs(samples)
    for megatron_rank in runs:  # both DP ranks computed the same (gathered) logprobs
        worst = max(float((a - b).abs().max()) for a, b in zip(megatron_rank["logprobs"], exported, strict=True))
        assert worst < 1e-5, worst


def test_megatron_save_hf_of_a_frozen_vision_run_holds_the_checkpoints_vision_tower(tmp_path):
    """Issue 31.5: `save_hf` exporting without the frozen vision tower (as the weight sync does, `export_weights`)
    passed every test; transformers would then initialise the tower at random with only a warning. With
    `train.freeze_vision` the export holds every tensor of the checkpoint, the vision tower's (tower, merger,
    deepstack mergers) equal to the checkpoint's bit for bit (frozen: never trained), the language model's trained.
    Read from the safetensors shards themselves, not through transformers (which would fill in what is missing)."""
    from safetensors.torch import load_file

    from miles_vl.models.qwen3_vl import HF_VISION_PREFIX

    hf_dir, out = tmp_path / "start", tmp_path / "hf"
    start = jobs.write_tiny_hf_checkpoint(str(hf_dir))
    cpu_parts.spawn(jobs.job_save_hf, 2, args=(str(hf_dir), jobs.hf_train_samples(), str(out), True))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    saved = {}
    for shard in sorted(set(index["weight_map"].values())):
        saved |= load_file(out / shard)
    assert set(saved) == set(index["weight_map"]) == set(start)
    vision = [n for n in start if n.startswith(HF_VISION_PREFIX)]
    assert any(".merger." in n for n in vision) and any("deepstack_merger_list." in n for n in vision)
    assert not [n for n in vision if not torch.equal(saved[n], start[n])]
    moved = max(float((saved[n] - t).abs().max()) for n, t in start.items() if not n.startswith(HF_VISION_PREFIX))
    assert moved > 1e-3  # the language model was trained: the export is of the run, not of the checkpoint
