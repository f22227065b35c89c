"""Contract of `merge_rank_metrics`: the step's metrics are rank 0's, except the train peak memory, which is the
fullest rank's (under CP / TP / vision_dp_when_cp the ranks hold different shards and images; a layout fits only when
its fullest GPU does), with rank 0's kept beside it; one rank, or a CPU run without the key, is left as it is."""

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
