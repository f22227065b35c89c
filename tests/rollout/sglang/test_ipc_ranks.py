"""Contract: the colocated IPC sync with several trainer ranks (miles_vl/rollout/sglang/weights.py `ipc_sources`,
`ColocatedWeightSender` with an exchange, `DistExchange`). Each TP rank of each engine maps a buffer of the trainer
rank on its own GPU (the first 8B run handed rank 0's GPU-0 buffer to every TP rank of two TP-2 engines and both
engines died: docs/gpu-runs/2026-11-27-loop-8b-tp2cp2-ipc-fail-4xh200); the ranks go bucket by bucket in lock step,
so that a refusal on rank 0 or a failure on another rank ends the sync on every rank with one error, never a hang.

The ranks here are threads with a barrier exchange (a stand-in for torch.distributed, as `DistExchange` uses it);
`test_dist_exchange_over_gloo_*` checks `DistExchange` itself in real processes over gloo, the behaviours the
stand-in mimics (rank 0's object on every rank; every rank's object in rank order on rank 0, None elsewhere)."""

from __future__ import annotations

import base64
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from miles_vl.rollout.sglang.client import SGLangError, SGLangUnavailableError
from miles_vl.rollout.sglang.verify import WeightSyncError
from miles_vl.rollout.sglang.weights import (
    ColocatedWeightSender,
    DistExchange,
    EngineAddress,
    EngineEndpoint,
    ipc_sources,
)
from tests.rollout.sglang.fake_server import _unpickle_allowlisted, rebuild_flattened_bucket

NODE = "10.0.0.1"


def _engine(tp: int, gpus: tuple[str, ...] | None, node: str = NODE) -> EngineAddress:
    return EngineAddress(f"http://{node}:1", "k", tp, node, False, None, gpus)


# ---------------------------------------------------------------------------------------------------------------------
# which rank's buffer each TP rank maps


def test_each_tp_rank_of_each_engine_gets_the_trainer_rank_on_its_own_gpu():
    """Two engines of TP 2 on a 4-GPU trainer whose ranks are not in GPU order: the table follows the GPUs."""
    trainer = [(NODE, "2"), (NODE, "0"), (NODE, "3"), (NODE, "1")]  # rank k on GPU trainer[k]
    engines = [_engine(2, ("0", "1")), _engine(2, ("2", "3"))]
    assert ipc_sources(engines, trainer) == [[1, 3], [0, 2]]


def test_a_one_gpu_job_maps_rank_0_and_a_cpu_job_maps_rank_0_for_every_tp_rank():
    assert ipc_sources([_engine(1, ("0",))], [(NODE, "0")]) == [[0]]
    # no GPU on any rank: CPU buffers are shared memory, which every process of the node maps
    assert ipc_sources([_engine(2, None), _engine(1, None)], [None, None], cuda=False) == [[0, 0], [0]]


def test_a_cuda_rank_whose_gpu_is_unknown_is_refused_not_mapped_to_rank_0():
    """Unknown GPUs on a CUDA trainer must not fall back to rank 0's buffer for every TP rank (the failure this
    table exists to prevent)."""
    with pytest.raises(ValueError, match=r"trainer ranks \[0, 1\] run on CUDA but hold no single GPU"):
        ipc_sources([_engine(2, ("0", "1"))], [None, None], cuda=True)
    with pytest.raises(ValueError, match=r"trainer ranks \[1\]"):
        ipc_sources([_engine(2, ("0", "1"))], [(NODE, "0"), None])


def test_a_tp_rank_on_a_gpu_no_trainer_rank_holds_is_refused_naming_it():
    engines = [_engine(2, ("0", "1")), _engine(2, ("2", "3"))]
    with pytest.raises(ValueError, match=r"engine 1 TP rank 1 \(GPU 3 of 10\.0\.0\.1\).*colocated_sync=tensor"):
        ipc_sources(engines, [(NODE, "0"), (NODE, "1"), (NODE, "2")])
    with pytest.raises(ValueError, match=r"engine 0 TP rank 0 \(GPU 0 of 10\.0\.0\.9\)"):  # same GPU id, other node
        ipc_sources([_engine(1, ("0",), node="10.0.0.9")], [(NODE, "0")])


def test_an_engine_whose_gpus_are_unknown_is_refused_when_the_trainer_has_gpus():
    with pytest.raises(ValueError, match=r"engine 0 .* reports GPUs none for its 2 TP rank\(s\)"):
        ipc_sources([_engine(2, None)], [(NODE, "0"), (NODE, "1")])


# ---------------------------------------------------------------------------------------------------------------------
# the lock step of several ranks


class ThreadExchange:
    """`RankExchange` of `world` threads: a barrier per step (a broken lock step fails the test in 20 s, not hangs)."""

    def __init__(self, world: int):
        self.world = world
        self.barrier = threading.Barrier(world, timeout=20)
        self.box: list = [None] * world

    def view(self, rank: int):
        shared = self

        class View:
            def __init__(self):
                self.rank, self.world = rank, shared.world

            def broadcast(self, obj):
                if rank == 0:
                    shared.box[0] = obj
                shared.barrier.wait()
                value = shared.box[0]
                shared.barrier.wait()
                return value

            def gather(self, obj):
                shared.box[rank] = obj
                shared.barrier.wait()
                out = list(shared.box) if rank == 0 else None
                shared.barrier.wait()
                return out

        return View()


class TPServer:
    """An in-process stand-in for one SGLang server of `tp` ranks: each request's payload r is rebuilt as 0.5.16's TP
    rank r does; it records which buffer (storage) each TP rank mapped and keeps what TP rank 0 loaded. `late` (a
    tensor name): the request of its bucket is taken only after another request was, as happens when two buckets
    are in flight together (two buffers) and the first one's thread starts last."""

    base_url = "http://stand-in"

    def __init__(self, tp: int, late: str | None = None):
        self.tp = tp
        self.late = late
        self.taken = threading.Event()  # a request other than the late one was recorded
        self.mapped: list[list[int]] = []  # per request: the data pointer each TP rank's payload maps
        self.calls: list[dict] = []
        self.loaded: dict[str, torch.Tensor] = {}
        self.lock = threading.Lock()

    def update_weights_from_tensor(self, payloads, *, load_format, flush_cache, weight_version):
        assert load_format == "flattened_bucket" and len(payloads) == self.tp
        decoded = [_unpickle_allowlisted(base64.b64decode(p, validate=True)) for p in payloads]
        rebuilt = [rebuild_flattened_bucket(d) for d in decoded]
        names = [n for n, _ in rebuilt[0]]
        if self.late in names:
            assert self.taken.wait(20), "no other request came while the late one waited"
        with self.lock:
            self.mapped.append([d["flattened_tensor"].untyped_storage().data_ptr() for d in decoded])
            self.calls.append({"names": names, "flush": flush_cache, "version": weight_version})
            if self.late not in names:
                self.taken.set()
            for name, t in rebuilt[0]:
                self.loaded[name] = t.clone()
            assert all(torch.equal(a, b) for ranks in zip(*rebuilt, strict=True) for (_, a), (_, b) in
                       zip(ranks, ranks[1:], strict=False))  # fmt: skip

    def check_weights(self, action: str = "checksum") -> dict:  # as the stand-in of test_weights.py answers
        with self.lock:
            sums = {n: str(float(t.double().sum())) for n, t in self.loaded.items()}
        return {"ranks": [{"checksums": sums, "parallelism_info": {"tp_rank": 0}}]}


def _weights(seed: int, n: int = 6) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"layer{i}.weight", torch.randn(64, generator=g)) for i in range(n)]  # 256 bytes each


def _run_ranks(senders: list, exports: list, version: str = "v1") -> list:
    """Every rank's `send` in its own thread; each rank's report or raised error, in rank order."""
    out: list = [None] * len(senders)

    def run(k: int) -> None:
        try:
            out[k] = senders[k].send(exports[k], weight_version=version)
        except BaseException as err:  # the test looks at it
            out[k] = err

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(senders))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank never returned: the lock step broke"
    return out


def _ranks(world: int, servers: list[TPServer], sources: list[list[int]], **kw) -> list[ColocatedWeightSender]:
    exchange = ThreadExchange(world)
    return [
        ColocatedWeightSender(
            [EngineEndpoint(s, s.tp) for s in servers],
            max_bucket_bytes=512,
            device="cpu",
            sources=sources,
            exchange=exchange.view(k),
            **kw,
        )
        for k in range(world)
    ]


@pytest.mark.parametrize("late", [None, "layer0.weight"], ids=["in-order", "bucket-0-arrives-after-bucket-1"])
def test_each_tp_rank_maps_the_buffer_of_its_source_rank_and_loads_every_weight(late):
    """Two engines of TP 2, four ranks: engine e's TP rank r maps rank (2e + r)'s buffer in every request (3 buckets
    of 2 tensors); the last request of each engine carries the label and the flush and comes after both earlier ones.
    Buckets 0 and 1 are in flight together (two buffers), so they may arrive in either order (a CI run saw bucket 1
    first): the second case makes bucket 0 arrive last."""
    servers = [TPServer(2, late), TPServer(2, late)]
    senders = _ranks(4, servers, [[0, 1], [2, 3]])
    sent = _weights(0)
    buckets = [[n for n, _ in sent[i : i + 2]] for i in (0, 2, 4)]
    reports = _run_ranks(senders, [iter(sent) for _ in senders])
    assert not any(isinstance(r, BaseException) for r in reports), reports
    for e, server in enumerate(servers):
        names = [c["names"] for c in server.calls]
        assert sorted(names[:2]) == buckets[:2] and names[2] == buckets[2]
        if late:
            assert names[0] == buckets[1]  # the case happened
        assert [(c["flush"], c["version"]) for c in server.calls] == [(False, None), (False, None), (True, "v1")]
        for call, mapped in zip(server.calls, server.mapped, strict=True):
            bucket = buckets.index(call["names"])
            slot = bucket % 2
            want = [senders[2 * e + r]._buffers[slot].untyped_storage().data_ptr() for r in range(2)]
            assert mapped == want, f"engine {e} bucket {bucket}"
        assert all(torch.equal(server.loaded[n], t) for n, t in sent)
    assert (reports[0].buckets, reports[0].tensors) == (3, 6)


def test_a_name_refused_on_rank_0_ends_the_sync_on_every_rank_without_a_hang():
    """Rank 0's name check refuses bucket 1: nothing of it or later is sent, every rank returns, rank 0 raises."""
    servers = [TPServer(2)]
    sent = _weights(2)
    senders = _ranks(2, servers, [[0, 1]], known_names=frozenset(n for n, _ in sent[:3]))  # layer3: bucket 1
    out = _run_ranks(senders, [iter(sent) for _ in senders])
    assert isinstance(out[0], WeightSyncError) and "not named as in the checkpoint" in str(out[0])
    assert not isinstance(out[1], BaseException)
    assert [c["names"] for c in servers[0].calls] == [["layer0.weight", "layer1.weight"]]


def test_a_server_that_cannot_answer_the_value_check_ends_the_sync_on_every_rank_without_a_hang(monkeypatch):
    """Rank 0 alone asks the servers for their hashes before the first bucket (a new sender always does): a server
    that is down there must stop every rank, not leave the others waiting for rank 0's first go."""
    servers = [TPServer(2)]
    senders = _ranks(2, servers, [[0, 1]])

    def down(action: str = "checksum"):
        raise SGLangUnavailableError("POST /weights_checker at http://stand-in: connection refused (stand-in)")

    monkeypatch.setattr(servers[0], "check_weights", down)
    out = _run_ranks(senders, [iter(_weights(4)) for _ in senders])
    assert isinstance(out[0], SGLangUnavailableError) and "connection refused" in str(out[0])
    assert not isinstance(out[1], BaseException)
    assert not servers[0].calls  # nothing was sent


def test_a_rank_that_cannot_pack_is_named_by_rank_0_and_no_rank_hangs(monkeypatch):
    servers = [TPServer(2), TPServer(2)]
    senders = _ranks(4, servers, [[0, 1], [2, 3]])

    def broken(slot: int, nbytes: int):
        raise RuntimeError("CUDA out of memory (stand-in)")

    monkeypatch.setattr(senders[2], "_buffer", broken)
    out = _run_ranks(senders, [iter(_weights(3)) for _ in senders])
    assert isinstance(out[0], SGLangError) and "trainer rank 2 could not pack bucket 0" in str(out[0])
    assert "out of memory" in str(out[0])
    assert not any(isinstance(r, BaseException) for r in out[1:])
    assert all(not s.calls for s in servers)  # bucket 0 went nowhere: engine 1's TP rank 0 had no buffer


# ---------------------------------------------------------------------------------------------------------------------
# the real exchange


def test_dist_exchange_over_gloo_broadcasts_rank_0s_object_and_gathers_every_ranks_in_order(tmp_path):
    code = textwrap.dedent(
        f"""
        import sys
        import torch.distributed as dist
        import torch.multiprocessing as mp
        from miles_vl.rollout.sglang.weights import DistExchange

        def main(rank):
            dist.init_process_group("gloo", init_method="file://{tmp_path}/pg", rank=rank, world_size=3)
            ex = DistExchange.current()
            assert (ex.rank, ex.world) == (rank, 3)
            assert ex.broadcast({{"go": rank == 0, "from": rank}}) == {{"go": True, "from": 0}}
            got = ex.gather({{(rank, 0): f"handle of rank {{rank}}"}})
            if rank == 0:
                assert got == [{{(k, 0): f"handle of rank {{k}}"}} for k in range(3)], got
            else:
                assert got is None, got
            assert ex.all_gather(("node", str(rank))) == [("node", str(k)) for k in range(3)]
            dist.destroy_process_group()

        if __name__ == "__main__":
            mp.spawn(main, nprocs=3)
            print("OK")
        """
    )
    script = tmp_path / "exchange.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-2000:]


def test_dist_exchange_of_one_rank_hands_back_what_it_was_given():
    ex = DistExchange()  # torch.distributed not initialized: this rank alone, no collective
    assert (ex.broadcast(1), ex.gather("a"), ex.all_gather("b")) == (1, ["a"], ["b"])
