"""Contract (GPU): the torch backend on one GPU in bf16 gives the same loss and gradients for a packed micro-batch
(every sample in one THD row, per-segment positions, segment-aware attention) as for each sample in its own row."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from miles_vl.models.qwen3_vl.model import build_model
from tests.train.test_torch_backend import SPECIAL, backend, grads, make_samples

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_packed_equals_unpacked_on_gpu():
    base = build_model(SPECIAL, tiny=dict(initializer_range=0.2), seed=0, dtype=torch.bfloat16, device="cuda")
    samples = make_samples()
    packed = backend(copy.deepcopy(base), micro_batch_max_tokens=4096)
    alone = backend(copy.deepcopy(base))
    alone._micro_batches = lambda batch: [[i] for i in range(len(batch))]
    assert len(packed._micro_batches(samples)) == 1
    lp1 = torch.cat(packed.compute_logprobs(samples))  # [response tokens of all samples]
    lp2 = torch.cat(alone.compute_logprobs(samples))
    logprob_rel = float((lp1 - lp2).norm() / lp2.norm())
    m1, g1 = grads(packed, samples)
    m2, g2 = grads(alone, samples)
    assert g1.keys() == g2.keys() and any("visual" in k for k in g1)
    flat1 = torch.cat([g1[k].float().flatten() for k in sorted(g1)])
    flat2 = torch.cat([g2[k].float().flatten() for k in sorted(g2)])
    grad_rel = float((flat1 - flat2).norm() / flat2.norm())
    loss_diff = abs(float(m1.loss) - float(m2.loss))
    print(
        "GPU-TORCH-BACKEND "
        + json.dumps(
            {"loss": float(m2.loss), "loss_abs_diff": loss_diff, "logprob_rel": logprob_rel, "grad_rel": grad_rel}
        )
    )
    assert loss_diff <= 2e-2 * max(1.0, abs(float(m2.loss)))
    assert logprob_rel < 3e-2
    assert grad_rel < 3e-2
