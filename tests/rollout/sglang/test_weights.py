"""Contract: SGLang's side of the weight sync (miles_vl/rollout/sglang/weights.py). A colocated payload references only
modules SGLang 0.5.16's unpickler allows, rebuilds the exact tensors, and names a CUDA tensor's GPU by UUID; the NCCL
path forms one group of 1 + sum(tp) ranks with the trainer as rank 0 and, per bucket, POSTs names/dtypes/shapes while
broadcasting the tensors in the same order (exercised end to end with gloo against two stand-in servers, each its own
process), then labels the version, flushes, and finally destroys the group; a refused, dead or silent server ends
the sync with an error naming it (issue 32.2), and peers that disagree on NCCL_CUMEM_ENABLE are refused (32.1)."""

from __future__ import annotations

import base64
import pickle
import pickletools
import subprocess
import sys
import threading
import time

import pytest
import torch

from miles_vl.rollout.sglang import weights
from miles_vl.rollout.sglang.client import SGLangError
from miles_vl.rollout.sglang.verify import WeightSyncError
from miles_vl.rollout.sglang.weights import (
    ColocatedWeightSender,
    DistributedWeightSender,
    EngineEndpoint,
    group_layout,
    serialize_flat_bucket,
    serialize_named_tensors,
)
from miles_vl.rollout.weight_sync import flat_layout, pack_bucket
from tests.rollout.sglang.conftest import FAKE_SERVER, free_port, quick_client
from tests.rollout.sglang.fake_server import (
    ALLOWED_MODULE_PREFIXES,
    _unpickle_allowlisted,
    rebuild_flattened_bucket,
)


def test_payload_passes_sglangs_unpickler_and_rebuilds_the_tensors():
    g = torch.Generator().manual_seed(1)
    tensors = [
        ("a.weight", torch.randn(3, 4, generator=g).to(torch.bfloat16)),
        ("b.bias", torch.arange(5, dtype=torch.int64)),
        ("c.weight", torch.randn(4, 2, generator=g).t()),  # non-contiguous view
    ]
    data = base64.b64decode(serialize_named_tensors(tensors), validate=True)
    modules = {arg for op, arg, _ in pickletools.genops(data) if op.name == "SHORT_BINUNICODE" and "." in str(arg)}
    referenced = {m for m in modules if m.startswith(("torch", "multiprocessing"))}
    assert referenced and all(any((m + ".").startswith(p) for p in ALLOWED_MODULE_PREFIXES) for m in referenced)
    rebuilt = _unpickle_allowlisted(data)  # same process: CPU storages travel as file descriptors
    assert [n for n, _ in rebuilt] == [n for n, _ in tensors]
    for (_, got), (_, want) in zip(rebuilt, tensors, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    with pytest.raises(RuntimeError, match="Blocked unsafe class loading"):
        _unpickle_allowlisted(pickle.dumps(subprocess.Popen))


def test_group_layout_puts_the_trainer_at_rank_0():
    assert group_layout([1]) == ([1], 2)
    assert group_layout([2, 2, 4]) == ([1, 3, 5], 9)
    with pytest.raises(ValueError, match="tp_size must be >= 1"):
        group_layout([0])


def _start_fake(port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(FAKE_SERVER), "--model-path", "m", "--port", str(port), "--weight-version", "base"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@pytest.mark.slow
def test_nccl_path_end_to_end_over_gloo():
    ports = [free_port(), free_port()]
    servers = [_start_fake(p) for p in ports]
    try:
        clients = [quick_client(f"http://127.0.0.1:{p}", timeout_s=60) for p in ports]
        deadline = time.monotonic() + 20
        while not all(c.is_healthy(timeout_s=0.5) for c in clients):
            assert time.monotonic() < deadline, "stand-in servers did not start"
            time.sleep(0.05)
        sender = DistributedWeightSender(
            [EngineEndpoint(c) for c in clients],
            master_address="127.0.0.1",
            master_port=free_port(),
            group_name="miles_vl_test_sync",
            backend="gloo",
            max_bucket_bytes=64,
            timeout_s=60,
        )
        g = torch.Generator().manual_seed(2)
        tensors = [
            ("model.layers.0.weight", torch.randn(4, 3, generator=g)),  # 48 B
            ("model.norm.weight", torch.randn(4, generator=g).to(torch.bfloat16)),  # 8 B
            ("lm_head.weight", torch.randn(6, 4, generator=g)),  # 96 B: alone
            ("model.visual.bias", torch.arange(3, dtype=torch.int32)),  # 12 B
        ]
        try:
            sender.init_group()
            report = sender.send(iter(tensors), weight_version="step-1")
        finally:
            sender.close()
        assert (report.buckets, report.tensors, report.bytes) == (3, 4, 164)
        assert set(report.phases) == {"export", "send", "wait", "label"}  # where the sync's seconds went
        assert all(t >= 0 for t in report.phases.values()) and sum(report.phases.values()) <= report.seconds

        for offset, client in zip([1, 2], clients, strict=True):
            calls = client.get_json("/_fake/calls")
            assert [c["path"] for c in calls[-7:]] == [
                "/init_weights_update_group",
                "/update_weights_from_distributed",
                "/update_weights_from_distributed",
                "/update_weights_from_distributed",
                "/update_weight_version",
                "/flush_cache",
                "/destroy_weights_update_group",
            ]
            assert calls[-7]["body"] == {"master_address": "127.0.0.1", "master_port": sender.rendezvous.master_port,
                                         "rank_offset": offset, "world_size": 3, "group_name": "miles_vl_test_sync",
                                         "backend": "gloo"}  # fmt: skip
            assert calls[-6]["body"] == {"names": ["model.layers.0.weight", "model.norm.weight"],
                                         "dtypes": ["float32", "bfloat16"], "shapes": [[4, 3], [4]],
                                         "group_name": "miles_vl_test_sync", "flush_cache": False,
                                         "abort_all_requests": False, "weight_version": None}  # fmt: skip
            received = client.get_json("/_fake/weights")
            flat = [(n, s, v) for w in received for n, s, v in zip(w["names"], w["shapes"], w["sums"], strict=True)]
            assert flat == [(n, list(t.shape), pytest.approx(float(t.double().sum()))) for n, t in tensors]
            assert client.model_info()["weight_version"] == "step-1"
    finally:
        for s in servers:
            s.kill()
            s.wait(timeout=10)


def _failing_sync(fault: dict, *, sync_timeout_s: float | None = None, limit_s: float = 30.0):
    """One gloo sync from a sender to two stand-in servers, the second of which has `fault` on
    `/update_weights_from_distributed` (its second bucket: mid-sync); run in a thread bounded by `limit_s`.

    Returns:
        (the error the sync raised, its seconds, the faulty server's URL, the seconds `close()` took).
    """
    import threading

    ports = [free_port(), free_port()]
    servers = [_start_fake(p) for p in ports]
    try:
        clients = [quick_client(f"http://127.0.0.1:{p}", timeout_s=600) for p in ports]  # SGLangClient's default
        deadline = time.monotonic() + 20
        while not all(c.is_healthy(timeout_s=0.5) for c in clients):
            assert time.monotonic() < deadline, "stand-in servers did not start"
            time.sleep(0.05)
        clients[1].post_json("/_fake/inject", {"path": "/update_weights_from_distributed", "after": 1, **fault})
        sender = DistributedWeightSender(
            [EngineEndpoint(c) for c in clients],
            master_address="127.0.0.1",
            master_port=free_port(),
            group_name=f"miles_vl_test_sync_{ports[0]}",  # a group left broken by another test keeps its name
            backend="gloo",
            max_bucket_bytes=16 * 2**20,
            timeout_s=600,
            **({} if sync_timeout_s is None else {"sync_timeout_s": sync_timeout_s}),
        )
        sender.init_group()
        # 16 MiB tensors: more than a socket buffer, so a broadcast to a peer that does not receive blocks (gloo)
        tensors = [(f"model.layers.{i}.weight", torch.full((4 * 2**20,), float(i))) for i in range(3)]
        outcome: dict = {}

        def sync() -> None:
            try:
                sender.send(iter(tensors), weight_version="step-1")
            except Exception as err:
                outcome["error"] = err

        start = time.monotonic()
        thread = threading.Thread(target=sync, daemon=True)
        thread.start()
        thread.join(limit_s)
        assert not thread.is_alive(), f"the sync still waits {limit_s} s after the server's {fault['kind']} fault"
        seconds = time.monotonic() - start
        closing = time.monotonic()
        sender.close()  # must not wait for the broken peer either
        return outcome.get("error"), seconds, clients[1].base_url, time.monotonic() - closing
    finally:
        for s in servers:
            s.kill()
            s.wait(timeout=10)


@pytest.mark.slow
def test_a_bucket_refused_mid_sync_ends_the_sync_naming_the_server_and_its_message():
    """Issue 32.2: 0.5.16 answers 400 when its side of the broadcast fails ("Failed to update parameter online"),
    and the trainer then waited in its broadcast forever. Now the refusal ends the sync at once, naming the endpoint
    and the server's message, and the broken group is dropped without a destroy that would wait for the peer."""
    error, seconds, url, closing = _failing_sync({"kind": "status", "value": 400})
    assert error is not None and f"{url}/update_weights_from_distributed" in str(error)
    assert "HTTP 400: injected HTTP 400" in str(error)
    assert seconds < 10 and closing < 5


@pytest.mark.slow
def test_a_server_that_never_answers_ends_the_sync_at_its_deadline():
    """A server stuck in the sync (it neither receives nor answers, as a scheduler blocked in a broken receive) ends
    the sync at the bucket's deadline (rollout.sglang.sync_timeout_s), naming the endpoint, not at the HTTP timeout
    (600 s here)."""
    error, seconds, url, closing = _failing_sync({"kind": "delay", "value": 3600}, sync_timeout_s=2)
    assert error is not None and "did not complete within its deadline (rollout.sglang.sync_timeout_s=2 s)" in str(
        error
    )
    assert f"{url}/update_weights_from_distributed" in str(error)
    assert 2 <= seconds < 10 and closing < 5


@pytest.mark.slow
def test_a_server_that_dies_mid_sync_is_named_with_what_its_client_saw():
    """A server process that dies in the middle of a bucket: the error names its endpoint and the dropped
    connection, where gloo alone reported a peer's 'Connection reset' without saying which server it was."""
    error, seconds, url, closing = _failing_sync({"kind": "exit", "value": 1})
    assert error is not None and f"{url}/update_weights_from_distributed" in str(error)
    assert "Server disconnected without sending a response" in str(error)
    assert seconds < 10 and closing < 5


def test_cuda_tensors_name_their_gpu_by_uuid_not_index(monkeypatch):
    """The colocated payload must carry the GPU's UUID where torch writes the device index (issue 20.8: a payload
    with the index survived the CPU suite). The trainer's engine actor and the SGLang server see different
    CUDA_VISIBLE_DEVICES, so index 3 here can be another GPU there. Without a GPU, torch's CUDA reduction is stood in
    by a function of the same name and argument layout, checked against torch's own `rebuild_cuda_tensor`."""
    import inspect

    from torch.multiprocessing import reductions

    # the slot we rewrite is torch's `storage_device` (an independent reading of torch's signature)
    params = list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
    assert params[weights._CUDA_DEVICE_ARG] == "storage_device"

    def rebuild_cuda_tensor(*args):  # the name the reducer looks for
        raise AssertionError("never rebuilt here")

    args = tuple(f"arg{i}" for i in range(len(params)))
    args = (*args[: weights._CUDA_DEVICE_ARG], 3, *args[weights._CUDA_DEVICE_ARG + 1 :])
    monkeypatch.setattr(reductions, "reduce_tensor", lambda t: (rebuild_cuda_tensor, args))
    seen = []

    class Props:
        def __init__(self, index):
            seen.append(index)
            self.uuid = f"GPU-uuid-of-{index}"

    monkeypatch.setattr(torch.cuda, "get_device_properties", Props)
    rebuild, out = weights._reduce_tensor_with_uuid(torch.zeros(1))
    assert rebuild is rebuild_cuda_tensor and seen == [3]
    assert out[weights._CUDA_DEVICE_ARG] == "GPU-uuid-of-3"
    assert out[: weights._CUDA_DEVICE_ARG] == args[: weights._CUDA_DEVICE_ARG]
    assert out[weights._CUDA_DEVICE_ARG + 1 :] == args[weights._CUDA_DEVICE_ARG + 1 :]


def test_an_nccl_group_whose_peers_disagree_on_cumem_is_refused_before_it_forms(monkeypatch):
    """Issue 32.1: SGLang 0.5.16 runs its server's NCCL with cuMem off (NCCL_CUMEM_ENABLE=0 unless set) while a
    trainer at NCCL's default runs it on; NCCL opens a peer's buffers the way its own setting says, and the first
    broadcast failed with "Cuda failure 'invalid argument'" (then the trainer waited forever). The job gives every
    process one value (gpu_env.nccl_peer_env); a mismatch that still gets through is refused by name, before any
    rendezvous, instead of failing inside NCCL."""
    far = dict(tp_size=1, node_ip="10.0.0.9", loopback=False)
    engines = [
        weights.EngineAddress("http://a:1", None, nccl_cumem="0", **far),
        weights.EngineAddress("http://b:1", None, nccl_cumem="1", **far),
        weights.EngineAddress("http://c:1", None, **far),  # unknown: not judged
    ]
    with pytest.raises(ValueError, match=r"NCCL_CUMEM_ENABLE=<unset: on>.*engines \[0\] with \['0'\]"):
        weights.check_cumem_agrees(engines, None)
    with pytest.raises(ValueError, match=r"NCCL_CUMEM_ENABLE=0 .*engines \[1\] with \['1'\]"):
        weights.check_cumem_agrees(engines, "0")
    weights.check_cumem_agrees(engines[1:], "1")  # agreeing peers pass

    # open_trainer_group checks before it touches Ray or a socket; gloo (CPU tests) has no cuMem and is not checked
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    with pytest.raises(ValueError, match="NCCL_CUMEM_ENABLE"):
        weights.open_trainer_group(engines[:1], backend="nccl", max_bucket_bytes=1, request_timeout_s=1)


# ---------------------------------------------------------------------------------------------------------------------
# the colocated IPC path (issue 33.1): flat buckets, one handle per bucket, the fence, the version on the last request


def test_a_flat_bucket_payload_passes_sglangs_unpickler_and_rebuilds_as_0516_does():
    g = torch.Generator().manual_seed(2)
    bucket = [
        ("a.weight", torch.randn(3, 4, generator=g).to(torch.bfloat16)),
        ("b.bias", torch.arange(5, dtype=torch.int64)),
        ("c.weight", torch.randn(4, 2, generator=g).t()),
    ]
    entries, size = flat_layout(bucket)
    flat = torch.zeros(size, dtype=torch.uint8)
    pack_bucket(bucket, flat)
    data = base64.b64decode(serialize_flat_bucket(flat, entries), validate=True)
    strings = {str(arg) for op, arg, _ in pickletools.genops(data) if op.name == "SHORT_BINUNICODE"}
    referenced = {m for m in strings if m == "types" or m.startswith(("torch", "multiprocessing"))}
    assert "types" in referenced  # the entries: types.SimpleNamespace, which 0.5.16's allowlist admits
    assert all(any((m + ".").startswith(p) for p in ALLOWED_MODULE_PREFIXES) for m in referenced), referenced
    payload = _unpickle_allowlisted(data)  # refuses any module outside the allowlist
    assert isinstance(payload["flattened_tensor"], torch.Tensor)  # the one handle of the bucket
    assert not any(isinstance(v, torch.Tensor) for m in payload["metadata"] for v in vars(m).values())
    rebuilt = rebuild_flattened_bucket(payload)  # 0.5.16's reading: attributes, slices, view(dtype).reshape(shape)
    assert [n for n, _ in rebuilt] == [n for n, _ in bucket]
    for (_, got), (_, want) in zip(rebuilt, bucket, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


class StandInServer:
    """An in-process `SGLangClient` for the colocated sender: rebuilds each flat bucket as 0.5.16 does (the payload's
    tensor aliases the sender's buffer, as a CUDA IPC mapping does), keeps the loaded tensors, answers
    `/weights_checker` with their hashes; `hold` (a tensor name) answers the call of its bucket only once `release`
    is set, and checks its bytes at answer time, when 0.5.16 would have copied them. Buckets in different buffers are
    in flight together, so their calls may arrive in either order: the hold names a bucket, not an arrival."""

    base_url = "http://stand-in"

    def __init__(self, expected: dict[str, torch.Tensor], hold: str | None = None, ignore: bool = False):
        self.expected = expected
        self.hold = hold
        self.ignore = ignore  # accept and load nothing (a server that skips what it is sent)
        self.release = threading.Event()
        self.calls: list[dict] = []
        self.loaded: dict[str, torch.Tensor] = {}
        self.checks = 0
        self.answered = 0
        self.expect_calls = 0  # when this many calls arrived, `all_arrived` is set
        self.all_arrived = threading.Event()
        self.lock = threading.Lock()

    def update_weights_from_tensor(self, payloads, *, load_format, flush_cache, weight_version):
        assert load_format == "flattened_bucket" and len(payloads) == 1
        rebuilt = rebuild_flattened_bucket(_unpickle_allowlisted(base64.b64decode(payloads[0], validate=True)))
        with self.lock:
            index = len(self.calls)
            self.calls.append({"names": [n for n, _ in rebuilt], "flush": flush_cache, "version": weight_version})
            if len(self.calls) == self.expect_calls:
                self.all_arrived.set()
            if weight_version is not None and self.answered != index:  # the label would precede loads
                raise SGLangError(f"call {index} labels {weight_version!r} while {index - self.answered} still load")
        if self.hold in self.calls[index]["names"]:
            assert self.release.wait(30), f"call {index} was held and never released: the sender never fenced it"
        wrong = [n for n, t in rebuilt if not torch.equal(t, self.expected[n])]
        if wrong:
            raise SGLangError(f"call {index}: the buffer changed before the answer: {wrong}")
        with self.lock:
            if not self.ignore:
                self.loaded.update({n: t.clone() for n, t in rebuilt})
            self.answered += 1

    def check_weights(self, action: str = "checksum") -> dict:
        with self.lock:
            self.checks += 1
            sums = {n: str(float(t.double().sum())) for n, t in self.loaded.items()}
        return {"ranks": [{"checksums": sums, "parallelism_info": {"tp_rank": 0}}]}


def _weights(seed: int, n: int = 6) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"layer{i}.weight", torch.randn(64, generator=g)) for i in range(n)]  # 256 bytes each


def test_the_colocated_sender_sends_one_flat_bucket_per_request_and_labels_the_version_on_the_last():
    """One request per bucket; the last carries the label and the flush, and is sent only once every earlier request
    answered (the stand-in holds bucket 1's answer until the sender fences: without that wait the label would arrive
    while bucket 1 still loads)."""
    sent = _weights(0)
    server = StandInServer(dict(sent), hold="layer2.weight")  # bucket 1
    sender = ColocatedWeightSender([EngineEndpoint(server)], max_bucket_bytes=512, device="cpu")
    fence = sender._fence

    def fence_then_release(slot: int) -> None:
        if slot == 1 and sender._in_flight[1]:
            server.release.set()  # the sender is about to wait for bucket 1's answer
        fence(slot)

    def drain_then_release():
        server.all_arrived.wait()  # the last request too: it must not find bucket 1 still loading
        server.release.set()
        return drain()

    server.expect_calls = 3
    drain = sender._drain
    sender._fence, sender._drain = fence_then_release, drain_then_release
    report = sender.send(iter(sent), weight_version="v1")
    buckets = [[n for n, _ in sent[i : i + 2]] for i in (0, 2, 4)]
    names = [c["names"] for c in server.calls]  # buckets 0 and 1 are in flight together: either may arrive first
    assert sorted(names[:2]) == buckets[:2] and names[2] == buckets[2]
    assert [(c["flush"], c["version"]) for c in server.calls] == [(False, None), (False, None), (True, "v1")]
    assert (report.buckets, report.tensors, report.bytes, report.weight_version) == (3, 6, 6 * 256, "v1")
    assert all(torch.equal(server.loaded[n], t) for n, t in sent)
    sender.close()


def test_the_colocated_senders_seconds_are_split_by_phase_where_they_were_spent(monkeypatch):
    """Issue 33.1 ("with where the rest goes"): `SyncReport.phases`. On a clock that only the test moves, the
    trainer's export (the tensors' generator) takes 1 s a tensor and the servers' answers 100 s (the final drain);
    packing and the checks take none: each phase holds exactly its own seconds."""
    from miles_vl.rollout import weight_sync

    now = [0.0]
    monkeypatch.setattr(weight_sync, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: now[0])}))
    sent = _weights(3)

    def exported():
        for item in sent:
            now[0] += 1.0
            yield item

    server = StandInServer(dict(sent))
    sender = ColocatedWeightSender([EngineEndpoint(server)], max_bucket_bytes=512, device="cpu")
    drain = sender._drain

    def slow_drain():
        now[0] += 100.0
        return drain()

    monkeypatch.setattr(sender, "_drain", slow_drain)
    report = sender.send(exported(), weight_version="v1")
    assert report.phases == {"check": 0.0, "export": 6.0, "wait": 100.0, "pack": 0.0}
    sender.close()


def test_a_buffer_is_packed_again_only_after_the_server_answered_the_request_that_reads_it(monkeypatch):
    """Four buckets, two buffers: bucket 2 goes into bucket 0's buffer. The server answers bucket 0 late: it is
    released when the sender waits for that buffer (or, were there no fence, when the sender drains at the end, by
    which time bucket 2 would have overwritten what bucket 0's request still reads)."""
    sent = _weights(1, n=8)
    server = StandInServer(dict(sent), hold="layer0.weight")  # bucket 0
    sender = ColocatedWeightSender([EngineEndpoint(server)], max_bucket_bytes=512, device="cpu", buffers=2)
    fence, drain = sender._fence, sender._drain

    def fence_then_release(slot: int) -> None:
        if slot == 0 and sender._in_flight[0]:
            server.release.set()  # the sender is about to wait for bucket 0's answer
        fence(slot)

    def drain_then_release():
        server.release.set()
        return drain()

    monkeypatch.setattr(sender, "_fence", fence_then_release)
    monkeypatch.setattr(sender, "_drain", drain_then_release)
    sender.send(iter(sent), weight_version="v1")
    assert len(server.calls) == 4 and all(torch.equal(server.loaded[n], t) for n, t in sent)


def test_the_value_check_runs_on_the_first_sync_and_every_nth_and_finds_weights_that_did_not_land():
    server = StandInServer({})
    server.loaded = dict(_weights(10))  # what the server loaded at start (its checkpoint)
    sender = ColocatedWeightSender([EngineEndpoint(server)], max_bucket_bytes=512, device="cpu", verify_every=3)
    checks = []
    for k in range(1, 7):
        sent = _weights(10 + k)
        server.expected = dict(sent)
        report = sender.send(iter(sent), weight_version=f"v{k}")
        checks.append(server.checks)
        assert bool(report.verified) == (k in (3, 6))  # sync 1 has nothing earlier to compare with
    assert checks == [2, 2, 4, 4, 4, 6]  # two /weights_checker calls on syncs 1, 3 and 6 only
    server.ignore = True  # from now on the server accepts the buckets and loads nothing
    for k in (7, 8):
        server.expected = dict(sent := _weights(10 + k))
        sender.send(iter(sent), weight_version=f"v{k}")  # unchecked syncs: not seen
    server.expected = dict(sent := _weights(19))
    with pytest.raises(WeightSyncError, match="did not land"):
        sender.send(iter(sent), weight_version="v9")


def test_the_colocated_sender_refuses_a_name_the_server_would_skip_before_sending_its_bucket():
    sent = _weights(2)
    server = StandInServer(dict(sent))
    known = frozenset(n for n, _ in sent[:3])
    sender = ColocatedWeightSender([EngineEndpoint(server)], known_names=known, max_bucket_bytes=512, device="cpu")
    with pytest.raises(WeightSyncError, match="not named as in the checkpoint"):
        sender.send(iter(sent), weight_version="v1")
    assert [c["names"] for c in server.calls] == [["layer0.weight", "layer1.weight"]]  # bucket 1 holds layer3


def test_a_colocated_engine_on_another_node_is_refused_with_the_switch_that_fixes_it(monkeypatch):
    import ray

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.1")
    monkeypatch.setattr(torch.multiprocessing, "set_sharing_strategy", lambda s: None)  # keep this process's strategy
    near = weights.EngineAddress("http://127.0.0.1:1", "k", 1, "10.0.0.1", True)
    far = weights.EngineAddress("http://10.0.0.2:1", "k", 1, "10.0.0.2", False)
    with pytest.raises(ValueError, match=r"engines \[1\] run on another node.*colocated_sync=tensor"):
        weights.open_colocated_sender(
            [near, far], model_path=None, verify_every=1, max_bucket_bytes=1024, request_timeout_s=1.0
        )
    sender = weights.open_colocated_sender(
        [near], model_path=None, verify_every=1, max_bucket_bytes=1024, request_timeout_s=1.0
    )
    sender.close()
