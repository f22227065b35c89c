"""Contract (GPU): the colocated weight payload carries CUDA IPC handles with the device written as its GPU UUID,
and another process (the stand-in server, rebuilding as SGLang 0.5.16's patched `rebuild_cuda_tensor` does) maps
them back to the exact tensors, once per TP rank. With two GPUs, the NCCL path delivers the exact tensors to a
stand-in engine on the other GPU (group built on both sides as 0.5.16's `init_custom_process_group` does).

The same contracts against a real SGLang 0.5.16 server (CUDA IPC into its scheduler, generation, logprobs against
the trainer, release/resume, restart) are in tests/gpu/test_sglang_real.py (scripts/gpu/run_sglang_checks.sh)."""

from __future__ import annotations

import base64
import os
import pickletools
import subprocess
import sys
import time

import pytest
import torch

from miles_vl.rollout.sglang import EngineOptions, SGLangRolloutEngine
from miles_vl.rollout.sglang.weights import DistributedWeightSender, EngineEndpoint, serialize_named_tensors
from tests.rollout.sglang.conftest import FAKE_SERVER, TOKENS, free_port, quick_client

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_payload_names_the_gpu_by_uuid():
    data = base64.b64decode(serialize_named_tensors([("w", torch.ones(3, device="cuda"))]))
    strings = [arg for op, arg, _ in pickletools.genops(data) if isinstance(arg, str)]
    assert str(torch.cuda.get_device_properties(0).uuid) in strings
    assert "rebuild_cuda_tensor" in strings


def start_fake(*args: str, env: dict | None = None):
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, str(FAKE_SERVER), "--model-path", "m", "--port", str(port), *args],
        stdin=subprocess.DEVNULL,
        env=None if env is None else {**os.environ, **env},
    )
    client = quick_client(f"http://127.0.0.1:{port}", timeout_s=120)
    deadline = time.monotonic() + 30
    while not client.is_healthy(timeout_s=0.5):
        assert time.monotonic() < deadline and server.poll() is None, "stand-in server did not start"
        time.sleep(0.05)
    return server, client


def test_cuda_ipc_weights_reach_another_process():
    server, client = start_fake("--tp-size", "2")
    try:
        engine = SGLangRolloutEngine(
            client, TOKENS, EngineOptions(weight_bucket_bytes=1 << 20, weight_device="cuda"), tp_size=2
        )
        g = torch.Generator().manual_seed(0)
        tensors = [
            ("a.weight", torch.randn(256, 512, generator=g).to(torch.bfloat16)),  # 256 KiB
            ("c.bias", torch.randn(7, generator=g)),  # 28 B
            ("b.weight", torch.randn(1024, 300, generator=g)),  # 1.2 MB > 1 MiB bound: alone
        ]
        report = engine.load_weights(tensors)
        assert (report.buckets, report.tensors) == (2, 3)
        received = client.get_json("/_fake/weights")
        assert [w["tp_ranks"] for w in received] == [2, 2]
        flat = [(n, d, v) for w in received for n, d, v in zip(w["names"], w["devices"], w["sums"], strict=True)]
        assert flat == [(n, "cuda", pytest.approx(float(t.double().sum()), rel=1e-6)) for n, t in tensors]
    finally:
        server.kill()
        server.wait(timeout=10)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_weights_reach_an_engine_on_another_gpu(monkeypatch):
    # The stand-in runs NCCL with cuMem off as 0.5.16's server does; the trainer side (this process) runs what the
    # job's Ray runtime env gives every worker (miles_vl/gpu_env.py). Set before this process's first NCCL call.
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "0")
    server, client = start_fake(env={"CUDA_VISIBLE_DEVICES": "1"})
    try:
        sender = DistributedWeightSender(
            [EngineEndpoint(client)],
            master_address="127.0.0.1",
            master_port=free_port(),
            backend="nccl",
            max_bucket_bytes=1 << 20,
            timeout_s=120,
        )
        g = torch.Generator().manual_seed(1)
        tensors = [
            ("a.weight", torch.randn(512, 512, generator=g).to(torch.bfloat16).cuda()),  # 512 KiB
            ("b.weight", torch.randn(1024, 512, generator=g).cuda()),  # 2 MiB: alone
            ("c.bias", torch.randn(5, generator=g).cuda()),
        ]
        try:
            sender.init_group()
            report = sender.send(tensors, weight_version="step-1")
        finally:
            start = time.monotonic()
            sender.close()
        # Both sides tear the communicator down together (destroying one side alone waits for the other).
        assert time.monotonic() - start < 30
        assert (report.buckets, report.tensors) == (3, 3)
        received = client.get_json("/_fake/weights")
        flat = [(n, d, v) for w in received for n, d, v in zip(w["names"], w["devices"], w["sums"], strict=True)]
        assert flat == [(n, "cuda", pytest.approx(float(t.double().sum()), rel=1e-6)) for n, t in tensors]
        assert client.model_info()["weight_version"] == "step-1"
    finally:
        server.kill()
        server.wait(timeout=10)
