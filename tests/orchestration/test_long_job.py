"""The long-context job (scripts/gpu/loop_job.py's 2b_long shapes, docs/long_context.md) scaled down on CPU stand-ins:
the same overrides (`long_shape`, the `many_images` task) at ~1.6K tokens instead of 64K, on a local Ray that believes
it has 4 GPUs, the Megatron trainer at CP=4 (tests/orchestration/megatron_cpu.py) and the SGLang engine served by
tests/rollout/sglang/hf_server.py, colocated.

Contract (issue 32.3b): with every bound set exactly to the longest sample (data.max_prompt_len = the prompt's
length, train.micro_batch_max_tokens = prompt + max_response_len padded to 2 * cp) nothing refuses, drops or
truncates a sample: every prompt is kept, the trainer trains on every token the engine saw (train/tokens = prompt
and response tokens of every sample plus CP padding only), and its logprobs equal the engine's (fp32 stand-ins, same
weights: a truncated or shifted sequence would differ by far more than 1e-4). One token less of either bound is
refused before anything starts, with the bound's name: the prompt filter as a DataError (the CLI's exit 2), the
budget as a ConfigError.
"""

from __future__ import annotations

import pytest
import ray

from miles_vl.config import ConfigError, load_config
from miles_vl.data import DataError, PromptEncoder, load_processor
from miles_vl.data.synth import many_images_count, many_images_problem_text
from miles_vl.orchestration import run_job
from tests.orchestration.jobs import metrics, stand_ins, write_checkpoint
from tests.patches.harness.shims import require_bridge
from tests.scripts import load_script

loop_job = load_script("scripts/gpu/loop_job.py")

LENGTH, TOKENS_PER_IMAGE, CP = 2048, 64, 4  # 256x256 images of 64 vision tokens; the GPU job: 65536, 1024, 4
PIXELS = TOKENS_PER_IMAGE * 32 * 32  # patch 16, merge 2: one vision token per 32x32 pixels
RESPONSE = loop_job.LONG_RESPONSE


@pytest.fixture(scope="module", autouse=True)
def _bridge():
    require_bridge("0.6.2")


@pytest.fixture
def four_fake_gpus():
    ray.init(num_cpus=4, num_gpus=4, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()


def prompt_len(cfg) -> int:
    """The length of every prompt of the job (the same text and image sizes for each), as the loader counts it."""
    processor = load_processor("offline", cfg.data.min_pixels, cfg.data.max_pixels)
    encoder = PromptEncoder(processor, system_prompt=cfg.data.system_prompt, instruction=cfg.data.instruction)
    images = cfg.data.synthetic_images
    return encoder.count_tokens(many_images_problem_text(images), [(1024, 1024)] * images)


def job(tmp_path, ckpt, name: str, *extra: str):
    return load_config(
        loop_job.CONFIG,
        [
            *loop_job.overrides("2b_long64k", ckpt, tmp_path, name, 1),
            *loop_job.long_shape(LENGTH, TOKENS_PER_IMAGE),  # the 2b_long64k overrides at the scaled length
            *("model.dtype=fp32", "data.synthetic_n=4", f"data.min_pixels={PIXELS}", f"data.max_pixels={PIXELS}"),
            *("train.num_gpus=4", f"train.cp={CP}"),
            *extra,
        ],
    )


@pytest.mark.slow  # 4 gloo ranks: 309 s measured on 2 cores shared with other jobs (load ~10)
def test_long_sample_at_the_bounds_trains_whole_at_cp4(tmp_path, four_fake_gpus):
    ckpt = write_checkpoint(tmp_path / "ckpt", initializer_range=0.2)
    base = job(tmp_path, ckpt, "probe")
    assert base.data.synthetic_images == many_images_count(LENGTH, TOKENS_PER_IMAGE) == 19
    n = prompt_len(base)
    assert 0.7 * LENGTH < n + RESPONSE <= LENGTH
    budget = -(-(n + RESPONSE) // (2 * CP)) * 2 * CP
    tight = (f"data.max_prompt_len={n}", f"train.micro_batch_max_tokens={budget}")
    cfg = job(tmp_path, ckpt, "long", *tight)
    assert (cfg.train.cp, cfg.dp_size, cfg.rollout.backend, cfg.ray.placement) == (CP, 1, "sglang", "colocate")
    [row] = metrics(run_job(cfg, hooks=stand_ins(sglang=True, megatron=True)))

    samples = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
    assert row["rollout/prompts"] == cfg.rollout.batch_size  # no prompt dropped
    assert n < row["rollout/sample_len_max"] <= n + RESPONSE
    real = samples * n + row["rollout/response_tokens"]
    assert 0 <= row["train/tokens"] - real < (samples + 1) * 2 * CP  # CP padding only: < 2*cp per sample and row
    assert row["train/train_rollout_logprob_abs_diff"] < 1e-4, row  # the trainer scored the sequences the engine did

    # one token less of either bound: refused before anything runs, naming the bound
    with pytest.raises(ConfigError, match="train.micro_batch_max_tokens=.* cannot hold one sample"):
        job(tmp_path, ckpt, "x", tight[0], f"train.micro_batch_max_tokens={n + RESPONSE - 1}")
    with pytest.raises(DataError, match="prompt_too_long=4"):
        run_job(job(tmp_path, ckpt, "short", f"data.max_prompt_len={n - 1}"), hooks=stand_ins(sglang=True))


@pytest.mark.parametrize("layout", [(1, 1), (1, 2), (1, 4), (2, 2)])
@pytest.mark.parametrize("shape, length, images", [("2b_long16k", 16384, 15), ("2b_long32k", 32768, 31),
                                                   ("2b_long64k", 65536, 62)])  # fmt: skip
def test_long_shapes_validate_at_every_layout_on_four_gpus(tmp_path, shape, length, images, layout):
    """The GPU runs' command lines (`loop_run.sh 2b_long64k NAME 2 train.num_gpus=4 train.cp=4`, docs/long_context.md)
    validate: every bound holds the length, 1024x1024 images kept whole, one engine colocated on the train GPUs."""
    tp, cp = layout
    extra = ["train.num_gpus=4", f"train.tp={tp}", f"train.cp={cp}"]
    cfg = load_config(loop_job.CONFIG, [*loop_job.overrides(shape, tmp_path / "ckpt", tmp_path, "x", 2), *extra])
    assert (cfg.data.synthetic_task, cfg.data.synthetic_images) == ("many_images", images)
    assert (cfg.data.min_pixels, cfg.data.max_pixels) == loop_job.PIXELS[shape] == (1024 * 1024, 1024 * 1024)
    assert cfg.data.max_prompt_len + cfg.rollout.max_response_len == cfg.train.micro_batch_max_tokens == length
    assert (cfg.train.backend, cfg.ray.placement, cfg.rollout.num_engines) == ("megatron", "colocate", 1)
    assert cfg.dp_size == 4 // (tp * cp) and cfg.train.recompute == "full"
