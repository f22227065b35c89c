"""Contract of `merge_rank_metrics`: the step's metrics are rank 0's, except the train peak memory, which is the
fullest rank's (under CP / TP / vision_dp_when_cp the ranks hold different shards and images; a layout fits only when
its fullest GPU does), with rank 0's kept beside it, and the memory a rank keeps after its train phase, also the
fullest rank's; one rank, or a CPU run without the keys, is left as it is."""

from miles_vl.orchestration.trainer import merge_rank_metrics


def test_peak_memory_is_the_fullest_ranks():
    ranks = [
        {"train/loss": 0.5, "perf/train_peak_mem_gib": 30.0},
        {"train/loss": 0.7, "perf/train_peak_mem_gib": 41.5},
        {"train/loss": 0.6, "perf/train_peak_mem_gib": 35.0},
    ]
    merged = merge_rank_metrics(ranks)
    assert merged == {"train/loss": 0.5, "perf/train_peak_mem_gib": 41.5, "perf/train_peak_mem_gib_rank0": 30.0}
    assert ranks[0]["perf/train_peak_mem_gib"] == 30.0  # the ranks' own dicts are not changed


def test_one_rank_or_no_cuda_is_rank_zeros():
    assert merge_rank_metrics([{"train/loss": 0.5, "perf/train_peak_mem_gib": 3.0}]) == {
        "train/loss": 0.5,
        "perf/train_peak_mem_gib": 3.0,
    }
    assert merge_rank_metrics([{"train/loss": 0.5}, {"train/loss": 0.9}]) == {"train/loss": 0.5}


def test_resident_memory_is_the_fullest_ranks_too():
    ranks = [{"perf/train_resident_gib": 50.8}, {"perf/train_resident_gib": 52.1}]
    assert merge_rank_metrics(ranks) == {"perf/train_resident_gib": 52.1}


def test_the_train_actor_reports_what_stays_allocated_after_returning_its_cache(monkeypatch):
    """`perf/train_resident_gib`: allocated memory read after the cache went back to the device (what the colocated
    engine shares the GPU with through the rollout), beside the phase's peak."""
    import torch

    from miles_vl.orchestration import trainer

    order = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 60 * 2**30)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: order.append("empty"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: order.append("read") or 52.5 * 2**30)
    monkeypatch.setattr(trainer, "train_step", lambda backend, samples: {"train/loss": 0.5})
    worker = trainer.TrainWorker.__ray_actor_class__.__new__(trainer.TrainWorker.__ray_actor_class__)
    worker.backend, worker.profile_next = None, False
    metrics = worker.train([])
    assert metrics == {"train/loss": 0.5, "perf/train_peak_mem_gib": 60.0, "perf/train_resident_gib": 52.5}
    assert order == ["empty", "read"]
