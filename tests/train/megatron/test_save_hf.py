"""Contract: the megatron backend's `save_hf` (megatron-bridge's HF export, every rank exporting, rank 0 writing) is a
directory transformers loads with `from_pretrained`, and that model scores samples as the megatron model does.

Independent reference: the megatron model itself (DP=2, CPU harness, after one RL step with a large learning rate so
that the weights are no longer the checkpoint's), against transformers' Qwen3-VL loaded from the exported directory
alone and run by the torch backend's `compute_logprobs` (one process). Tolerance: fp32 sums in different orders.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.patches.harness.shims import bridge_available
from tests.train.megatron import cpu_parts, jobs


@pytest.fixture(scope="module", autouse=True)
def _bridge():
    if reason := bridge_available("0.6.2"):
        pytest.fail(f"the CPU harness cannot load megatron-bridge 0.6.2: {reason}")


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
