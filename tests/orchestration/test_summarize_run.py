"""Contract of scripts/gpu/summarize_run.py's MFU (issue 32.7): the train MFU is per train GPU, flops / train_s /
(train.num_gpus x peak), and the step MFU is over every GPU of the job (the engines' own GPUs count when
disaggregated, not when colocated). Before the fix a CP=2 run on two GPUs reported 13.8 % for what was 6.9 % per GPU.
The FLOPs model itself is checked against a real run in test_one_gpu_job.py; here the parameter count is fixed so the
expected figures can be written out."""

from __future__ import annotations

import json
import statistics

import pytest
import yaml

from tests.scripts import load_script

summarize_run = load_script("scripts/gpu/summarize_run.py")

PEAK = 1000.0  # TFLOP/s, a round number for the arithmetic below


def read_rows(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def write_rows(run, rows: list[dict]) -> None:
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_run(run, *, train_gpus, placement, engines, gpus_per_engine):
    run.mkdir()
    cfg = {
        "train": {"num_gpus": train_gpus, "ppo_epochs": 1},
        "rollout": {"num_engines": engines, "gpus_per_engine": gpus_per_engine, "n_samples_per_prompt": 2},
        "ray": {"placement": placement},
        "algo": {"kl_coef": 0.0},
    }
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = [
        {"step": s, "reward/mean": 0.5, "rollout/prompts": 4, "train/tokens": 1000, "time/train_s": 2.0,
         "time/step_s": 5.0, "perf/train_tokens_per_s": 500.0 * s, "perf/train_peak_mem_gib": 10.0 + s,
         "rollout/sample_len_max": 60000.0 + s, "train/micro_batches": 2.0 + s}
        for s in (1, 2, 3)
    ]  # fmt: skip
    write_rows(run, rows)
    return run


@pytest.fixture
def fixed_params(monkeypatch):
    # 1e9 text matmul parameters, no vision, no attention terms: per pass 1e9 * 1000 tokens; 2 forwards + 6 per epoch
    # -> 8e12 FLOPs a step
    arch = dict(layers=0, attn_dim=0, vis_depth=0, vis_hidden=0)
    monkeypatch.setattr(summarize_run, "matmul_params", lambda ckpt: (10**9, 0, arch))
    return 8e12


@pytest.mark.parametrize(
    "train_gpus, placement, engines, gpus_per_engine, job_gpus",
    [(1, "colocate", 1, 1, 1), (2, "colocate", 2, 1, 2), (2, "disaggregate", 1, 2, 4), (4, "disaggregate", 2, 1, 6)],
)
def test_mfu_is_per_gpu(tmp_path, fixed_params, train_gpus, placement, engines, gpus_per_engine, job_gpus):
    run = write_run(tmp_path / "r", train_gpus=train_gpus, placement=placement, engines=engines,
                    gpus_per_engine=gpus_per_engine)  # fmt: skip
    out = summarize_run.summarize(run, "ckpt", PEAK)
    assert out["train_flops_per_step"] == fixed_params
    assert (out["train_gpus"], out["job_gpus"]) == (train_gpus, job_gpus)
    assert out["train_mfu"] == round(fixed_params / 2.0 / (train_gpus * PEAK * 1e12), 4)
    assert out["train_tflops_per_gpu"] == round(fixed_params / 2.0 / train_gpus / 1e12, 1)
    assert out["step_mfu"] == round(fixed_params / 5.0 / (job_gpus * PEAK * 1e12), 4)


@pytest.mark.parametrize("train_gpus", [1, 4])
def test_long_context_figures(tmp_path, train_gpus):
    """Issue 32.3: tokens/s per train GPU (median over the steps after the first), the peak memory and the longest
    sample (maxima over the steps)."""
    run = write_run(tmp_path / "r", train_gpus=train_gpus, placement="colocate", engines=1, gpus_per_engine=1)
    out = summarize_run.summarize(run, None, PEAK)
    assert out["train_tokens_per_s"] == 1250.0  # steps 2 and 3: 1000, 1500
    assert out["train_tokens_per_s_per_gpu"] == 1250.0 / train_gpus
    assert out["train_peak_mem_gib"] == 13.0 and out["sample_len_max"] == 60003.0
    assert out["train_micro_batches"] == 4.5  # the median of steps 2 and 3: 4, 5


def test_a_run_from_before_the_micro_batch_count_summarizes_with_it_null(tmp_path):
    """Runs committed before `train/micro_batches` was logged (docs/gpu-runs up to 2026-11-28) still summarize."""
    run = write_run(tmp_path / "r", train_gpus=1, placement="colocate", engines=1, gpus_per_engine=1)
    write_rows(run, [{k: v for k, v in r.items() if k != "train/micro_batches"} for r in read_rows(run)])
    out = summarize_run.summarize(run, None, PEAK)
    assert out["train_micro_batches"] is None and out["train_tokens_per_s"] == 1250.0


def test_gpu_memory_is_the_largest_sample_per_gpu(tmp_path):
    """Memory per GPU (issue 32.4): nvidia-smi's samples of each GPU reduced to their maximum, in GiB, by index."""
    csv = tmp_path / "gpu_memory.csv"
    csv.write_text(
        "2026/11/26 14:00:00.000, 2, 1024, 81559\n"
        "2026/11/26 14:00:00.000, 3, 2048, 81559\n"
        "2026/11/26 14:00:02.000, 2, 61440, 81559\n"
        "2026/11/26 14:00:02.000, 3, 512, 81559\n"
        "\n"
    )
    got = summarize_run.gpu_memory(csv)
    assert got == {"gpu_mem_used_gib_max": {"2": 60.0, "3": 2.0}, "gpu_mem_total_gib": 79.65}
    assert list(got["gpu_mem_used_gib_max"]) == ["2", "3"]


def test_a_ballast_is_left_out_of_the_runs_memory(tmp_path):
    """loop_run.sh's GPU_MEMORY_GIB (an H200 held to an H100's 79.65 GiB by scripts/gpu/cap_memory.py): the ballast's
    MiB per GPU are not the run's, and the card the run had is the total less the ballast."""
    samples, ballast = tmp_path / "gpu_memory.csv", tmp_path / "gpu_ballast.csv"
    samples.write_text(
        "2026/11/28 09:00:00.000, 0, 61440, 143771\n"  # 60 GiB of ballast alone, then 60 + 70
        "2026/11/28 09:00:00.000, 1, 61952, 143771\n"
        "2026/11/28 09:00:02.000, 0, 133120, 143771\n"
        "2026/11/28 09:00:02.000, 1, 62976, 143771\n"
    )
    ballast.write_text("0, 61440\n1, 61952\n")
    out = summarize_run.gpu_memory(samples) | {"gpu_used_gib_rollout": 101.5}
    got = summarize_run.leave_out_ballast(out, ballast)
    assert got["gpu_mem_used_gib_max"] == {"0": 70.0, "1": 1.0}
    assert got["gpu_ballast_gib"] == {"0": 60.0, "1": 60.5}
    assert got["gpu_mem_total_gib"] == round(143771 / 1024 - 61952 / 1024, 2)  # the larger ballast: the smaller card
    assert got["gpu_used_gib_rollout"] == 41.5  # train rank 0's GPU: the first line's
    ballast.write_text("0, 61440\n5, 1\n")
    with pytest.raises(ValueError, match=r"ballast on GPU \['5'\] but no memory samples"):
        summarize_run.leave_out_ballast(out, ballast)
    ballast.write_text("0 61440\n")
    with pytest.raises(ValueError, match=r"gpu_ballast.csv:1: expected 'index, ballast MiB'"):
        summarize_run.leave_out_ballast(out, ballast)


def test_gpu_memory_names_a_bad_line(tmp_path):
    csv = tmp_path / "gpu_memory.csv"
    csv.write_text("2026/11/26 14:00:00.000, 0, 1024, 81559\nNo devices were found\n")
    with pytest.raises(ValueError, match=r"gpu_memory.csv:2: expected 'timestamp, index, memory.used"):
        summarize_run.gpu_memory(csv)


def test_sync_phases_are_medians_over_the_steps_after_the_first(tmp_path):
    """Issue 33.1: where a group sync's seconds go, `sync/<phase>_s` per step -> `sync_phases_s`, the median over the
    steps after the first (step 1's export compiles and allocates); a run without them (tensor sync) has none."""
    run = write_run(tmp_path / "r", train_gpus=1, placement="colocate", engines=1, gpus_per_engine=1)
    assert "sync_phases_s" not in summarize_run.summarize(run, None, PEAK)
    rows = read_rows(run)
    for r, (export, wait) in zip(rows, [(9.0, 5.0), (0.2, 0.1), (0.4, 0.3)], strict=True):
        r |= {"sync/export_s": export, "sync/wait_s": wait, "sync/bytes": 4.0e9}
    write_rows(run, rows)
    assert summarize_run.summarize(run, None, PEAK)["sync_phases_s"] == {"export": 0.3, "wait": 0.2}


@pytest.mark.parametrize("recorded", [True, False])
def test_vision_attention_is_counted_per_image(tmp_path, monkeypatch, recorded):
    """The vision tower attends within each image (or video frame group), not across a sample's images: a sample of
    62 images of 4096 patches costs 62 x 4096^2 of attention, not (62 x 4096)^2 (the 64K run of 2026-11-26 reported
    a train MFU of 96.6 % with the latter). Runs without `rollout/vision_blocks_per_sample` take --vision-blocks."""
    arch = dict(layers=0, attn_dim=0, vis_depth=2, vis_hidden=10)  # only the vision attention term is non-zero
    monkeypatch.setattr(summarize_run, "matmul_params", lambda ckpt: (0, 0, arch))
    run = write_run(tmp_path / "r", train_gpus=1, placement="colocate", engines=1, gpus_per_engine=1)
    rows = read_rows(run)
    for row in rows:
        row["rollout/visual_tokens_per_sample"] = 62 * 1024.0  # 62 images of 4096 patches
        if recorded:
            row["rollout/vision_blocks_per_sample"] = 62.0
    write_rows(run, rows)
    # 4 prompts x 2 samples, 8 passes' worth (2 forward + 6 forward-backward), 2 L d P^2 per block, 62 blocks
    per_image = 8 * 2 * 2 * 10 * 4096**2 * 62 * 8
    out = summarize_run.summarize(run, "ckpt", PEAK, vision_blocks=1.0 if recorded else 62.0)
    assert out["train_flops_per_step"] == pytest.approx(per_image)
    whole = summarize_run.summarize(run, "ckpt", PEAK)  # one block a sample: what a single-image job records
    assert whole["train_flops_per_step"] == pytest.approx(per_image * (62 if not recorded else 1))


@pytest.mark.parametrize("placement, engines, job_gpus", [("colocate", 1, 1), ("disaggregate", 1, 2)])
def test_end_to_end_throughput_and_idle_fractions(tmp_path, placement, engines, job_gpus):
    """Issue 34 compares a synchronous and an asynchronous run on the job's tokens/s per GPU and each side's idle
    share; written out: steps 2 and 3 train 1000 tokens in steps of 5.0 and 4.0 s, train 2.0 s, generate 1.0 and
    3.0 s (step 1, which compiles and allocates, is left out)."""
    run = write_run(tmp_path / "r", train_gpus=1, placement=placement, engines=engines, gpus_per_engine=1)
    rows = read_rows(run)
    for row, step_s, rollout_s in zip(rows, (99.0, 5.0, 4.0), (50.0, 1.0, 3.0), strict=True):
        row.update({"time/step_s": step_s, "time/rollout_s": rollout_s})
    write_rows(run, rows)
    out = summarize_run.summarize(run, None, PEAK)
    assert out["step_tokens_per_s_per_gpu"] == round(statistics.median([1000 / 5.0, 1000 / 4.0]) / job_gpus, 1)
    if placement == "colocate":
        assert "idle_fraction" not in out
    else:
        trainer = statistics.median([1 - 2.0 / 5.0, 1 - 2.0 / 4.0])
        engine = statistics.median([1 - 1.0 / 5.0, 1 - 3.0 / 4.0])
        assert out["idle_fraction"] == {"trainer": round(trainer, 3), "engine": round(engine, 3)}


def test_a_profiled_step_is_left_out_of_the_medians(tmp_path):
    """train.profile_steps=[3]: step 3's train phase ran under the profiler and its step carries the profile's reading
    (67 s in the 2B run of 2026-11-27); the medians are over steps 2 and 4 (written out), and the summary names it."""
    run = write_run(tmp_path / "r", train_gpus=1, placement="colocate", engines=1, gpus_per_engine=1)
    rows = read_rows(run)
    rows.append(dict(rows[-1], step=4))
    for row, train_s, step_s in zip(rows, (9.0, 2.0, 12.0, 3.0), (20.0, 5.0, 90.0, 6.0), strict=True):
        row.update({"time/train_s": train_s, "time/step_s": step_s})
    rows[2]["time/profile_s"] = 67.0
    write_rows(run, rows)
    out = summarize_run.summarize(run, None, PEAK)
    assert (out["train_s"], out["step_s"]) == (statistics.median([2.0, 3.0]), statistics.median([5.0, 6.0]))
    assert out["profiled_steps"] == [3]
