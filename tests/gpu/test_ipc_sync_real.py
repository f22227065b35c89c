"""Contract (1 GPU, real SGLang 0.5.16, colocated): after the colocated IPC weight sync (issue 33.1), the engine
computes the trainer's logprobs. A sync that did nothing, or landed the wrong tensors, fails it.

Set-up, as a colocated job runs it: one real SGLang server with `--enable-memory-saver` (ServerSpec(colocated=True))
on the one visible GPU loads a tiny random Qwen3-VL (scripts/gpu/make_tiny_qwen3vl.py); this process is trainer rank 0
on the same GPU. The server releases its memory (weights, KV cache) and resumes it, as around a train step: its weights
are then undefined, so only the sync makes it score right. Then the production sender (`open_colocated_sender`: the
name check against the checkpoint, 1 MiB flat buffers so that several buckets go, one IPC handle per bucket with
`load_format="flattened_bucket"`, the label and the flush on the last request, the value check through
`/weights_checker` on the first sync and, with verify_every=2, on the second) sends two sets of weights: every weight
of the checkpoint perturbed with seed 2, then with seed 1 (the one compared). The tensors start on the GPU, as
megatron-bridge's `export_hf_weights(cpu=False)` yields them.

Compared as tests/gpu/test_nccl_sync_real.py compares (its prompts, scoring, perturbation and bound are reused from
there): the method check (server before any sync vs transformers' forward of the original checkpoint), the contract
(server after the syncs vs transformers' forward of the seed-1 weights), the control (the server before the sync vs
the seed-1 forward: far outside the bound).

    bash scripts/gpu/stack.sh timeout -k 10 300 python -m pytest -q -s tests/gpu/test_ipc_sync_real.py

Environment: as tests/gpu/test_nccl_sync_real.py (MILES_VL_SGLANG_CKPT, MILES_VL_SGLANG_STARTUP_S, OUT: server log as
$OUT/sglang_ipc_sync.log, MILES_VL_SGLANG_PIDFILE). Prints one `GPU-IPC-SYNC {json}` line with the figures: each sync's
seconds, buckets and bytes, and the seconds of 5 more syncs of the 2B-size bucket bound (512 MiB) of the same weights.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time

import pytest
import torch

# the test_* names: the NCCL test's three contract tests (method check, agreement after the sync, the control), which
# pytest collects here too, where they take this module's `sync_run`
from tests.gpu.test_nccl_sync_real import (
    BUCKET_BYTES,
    _writer,
    agreement_figures,
    hf_logprobs,
    make_prompts,
    perturbed,
    record_pid,
    server_for,
    server_logprobs,
    test_bound_catches_unsynced_weights,  # noqa: F401
    test_engine_logprobs_equal_the_trainers_after_the_sync,  # noqa: F401
    test_method_agrees_before_the_sync,  # noqa: F401
    tiny_checkpoint,
    visible_gpus,
    write_like,
)

HAS_SGLANG = importlib.util.find_spec("sglang") is not None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not HAS_SGLANG, reason="needs sglang (scripts/gpu/stack.sh)"),
]


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory) -> dict:
    """Start the colocated server, score, release and resume it, sync twice through the production sender, score
    again, time more syncs, stop."""
    from safetensors.torch import load_file

    from miles_vl.data import load_processor
    from miles_vl.models.qwen3_vl.tokens import special_tokens
    from miles_vl.rollout import sglang as sg
    from miles_vl.rollout.sglang.client import RequestPolicy, SGLangClient
    from miles_vl.rollout.sglang.weights import EngineAddress, open_colocated_sender

    writer = _writer()
    ckpt = tiny_checkpoint(tmp_path_factory, writer)
    original = load_file(str(ckpt / "model.safetensors"))
    first, new = perturbed(original, seed=2), perturbed(original, seed=1)
    new_dir = write_like(ckpt, tmp_path_factory.mktemp("perturbed"), new)
    processor = load_processor(str(ckpt), writer.DEFAULT_MIN_PIXELS, writer.DEFAULT_MAX_PIXELS)
    tokens = special_tokens(processor)
    prompts = make_prompts(processor, tokens)

    spec, env, server = server_for(
        ckpt, processor, colocated=True, gpu=visible_gpus()[0], log_name="sglang_ipc_sync.log"
    )
    log_path = server.log_path
    server.start()
    record_pid(server)
    client = SGLangClient(spec.url, policy=RequestPolicy(timeout_s=120, max_retries=0), liveness=server.death_reason)
    torch.cuda.set_device(0)
    on_gpu = {n: t.to("cuda:0") for n, t in new.items()}
    try:
        startup = float(os.environ.get("MILES_VL_SGLANG_STARTUP_S", "240"))
        started_s = sg.wait_until_healthy(client, server, timeout_s=startup, poll_s=0.5)
        before = [server_logprobs(client, p, tokens.image_token_id) for p in prompts]
        client.release_memory_occupation()  # as around a train step: the weights come back undefined
        client.resume_memory_occupation()

        import ray

        address = EngineAddress(
            url=spec.url, api_key=None, tp_size=1, node_ip=ray.util.get_node_ip_address(), loopback=True
        )
        sender = open_colocated_sender(
            [address], model_path=str(ckpt), verify_every=2, max_bucket_bytes=BUCKET_BYTES, request_timeout_s=60.0
        )
        try:
            reports = [
                sender.send(((n, t.to("cuda:0")) for n, t in first.items()), weight_version="first"),
                sender.send(iter(on_gpu.items()), weight_version="perturbed"),
            ]
        finally:
            sender.close()
        version = client.model_info().get("weight_version")
        after = [server_logprobs(client, p, tokens.image_token_id) for p in prompts]
        # the sync's own time at the production bucket bound (the tiny model is one bucket then); no value check
        sender = open_colocated_sender(
            [address], model_path=str(ckpt), verify_every=0, max_bucket_bytes=512 * 1024**2, request_timeout_s=60.0
        )
        try:
            timed = []
            for k in range(6):
                start = time.monotonic()
                sender.send(iter(on_gpu.items()), weight_version=f"timed-{k}")
                timed.append(round(time.monotonic() - start, 4))
        finally:
            sender.close()
    except BaseException:
        print(f"\n[sglang server log tail: {log_path}]\n{server.log_tail(max_lines=25)}")
        raise
    finally:
        server.stop()
        client.close()

    run = {
        "before": before,
        "after": after,
        "hf_original": hf_logprobs(ckpt, prompts),
        "hf_perturbed": hf_logprobs(new_dir, prompts),
        "reports": reports,
        "version": version,
        "tensors": len(new),
        "bytes": sum(t.numel() * t.element_size() for t in new.values()),
    }
    figures = {
        "server_start_s": round(started_s, 1),
        "syncs": [
            {
                "tensors": r.tensors,
                "bytes": r.bytes,
                "buckets": r.buckets,
                "s": round(r.seconds, 4),
                "verified": r.verified,
            }
            for r in reports
        ],
        "timed_syncs_s_first_excluded": timed[1:],
        "weight_version": version,
        **agreement_figures(run),
    }
    print("GPU-IPC-SYNC " + json.dumps(figures))
    return run


def test_sync_sends_every_tensor_in_buckets_and_checks_the_values(sync_run):
    first, second = sync_run["reports"]
    for r in (first, second):
        assert (r.tensors, r.bytes) == (sync_run["tensors"], sync_run["bytes"])
        assert r.buckets > 1, r  # 1 MiB buckets of a 5.5 MB checkpoint
    assert second.verified, second  # sync 2 of verify_every=2: probes changed since sync 1 and the server saw them
    assert sync_run["version"] == "perturbed", sync_run["version"]  # the label the last request set
