"""metrics/profile.py on a GPU: a profiled block names where the host waited for the device (`syncs`, `sync_sites`),
as torch's sync debug mode reports the waits. The CPU test (tests/metrics/test_profile.py) feeds the counting torch's
warning by hand; this checks that torch raises it on a GPU for the calls the 2B train phase makes (`.item()`, a
bool-mask index, a copy to the host) at the Python frame that made them, once per call, inside a custom autograd
Function's backward too, and that the block leaves the mode off; torch's note that the mode is a prototype is not
shown.
"""

from __future__ import annotations

import pytest
import torch

from miles_vl.metrics.profile import profiled

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HERE = "tests/gpu/test_profile_gpu.py"


class _ReadsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        grad.abs().max().item()  # a wait made by Python code that runs in the backward
        return grad * 2


def _item(x):
    return x.sum().item()


def test_a_profiled_block_names_each_wait_where_it_was_made(recwarn):
    x = torch.randn(64, device="cuda", requires_grad=True)
    assert torch.cuda.get_sync_debug_mode() == 0
    with profiled() as block:
        for _ in range(3):
            _item(x)
        kept = x[x > 0]  # a bool mask: nonzero's size comes from the device
        host = x.detach().cpu()
        _ReadsInBackward.apply(x).sum().backward()
    assert torch.cuda.get_sync_debug_mode() == 0
    assert not [w for w in recwarn if "prototype" in str(w.message) or "synchronizing" in str(w.message)]
    out = block.summary()
    sites = {s["site"].split(" <- ")[0].rsplit(":", 1)[-1]: s for s in out["sync_sites"]}
    print("PROFILE-GPU", out["syncs"], [(s["site"], s["calls"]) for s in out["sync_sites"]])
    assert sites["_item"]["calls"] == 3 and sites["_item"]["site"].startswith(f"{HERE}:")
    # three frames (pytest's the third), but in the backward: autograd's thread has no Python frame above it
    assert all(s["site"].count(" <- ") == 2 for name, s in sites.items() if name != "backward")
    assert "backward" in sites and sites["backward"]["calls"] == 1
    assert "test_a_profiled_block_names_each_wait_where_it_was_made" in sites  # the mask and the copy
    assert out["syncs"] >= 6 and kept.numel() + host.numel() > 0
    assert out["host_waits_s"] >= 0 and out["busy_s"] > 0
