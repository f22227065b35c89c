"""Contract: the train-phase levers of the megatron backend (issue 33) change how much work a step does, never what
it computes. Each variant runs one RL step (`train_step`) from the same weights on the CPU harness (two gloo ranks:
DP 2, then CP 2) and is compared with the step without the lever (the torch backend's: tests/train/
test_torch_backend.py)."""

from __future__ import annotations

import pytest
import torch

from tests.train.megatron import cpu_parts, jobs

LAYOUTS = jobs.TWO_RANK_LAYOUTS


pytestmark = pytest.mark.usefixtures("megatron_bridge")


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    variants = {
        "today": {},
        "fused_old": dict(old_logprobs_from_train_forward=True),
        "two_updates": dict(global_batch_size=4),
        "two_updates_fused_old": dict(global_batch_size=4, old_logprobs_from_train_forward=True),
        "logits_only_where_loss": dict(logits_only_where_loss=True),
        "one_row": dict(micro_batch_max_tokens=4096),  # each rank's samples in one micro-batch
        "vision_once_per_image": dict(micro_batch_max_tokens=4096, vision_once_per_image=True),
    }
    return cpu_parts.spawn(jobs.job_levers, 2, args=(jobs.group_train_samples(), LAYOUTS, variants))


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def _close(a: dict, b: dict, tol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for n in a:
        scale = float(b[n].abs().max()) or 1.0
        assert float((a[n] - b[n]).abs().max()) <= tol * scale, n


@pytest.mark.parametrize("layout", LAYOUTS)
def test_old_logprobs_from_the_train_forward_are_bit_identical(runs, layout):
    """One optimizer update per RL step: no separate old-logprob pass; every metric (the rollout logprob distance
    included) and every weight after the step are bit-identical to the step with the separate pass."""
    for rank in runs:
        today, fused = rank[layout]["today"], rank[layout]["fused_old"]
        assert today["old_passes"] == 1 and fused["old_passes"] == 0
        assert today["metrics"]["train/train_rollout_logprob_abs_diff"] > 0.1  # random rollout logprobs
        assert fused["metrics"] == today["metrics"]
        assert _same_weights(fused["weights"], today["weights"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_several_updates_keep_the_separate_old_logprob_pass(runs, layout):
    for rank in runs:
        today, fused = rank[layout]["two_updates"], rank[layout]["two_updates_fused_old"]
        assert today["metrics"]["train/optimizer_steps"] == 2
        assert fused["old_passes"] == 1 and fused["metrics"] == today["metrics"]
        assert _same_weights(fused["weights"], today["weights"])


def test_recompute_maps_to_megatrons_settings(tmp_path):
    """`train.recompute`: none and selective and full are megatron's own settings for the whole model (the tower
    copies the language model's); vision leaves the language model without recompute and recomputes every layer
    of the vision tower (one per checkpoint)."""
    jobs.write_tiny_hf_checkpoint(str(tmp_path))
    (out,) = cpu_parts.spawn(jobs.job_recompute, 1, args=(str(tmp_path),))
    off, full = (None, None, None), ("full", "uniform", 1)
    assert out["none"]["language"] == off and out["none"]["vision"] == [off]
    assert out["selective"]["provider"]["recompute_granularity"] == "selective"
    assert out["selective"]["vision"] == [tuple(out["selective"]["provider"].values())]
    assert out["full"]["language"] == full and out["full"]["vision"] == [full]
    assert "recompute_vision_tower" not in out["full"]["hooks"]
    assert "recompute_vision_tower" in out["vision"]["hooks"]
    assert out["vision"]["language"] == off and out["vision"]["vision"] == [full]
    # train.recompute_layers=1: megatron's block method on the language model's first layer only; the tower, whose
    # config copies the language model's, recomputes all of its layers again (the pre-wrap hook)
    first = out["full_first_1"]
    assert first["provider"] == {
        "recompute_granularity": "full",
        "recompute_method": "block",
        "recompute_num_layers": 1,
    }
    assert first["language"] == ("full", "block", 1) and first["vision"] == [full]
    assert "keep_vision_tower_recomputed" in first["hooks"]
    layers = out["full"]["num_layers"]
    assert (
        f"train.recompute_layers={layers + 1} but a pipeline stage of {tmp_path} has {layers} decoder layers"
        in (out["refusals"]["past"])
    )
    assert "needs train.recompute=full or language" in out["refusals"]["not_full"]
    # train.recompute=language: the language model as full (every layer, or its first recompute_layers); the
    # tower, whose config copies it, keeps its activations (the pre-wrap hook)
    for key, language in (("language", full), ("language_first_1", ("full", "block", 1))):
        assert out[key]["language"] == language and out[key]["vision"] == [off], key
        assert "no_recompute_in_vision_tower" in out[key]["hooks"], key
        assert "keep_vision_tower_recomputed" not in out[key]["hooks"], key
    assert f"train.recompute_layers={layers + 1} but a pipeline stage" in out["refusals"]["language_past"]
    # a tower module holding the language model's config (megatron-bridge with Transformer Engine's layers): the
    # tower's setting goes to its own copy, and the language model keeps its own
    assert out["language_shared"]["language"] == full and out["language_shared"]["vision"] == [off]
    assert out["first_1_shared"]["language"] == ("full", "block", 1) and out["first_1_shared"]["vision"] == [full]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_only_where_loss_give_todays_loss_and_gradients(runs, layout):
    """The output layer on the loss positions only: the same metrics and
    the same reduced gradients of every parameter (the output layer's, the decoder's through the selected hidden
    states, the vision tower's) as the full-row logits."""
    for rank in runs:
        today, only = rank[layout]["today"], rank[layout]["logits_only_where_loss"]
        assert 0 < only["logit_rows"] < today["logit_rows"]
        assert only["metrics"].keys() == today["metrics"].keys()
        for key, value in today["metrics"].items():
            assert only["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
        [want], [got] = today["grads"], only["grads"]
        vision = [g for n, g in want.items() if n.startswith("vision_model.")]
        assert vision and any(float(g.abs().max()) > 0 for g in vision)
        _close(got, want)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_vision_once_per_image_gives_todays_loss_and_gradients(runs, layout):
    """Two image prompts, four responses each (every DP rank gets two of each): the vision tower runs on the
    distinct images of its call only (under CP every rank runs the micro-batch's images), and the metrics and the
    reduced gradients (the tower's: the sum over the uses) are those of the per-sample path."""
    for rank in runs:
        today, once = rank[layout]["one_row"], rank[layout]["vision_once_per_image"]
        assert 0 < 2 * once["vision_patches"] <= today["vision_patches"]  # at least two uses of every image
        for key, value in today["metrics"].items():
            assert once["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
        [want], [got] = today["grads"], once["grads"]
        assert any(float(g.abs().max()) > 0 for n, g in want.items() if n.startswith("vision_model."))
        _close(got, want)


def test_levers_that_cannot_be_exact_are_refused():
    (out,) = cpu_parts.spawn(jobs.job_lever_refusals, 1)
    assert "train.logits_only_where_loss is not supported with sequence parallelism" in out["sp"]
    assert "set train.logits_only_where_loss=false or train.sp=false" in out["sp"]
    assert "train.old_logprobs_from_train_forward needs a model without dropout" in out["dropout"]


def test_recompute_layers_checkpoints_the_first_layers_only_and_computes_the_same():
    """train.recompute_layers=1 as build_provider sets it (megatron's block method on the language model, the tower
    set back to full by the pre-wrap hook): the language model's block checkpoints its first layer only, the tower
    every layer, in each forward of the step; train.recompute=language (with and without recompute_layers=1): the
    tower checkpoints none. The metrics and gradients of each are those of full recompute and of none."""
    (out,) = cpu_parts.spawn(jobs.job_recompute_layers, 1, args=(jobs.group_train_samples(),))
    none, full, first = out["none"], out["full"], out["first_1"]
    assert any(n.startswith("vision_model.") for n in none["grads"])  # the gradients before the optimizer's step
    layers = full["layers"]
    assert layers["language"] >= 2 and layers["vision"] >= 2  # so that "the first only" differs from "all"
    assert none["checkpointed"] == {"language": 0, "vision": 0}
    forwards = full["checkpointed"]["language"] // layers["language"]  # the train forwards of the step
    assert forwards >= 1 and full["checkpointed"] == {
        "language": forwards * layers["language"],
        "vision": forwards * layers["vision"],
    }
    assert first["checkpointed"] == {"language": forwards, "vision": forwards * layers["vision"]}
    # train.recompute=language: the tower checkpoints nothing, the language model every layer or its first
    assert out["language"]["checkpointed"] == {"language": forwards * layers["language"], "vision": 0}
    assert out["language_first_1"]["checkpointed"] == {"language": forwards, "vision": 0}
    for setting in (first, out["language"], out["language_first_1"]):
        for other in (none, full):
            for key, value in other["metrics"].items():
                assert setting["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
            _close(setting["grads"], other["grads"])


def test_full_recompute_keeps_the_vision_towers_deepstack_gradients():
    """megatron-bridge 0.6.2's vision tower under full recompute returns its deepstack features in a list from the
    checkpointed function, which megatron-core's CheckpointFunction (run here, its CUDA RNG stubbed) leaves without
    gradients: upstream, the deepstack mergers get none and the tower's layers a different gradient. With miles_vl's
    `vision_recompute_deepstack_grads` patch full recompute gives the gradients of no recompute."""
    (out,) = cpu_parts.spawn(jobs.job_vision_recompute_grads, 1, args=(jobs.group_train_samples(),))
    none, full, upstream = out["none"], out["full"], out["full_upstream"]
    mergers = [n for n in none["grads"] if "deepstack_merger_list" in n]
    assert mergers and any(float(none["grads"][n].abs().max()) > 0 for n in mergers)
    for key, value in none["metrics"].items():  # the values are right either way: the loss, the logprobs
        assert full["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
        assert upstream["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    _close(full["grads"], none["grads"])
    # upstream (megatron-bridge 0.6.2, the release the harness pins; a release that fixes it fails here, and the
    # patch's detection should then say "native"): no deepstack merger has a gradient (absent, or zero in the
    # buffer), and the tower's layers below the deepstack taps get another gradient than no recompute's
    assert all(n not in upstream["grads"] or float(upstream["grads"][n].abs().max()) == 0 for n in mergers)
    layers = [n for n in none["grads"] if n.startswith("vision_model.decoder.layers.")]
    assert layers and any(
        n not in upstream["grads"] or not torch.allclose(upstream["grads"][n], none["grads"][n], rtol=1e-4, atol=1e-6)
        for n in layers
    )
