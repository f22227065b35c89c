"""Contract: the megatron backend's `set_vision_trainable(False)` holds every vision tensor through an optimizer step
while the language model trains, and True lets it train again. Its `set_lr` changes the peak learning rate from the
next optimizer step on, keeps the LR warm-up factor and the rest of the optimizer options, and leaves the options it
was built with unchanged (one CPU rank of the harness; the torch backend's: tests/orchestration/test_warmup.py)."""

from __future__ import annotations

import pytest

from tests.train.megatron import cpu_parts, jobs

pytestmark = pytest.mark.usefixtures("megatron_bridge")


def test_set_lr_sets_the_peak_lr_under_the_lr_warmup():
    (out,) = cpu_parts.spawn(jobs.job_set_lr, 1, args=(jobs.train_samples(0)[:2],))
    lr = jobs.LR
    assert out["set"] == pytest.approx([10 * lr / 4] * len(out["set"])) and out["lr_set"] == pytest.approx(10 * lr / 4)
    assert out["stepped"] == pytest.approx(out["set"])  # the first optimizer step ran at the new peak lr * 1/4
    assert out["train_lr"] == pytest.approx(10 * lr * 2 / 4)  # lr(): the next step's
    assert out["reset"] == pytest.approx([lr * 2 / 4] * len(out["reset"])) and out["lr_reset"] == pytest.approx(lr / 2)
    assert out["built_lr"] == lr  # the options the backend was built with are not changed
    assert out["options"]["lr"] == lr and out["options"]["warmup_steps"] == 4


def test_set_vision_trainable_holds_the_vision_tower():
    (out,) = cpu_parts.spawn(jobs.job_vision_trainable, 1, args=(jobs.train_samples(0)[:2],))
    vision = {n for n in out["names"] if n.startswith("vision_model.")}
    assert vision and len(vision) < len(out["names"])
    assert out["frozen_step"] and not set(out["frozen_step"]) & vision  # the language model moved, no vision tensor
    assert set(out["trainable_step"]) & vision  # trainable again
