"""The train actor hands the memory a backend's build freed back to the device (`release_build_memory`): on 2026-11-28
the 8B trainer held 67.5 GiB of an 80 GB card after its build where its tensors need ~51 (DDP's param buffer copies
every weight and frees the loaded ones; PyTorch's caching allocator kept them), and the colocated SGLang engine that
starts next could not load its weights (docs/gpu-runs/2026-11-28-8b-1gpu-2xh200).

CUDA's allocator is stood in here (no GPU on CPU CI); on a GPU the train actor's log line "trainer built: ...
returned to the device" of every loop run says what it returned (the next run of scripts/gpu/plans/owed.sh p4 is
its check)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from miles_vl.orchestration import trainer

GIB = 2**30


def test_the_cached_blocks_go_back_to_the_device_and_the_log_says_how_much(monkeypatch, caplog):
    reserved = [67.5 * GIB]
    emptied = []

    def empty_cache():
        emptied.append(reserved[0])
        reserved[0] = 51.25 * GIB  # what the live tensors' segments hold

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: reserved[0])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 51.0 * GIB)
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    with caplog.at_level(logging.INFO, logger=trainer.__name__):
        assert trainer.release_build_memory() == (51.0, 16.25)
    assert emptied == [67.5 * GIB]  # once, after the collection
    assert "trainer built: 51.0 GiB allocated; 16.2 GiB the build left cached returned to the device" in caplog.text


def test_without_cuda_nothing_is_asked_of_the_allocator(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: (_ for _ in ()).throw(AssertionError("called")))
    assert trainer.release_build_memory() is None


def test_the_train_actor_releases_right_after_the_build(monkeypatch):
    """`TrainWorker.setup` calls it once the backend is built (DDP and the optimizer made), before anything else."""
    order = []
    worker = trainer.TrainWorker.__ray_actor_class__.__new__(trainer.TrainWorker.__ray_actor_class__)
    worker.build = lambda cfg, tokens: order.append("build") or "backend"
    worker.cfg, worker.tokens = None, None
    monkeypatch.setattr(trainer, "release_build_memory", lambda: order.append("release"))
    worker.setup(None)
    assert order == ["build", "release"] and worker.backend == "backend"


class _Group:
    def __init__(self, order, fail=False):
        self.order, self.fail = order, fail

    def send(self, weights, *, weight_version):
        for _ in weights:  # the export makes (and frees) merged tensors on the GPU meanwhile
            pass
        self.order.append("send")
        if self.fail:
            raise RuntimeError("engine gone")
        return SimpleNamespace(tensors=1, bytes=2, buckets=1, phases={})


class _Backend:
    def export_weights(self, on_device=False):
        yield "w", torch.zeros(1)


def test_the_sync_hands_the_exports_freed_memory_back_before_the_engine_resumes(monkeypatch):
    """The colocated engine resumes its KV cache right after the sync: what the export freed must not stay cached in
    the trainer, also when the send fails (the loop repairs the engine, which resumes too), and on the ranks that only
    take part in the export. On 2026-11-28 the 8B job on one GPU lost its engine at that resume (the card full; the
    room came from a smaller KV share, 0.7 of the free memory): it runs with 2.6 GiB to spare there, which this keeps
    the export's leftovers out of."""
    worker = trainer.TrainWorker.__ray_actor_class__.__new__(trainer.TrainWorker.__ray_actor_class__)
    worker.backend = _Backend()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for fail in (False, True):
        order = []
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda order=order: order.append("empty"))
        worker.weight_group = _Group(order, fail)
        if fail:
            with pytest.raises(RuntimeError, match="engine gone"):
                worker.send_weights("v1")
        else:
            worker.send_weights("v1")
        assert order == ["send", "empty"]
    order = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: order.append("empty"))
    worker.backend.export_weights = lambda on_device: (order.append("export") or (n, t) for n, t in [("w", None)])
    worker.drain_weights()  # a rank > 0 of a collective export
    assert order == ["export", "empty"]
