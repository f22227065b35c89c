"""Contract (issue 32): `miles-vl check` and `miles-vl train` refuse, before anything starts, a megatron job whose
train logits on one rank could reach 2^31 elements (`train.megatron.step.MAX_TRAIN_LOGITS_ELEMENTS`, whose backward
fails with `CUDA error: invalid argument`), from the config and the model's vocabulary: `micro_batch_max_tokens / cp`
tokens a rank, or with `logits_only_where_loss` one sample's loss positions (`max_response_len`: the train step's
micro-batch plan keeps a micro-batch's under the limit, but cannot split a sample); x vocab / tp. The jobs are
scripts/gpu/loop_job.py's long shapes, the ones that failed on GPUs.
"""

from __future__ import annotations

import json

import pytest

from miles_vl.cli import main
from miles_vl.config import load_config
from miles_vl.models.qwen3_vl.shapes import RELEASED_SHAPES
from miles_vl.orchestration.preflight import recompute_layers_problems, train_logits_problems
from tests.scripts import load_script

loop_job = load_script("scripts/gpu/loop_job.py")

MODEL = "Qwen/Qwen3-VL-2B-Instruct"  # not on this machine: the released shape of that name (vocab 151,936)


def job(shape: str, *extra: str, model: str = MODEL):
    return load_config(loop_job.CONFIG, [*loop_job.overrides(shape, model, "/runs", "x", 2), *extra])


@pytest.mark.parametrize(("shape", "cp"), [("2b_long32k", 2), ("2b_long64k", 4)])
def test_the_long_jobs_that_failed_on_gpus_are_refused_without_logits_only_where_loss(shape, cp):
    """32K at CP=2 and 64K at CP=4: 16,384 tokens a rank x 151,936 = 2,489,319,424 elements, the GPU jobs that failed
    at their first backward; the shapes now set train.logits_only_where_loss, and with it (a sample's 128 response
    tokens at most: 19.4M elements) they pass."""
    layout = (f"train.num_gpus={cp}", f"train.cp={cp}")
    assert job(shape, *layout).train.logits_only_where_loss
    assert train_logits_problems(job(shape, *layout)) == []
    [problem] = train_logits_problems(job(shape, *layout, "train.logits_only_where_loss=false"))
    length = loop_job.LONG_LENGTHS[shape]
    assert (
        f"16,384 tokens (train.micro_batch_max_tokens={length} / train.cp={cp}) x 151,936 vocabulary entries "
        "(vocab 151,936 / train.tp=1) = 2,489,319,424 elements, at or past the limit of 2,147,483,648" in problem
    )
    assert "`CUDA error: invalid argument`" in problem and "at most 14,134 tokens" in problem
    fixes = problem.split(": ")[-1]
    assert fixes == (
        "set train.logits_only_where_loss=true (logits at the response positions only), or lower "
        "train.micro_batch_max_tokens, or raise train.cp / train.tp"
    )
    # the other fixes it names: TP=2 halves the vocabulary a rank holds, CP=4 halves a 32K sample's tokens a rank
    tp2 = (f"train.num_gpus={2 * cp}", "train.tp=2")
    assert train_logits_problems(job(shape, *layout, "train.logits_only_where_loss=false", *tp2)) == []
    cp4 = ("train.num_gpus=4", "train.cp=4", "train.logits_only_where_loss=false")
    assert train_logits_problems(job("2b_long32k", *cp4)) == []


def test_every_earlier_trained_shape_passes():
    """The 8,192-token micro-batches of the 2b shape at CP=1 (1.24e9 elements a rank) trained on GPUs."""
    assert train_logits_problems(job("2b")) == []


def test_logits_only_where_loss_is_bounded_by_one_samples_loss_positions():
    """With the logits at the response positions only, the train step's plan keeps each micro-batch's loss positions
    under the limit (tests/train/megatron/test_logits_limit.py), so only one sample's can reach it: 16 samples x 1,024
    response tokens (16,384 loss positions a mini-batch, refused here until 2026-11-28, and the 16,384-token
    micro-batches of the 2B loop with it) pass; a 16,384-token response is refused whatever the micro-batch, with the
    fixes that apply to it."""
    long_responses = ("rollout.max_response_len=1024", "train.global_batch_size=16", "rollout.batch_size=4")
    assert train_logits_problems(job("2b_long32k", *long_responses, "data.max_prompt_len=31000")) == []
    assert (
        train_logits_problems(job("2b", "train.micro_batch_max_tokens=24576", "train.logits_only_where_loss=true"))
        == []
    )
    one_long = ("rollout.max_response_len=16384", "data.max_prompt_len=1024", "train.micro_batch_max_tokens=32768")
    [problem] = train_logits_problems(job("2b", *one_long, "train.logits_only_where_loss=true"))
    assert (
        "16,384 loss positions (one sample's at most: rollout.max_response_len=16384) x 151,936 vocabulary entries"
        in problem
    )
    assert problem.split(": ")[-1] == (
        "lower rollout.max_response_len (the micro-batch plan keeps each micro-batch's loss positions under the limit, "
        "but cannot split a sample), or raise train.tp / train.cp"
    )
    # a sample's loss positions on a rank are also at most its row's share: at CP=2, (1,024 + 16,384) / 2 = 8,704 pass
    cp2 = ("train.num_gpus=2", "train.cp=2", "train.logits_only_where_loss=true")
    assert train_logits_problems(job("2b", *one_long, *cp2)) == []
    longer = ("rollout.max_response_len=30000", "data.max_prompt_len=1024", "train.micro_batch_max_tokens=32768")
    [problem] = train_logits_problems(job("2b", *longer, *cp2))  # 31,024 tokens: 15,512 a rank, past 14,134
    assert (
        "15,512 loss positions (one sample's at most: rollout.max_response_len=30000, its row of data.max_prompt_len "
        "+ max_response_len on one of train.cp=2 ranks)" in problem
    )


def test_the_vocabulary_comes_from_the_models_config_json(tmp_path):
    """A local checkpoint's config.json gives the vocabulary (text_config.vocab_size): a smaller one passes where the
    2B's does not; no checkpoint and no released shape of that name: nothing to check here (the train step still
    checks), and the torch backend never forms a whole row's logits (it projects in chunks)."""
    small = {**RELEASED_SHAPES["Qwen3-VL-2B"], "model_type": "qwen3_vl"}
    small["text_config"] = {**small["text_config"], "vocab_size": 100_000}  # 16,384 x 100,000 = 1.64e9
    (tmp_path / "config.json").write_text(json.dumps(small))
    cp2 = ("train.num_gpus=2", "train.cp=2", "train.logits_only_where_loss=false")
    assert train_logits_problems(job("2b_long32k", *cp2)) != []
    assert train_logits_problems(job("2b_long32k", *cp2, model=str(tmp_path))) == []
    assert train_logits_problems(job("2b_long32k", *cp2, model=str(tmp_path / "nowhere"))) == []


def test_check_refuses_it_with_exit_2_before_anything_starts(capsys, tmp_path):
    """`miles-vl check` (the same preflight as `train`): exit 2, the message among the problems, no run directory."""
    import ray

    argv = ["check", str(loop_job.CONFIG), *loop_job.overrides("2b_long32k", MODEL, tmp_path / "runs", "x", 2)]
    assert main([*argv, "train.num_gpus=2", "train.cp=2", "train.logits_only_where_loss=false"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "= 2,489,319,424 elements, at or past the limit of 2,147,483,648" in err
    assert not (tmp_path / "runs").exists() and not ray.is_initialized()


def test_recompute_layers_past_a_stages_layers_are_refused_before_anything_starts():
    """train.recompute_layers counts a pipeline stage's decoder layers: the 2B model's 28, or 14 a stage at pp=2; more
    is refused with the count that fits (the trainer's build_provider refuses it too, but only once Ray started)."""
    assert recompute_layers_problems(job("2b", "train.recompute_layers=28")) == []
    [problem] = recompute_layers_problems(job("2b", "train.recompute_layers=29"))
    assert problem == (
        f"train.recompute_layers=29 but a pipeline stage of {MODEL} has 28 decoder layers (28 / train.pp=1): set at "
        "most 28, or null for every layer"
    )
    staged = ("train.num_gpus=2", "train.pp=2", "train.recompute_layers=15")
    [problem] = recompute_layers_problems(job("2b", *staged))
    assert "has 14 decoder layers (28 / train.pp=2): set at most 14" in problem
    assert recompute_layers_problems(job("2b")) == []  # null: every layer
