"""The one-GPU production job (configs/geo3k_qwen3vl_1gpu.yaml with scripts/gpu/loop_job.py's overrides, exactly what
scripts/gpu/loop_run.sh runs on the GPU machine) on CPU stand-ins: a local Ray that believes it has one GPU, the
Megatron trainer built by tests/orchestration/megatron_cpu.py and the SGLang engine served by
tests/rollout/sglang/hf_server.py, colocated in that GPU's slot.

Contract: the shipped config and the GPU run's overrides validate and run the whole loop (rollout, reward, train with
release/resume around it, sync); a second run with a larger num_steps resumes from the Megatron checkpoint and
continues the metrics; every step reports the figures docs/gpu.md quotes (per-phase seconds with the reward timed on
its own, what each sync moved), and the bytes synced are the checkpoint's trainable weights (an independent count:
the tensors of model.safetensors, every one trainable here). scripts/gpu/summarize_run.py reads the run.
The GPU run itself is the real-component check of these stand-ins (docs/gpu.md, "The production loop on one GPU").
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import ray
from safetensors import safe_open

from miles_vl.config import load_config
from miles_vl.orchestration import run_job
from miles_vl.orchestration.checkpoint import step_dir_name
from miles_vl.rollout.weight_sync import WeightSyncOptions
from tests.orchestration.jobs import REPO, metrics, stand_ins, write_checkpoint
from tests.patches.harness.shims import require_bridge
from tests.scripts import load_script

loop_job = load_script("scripts/gpu/loop_job.py")


@pytest.fixture(scope="module", autouse=True)
def _bridge():
    require_bridge("0.6.2")


CPU = ("model.dtype=fp32", "data.synthetic_n=64", "rollout.batch_size=4")  # fp32 stand-ins; a smaller job


@pytest.fixture
def one_fake_gpu():
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()


def test_one_gpu_job_runs_resumes_and_reports(tmp_path, one_fake_gpu):
    ckpt = write_checkpoint(tmp_path / "ckpt", initializer_range=0.2)
    rows = []
    for steps in (2, 3):  # the second run resumes from the checkpoint the first one wrote at its end
        cfg = load_config(loop_job.CONFIG, [*loop_job.overrides("tiny", ckpt, tmp_path, "one_gpu", steps), *CPU])
        assert (cfg.rollout.backend, cfg.train.backend, cfg.ray.placement) == ("sglang", "megatron", "colocate")
        assert (cfg.train.num_gpus, cfg.rollout.num_engines, cfg.rollout.gpus_per_engine) == (1, 1, 1)
        run = run_job(cfg, hooks=stand_ins(sglang=True, megatron=True))
        rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert (run / "checkpoints" / step_dir_name(3)).is_dir()

    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        weight_bytes = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
        n_tensors = len(list(f.keys()))
    for r in rows:
        for key in ("time/rollout_s", "time/reward_s", "time/train_s", "time/sync_s", "train/grad_norm"):
            assert r[key] >= 0, key
        assert r["sync/bytes"] == weight_bytes and r["sync/tensors"] == n_tensors
        assert r["rollout/prompts"] == 4 and r["rollout/response_tokens"] > 0
    assert rows[0]["train/train_rollout_logprob_abs_diff"] < 1e-4  # fp32 stand-ins: same weights, same numbers

    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu" / "summarize_run.py"), str(run), "--ckpt", str(ckpt)],
        capture_output=True, text=True, check=True, cwd=REPO,
    )  # fmt: skip
    summary = json.loads(out.stdout.splitlines()[-1])
    assert (summary["steps"], summary["first_step"], summary["last_step"]) == (3, 1, 3)
    assert summary["sync_bytes"] == weight_bytes and summary["train_flops_per_step"] > 0 and "train_mfu" in summary
    assert summary["logprob_abs_diff_step1"] == rows[0]["train/train_rollout_logprob_abs_diff"]


def test_loop_job_refuses_an_unknown_shape():
    with pytest.raises(ValueError, match="shape must be one of"):
        loop_job.overrides("7b", "/ckpt", "/runs", "x", 1)


def test_loop_job_8b_shape_is_the_8b_config_at_tp2_cp2_on_four_gpus(tmp_path):
    """The `8b` shape of the GPU run (issue 32.4): configs/geo3k_qwen3vl_8b.yaml with the run's overrides validates
    as 4 GPUs of Megatron TP=2 x CP=2 (DP=1) and two 2-GPU SGLang engines on the same GPUs, colocated."""
    assert loop_job.CONFIGS["8b"].name == "geo3k_qwen3vl_8b.yaml"
    cfg = load_config(loop_job.CONFIGS["8b"], loop_job.overrides("8b", tmp_path / "ckpt", tmp_path, "eight_b", 6))
    assert (cfg.rollout.backend, cfg.train.backend, cfg.ray.placement) == ("sglang", "megatron", "colocate")
    assert (cfg.train.num_gpus, cfg.train.tp, cfg.train.cp, cfg.train.sp) == (4, 2, 2, True)
    assert (cfg.rollout.num_engines, cfg.rollout.gpus_per_engine) == (2, 2)
    assert (cfg.data.min_pixels, cfg.data.max_pixels) == loop_job.PIXELS["8b"]
    assert cfg.rollout.sglang.mem_fraction_static == 0.4 and cfg.train.recompute == "full"
    assert cfg.num_steps == 6 and cfg.eval.interval == 0 and cfg.data.train_path is None


def test_loop_job_8b_1gpu_shape_is_the_8b_model_on_one_gpu_with_the_optimizer_offloaded(tmp_path):
    """The `8b_1gpu` shape (issue 33.5): configs/geo3k_qwen3vl_8b.yaml with the run's overrides validates as one GPU
    of Megatron (TP=CP=1, no sequence parallel) with its optimizer state on the CPU and one 1-GPU SGLang engine on
    the same GPU; its memory estimate: tests/orchestration/test_memory.py."""
    assert loop_job.CONFIGS["8b_1gpu"].name == "geo3k_qwen3vl_8b.yaml"
    cfg = load_config(loop_job.CONFIGS["8b_1gpu"], loop_job.overrides("8b_1gpu", tmp_path / "ckpt", tmp_path, "x", 4))
    assert (cfg.rollout.backend, cfg.train.backend, cfg.ray.placement) == ("sglang", "megatron", "colocate")
    assert (cfg.train.num_gpus, cfg.train.tp, cfg.train.cp, cfg.train.sp) == (1, 1, 1, False)
    assert (cfg.rollout.num_engines, cfg.rollout.gpus_per_engine) == (1, 1)
    assert cfg.train.optimizer.cpu_offload == 1.0 and cfg.train.recompute == "full"
    assert (cfg.data.min_pixels, cfg.data.max_pixels) == loop_job.PIXELS["8b"]
    assert cfg.num_steps == 4 and cfg.effective_global_batch_size == cfg.samples_per_step == 64


@pytest.fixture
def two_fake_gpus():
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()


def test_loop_job_runs_rollouts_ahead_disaggregated(tmp_path, two_fake_gpus):
    """Issue 34: docs/async.md's GPU command (`loop_run.sh tiny NAME 20 ray.placement=disaggregate train.num_gpus=1
    rollout.max_staleness=1`) is a valid job: loop_job adds the correction (algo.tis.enabled) and the job runs on the
    SGLang and Megatron stand-ins with its engine on a GPU of its own, the weights going over the group sync (gloo),
    each step after the first trained on a batch one step old."""
    ckpt = write_checkpoint(tmp_path / "ckpt", initializer_range=0.2)
    extra = ["ray.placement=disaggregate", "train.num_gpus=1", "rollout.max_staleness=1"]
    derived = loop_job.staleness_overrides(extra)
    assert derived == ["algo.tis.enabled=true"]
    assert loop_job.staleness_overrides([*extra, "algo.tis.enabled=false"]) == []  # the command line's own value wins
    base = loop_job.overrides("tiny", ckpt, tmp_path, "ahead", 3)
    cfg = load_config(loop_job.CONFIG, [*base, *CPU, *derived, *extra])
    assert (cfg.ray.placement, cfg.rollout.max_staleness, cfg.algo.tis.enabled) == ("disaggregate", 1, True)
    sync = WeightSyncOptions(group_backend="gloo")  # gloo in place of NCCL between the fake GPUs
    rows = metrics(run_job(cfg, hooks=stand_ins(sglang=True, megatron=True, weight_sync=sync)))
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]
    assert all(r["train/tis_weight_max"] > 0 for r in rows)
