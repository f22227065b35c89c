"""CPU parts of benchmarks/bench_megatron_cp.py (its GPU part runs on the GPU machine, docs/long_context.md): the
command line refuses what cannot run before any GPU work; the samples have exactly the length and images asked (the
many_images task's count per length by default); the layout table; the results over ranks (slowest step, fullest
GPU, per-GPU throughput, "oom" / "skipped" / "timeout" passed through) and the per-rank files a killed launch leaves."""

import json

import pytest
import torch

from benchmarks import bench_megatron_cp as bench
from benchmarks.bench_train_throughput import IMAGE


def test_layout_table():
    assert bench.LAYOUTS["cp4"] == (1, 4, False) and bench.LAYOUTS["cp4_vdp"] == (1, 4, True)
    assert bench.LAYOUTS["tp2cp2"] == (2, 2, False)
    assert {"cp1", "cp2", "cp2_vdp", "cp4", "cp4_vdp", "tp2cp2"} <= set(bench.LAYOUTS)


def test_parse_args_defaults_and_checks(capsys):
    args = bench.parse_args(["--gpus", "4", "--layouts", "cp4,cp4_vdp,tp2cp2", "--recompute", "full"])
    assert args.lengths == [16384, 32768, 65536] and args.images == "task" and args.recompute == "full"
    assert args.layouts == ["cp4", "cp4_vdp", "tp2cp2"]
    assert bench.parse_args(["--images", "4", "--lengths", "8192"]).images == 4
    for argv, message in (
        (["--layouts", "cp3"], "unknown ['cp3']"),
        (["--gpus", "2", "--layouts", "cp4"], "tp * cp = 4 to divide --gpus 2"),
        (["--gpus", "1", "--layouts", "cp2"], "tp * cp = 2 to divide --gpus 1"),
        (["--lengths", "32768,16384"], "ascending"),
        (["--lengths", "16k"], "comma-separated integers"),
        (["--images", "many"], "an integer or `task`"),
    ):
        with pytest.raises(SystemExit) as info:
            bench.parse_args(argv)
        assert info.value.code == 2 and message in capsys.readouterr().err, argv
    with pytest.raises(SystemExit, match="--images 8 need 8209 tokens, more than the length 8192"):
        bench.parse_args(["--images", "8", "--lengths", "8192"])


@pytest.mark.parametrize("length, images", [(16384, 15), (32768, 31), (65536, 62)])
def test_samples_have_the_length_and_the_tasks_images(length, images):
    assert bench.images_for(length, "task") == images
    sample, pixels = bench.long_sample(length, images, seed=0)
    assert sample.input_ids.numel() == length
    # every vision block whole inside the prompt (the 16K sample's 15 blocks end 994 tokens before 16K - 1024, where
    # a fixed 1024-token response would cut the last one), and the response as long as that allows, up to 1024
    last_vision = int((sample.input_ids == IMAGE).nonzero().max()) + 1  # its vision-end token
    assert last_vision < sample.prompt_len
    assert length - sample.prompt_len == min(1024, length - (last_vision + 1) - 1)
    assert int((sample.input_ids == IMAGE).sum()) == images * 1024
    assert sample.image_grid_thw.tolist() == [[1, 64, 64]] * images and pixels.shape[0] == images * 4096


def rank(step_s, peak, tokens=65536, images=62):
    return {"step_s": step_s, "peak_gib": peak, "tokens_per_step_all_gpus": tokens, "images": images}


def test_aggregate_slowest_step_fullest_gpu_and_failures():
    lengths, layouts = [32768, 65536], ["cp4", "cp4_vdp"]
    per_rank = [
        {"cp4_L32768": rank(2.0, 40.0, 32768), "cp4_L65536": "oom", "cp4_vdp_L32768": rank(1.0, 30.0, 32768)},
        {"cp4_L32768": rank(4.0, 35.0, 32768), "cp4_L65536": "oom", "cp4_vdp_L32768": rank(1.6, 31.0, 32768)},
    ]
    out = bench.aggregate(per_rank, lengths, layouts, gpus=4, missing="timeout")
    assert out["cp4_L32768"] == {
        "tokens_per_s": 8192, "tokens_per_s_per_gpu": 2048, "step_s": 4.0, "peak_gib_per_gpu": 40.0, "images": 62,
        "tp": 1, "cp": 4,
    }  # fmt: skip
    assert out["cp4_L65536"] == "oom" and out["cp4_vdp_L65536"] == "timeout"  # the launch ended before it
    assert out["L32768_cp4_vdp_over_cp4"] == {"throughput_per_gpu": 2.5, "peak_memory": 0.775}
    per_rank[0]["cp4_L65536"] = "skipped: oom at 32768"
    per_rank[1]["cp4_L65536"] = "skipped: oom at 32768"
    assert bench.aggregate(per_rank, lengths, ["cp4"], 4, "error")["cp4_L65536"] == "skipped: oom at 32768"


def test_read_partial_keeps_what_each_rank_recorded(tmp_path):
    (tmp_path / "rank0.jsonl").write_text(json.dumps({"key": "cp2_L16384", "value": rank(1.0, 20.0)}) + "\n")
    # rank 1 was killed before it recorded anything
    per_rank = bench.read_partial(str(tmp_path), 2)
    assert per_rank == [{"cp2_L16384": rank(1.0, 20.0)}, {}]
    assert bench.aggregate(per_rank, [16384], ["cp2"], 2, "timeout")["cp2_L16384"] == "timeout"


def test_parse_args_rl_paths_and_env(capsys):
    args = bench.parse_args(["--path", "rl_step", "--response", "128", "--samples", "4", "--env", "A=1", "--env=B="])
    assert (args.path, args.response, args.samples, args.env) == ("rl_step", 128, 4, {"A": "1", "B": ""})
    assert bench.parse_args([]).path == "bench" and bench.parse_args([]).env == {}
    assert bench.parse_args(["--path", "rl_loss", "--logits-only-where-loss"]).logits_only_where_loss
    for argv, message in (
        (["--path", "rl"], "invalid choice"),
        (["--env", "NOVALUE"], "--env: KEY=VALUE, found 'NOVALUE'"),
        (["--env", "=1"], "--env: KEY=VALUE, found '=1'"),
        (["--response", "0"], "--response and --samples must be >= 1"),
        (["--steps", "-1"], "--steps must be >= 0"),
        (["--logits-only-where-loss"], "an option of the RL paths"),
    ):
        with pytest.raises(SystemExit) as info:
            bench.parse_args(argv)
        assert info.value.code == 2 and message in capsys.readouterr().err, argv


def test_rl_samples_train_like_the_rl_job():
    """The rl paths' samples are the RL job's at 32K: one prompt's 31 images, 128-token responses that differ, and at
    CP=2 the backend's micro-batch puts the 128 loss positions (one per response token) on the two ranks."""
    from miles_vl.algo import loss_denominators
    from miles_vl.models import SpecialTokens
    from miles_vl.train.megatron.batch import attach_loss_inputs, pack_micro_batch, sample_loss_tokens
    from miles_vl.train.megatron.plan import MicroBatchSpec

    samples = bench.rl_samples(32768, 31, 128, 4)
    assert [s.input_ids.numel() for s in samples] == [32768] * 4 and {s.response_len for s in samples} == {128}
    assert all(s.input_ids[: s.prompt_len].equal(samples[0].input_ids[: s.prompt_len]) for s in samples)
    assert not samples[0].input_ids[-128:].equal(samples[1].input_ids[-128:])
    assert samples[0].pixel_values.dtype == torch.float32 and samples[0].pixel_values.shape[0] == 31 * 4096
    tokens = SpecialTokens(**bench.TOKENS, pad_token_id=bench.PAD, eos_token_ids=(bench.PAD,), vocab_size=151936)
    positions = 0
    for cp_rank in (0, 1):
        mb = pack_micro_batch(
            samples[:1], MicroBatchSpec([0]), tokens=tokens, spatial_merge_size=2, cp_size=2, cp_rank=cp_rank
        )
        assert mb.num_local_tokens == 16384
        den = loss_denominators(torch.tensor([sample_loss_tokens(samples[0])]))
        mb = attach_loss_inputs(mb, samples[:1], None, None, den, reduction="token_mean")
        positions += mb.loss.positions.numel()
    assert positions == 128


@pytest.mark.parametrize("where", [False, True])
def test_rl_options_are_the_rl_jobs(tmp_path, where):
    """The rl paths train with what the failing job's backend got: `factories.train_options` of loop_job's 2b_long32k
    shape at CP=2 (the config of docs/gpu-runs/2026-11-26-loop-long32k-cp2-2xh200), so they cannot drift apart."""
    from miles_vl.config import load_config
    from miles_vl.orchestration.factories import train_options
    from scripts.gpu import loop_job

    extra = ["train.num_gpus=2", "train.cp=2", f"train.logits_only_where_loss={str(where).lower()}"]
    cfg = load_config(loop_job.CONFIG, [*loop_job.overrides("2b_long32k", tmp_path / "ckpt", tmp_path, "x", 2), *extra])
    assert train_options(cfg, bench.special_tokens()) == bench.rl_options(32768, 4, 128, where)
