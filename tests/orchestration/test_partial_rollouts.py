"""Partial rollouts in the driver loop (issue 34, item 2: `rollout.partial_rollouts`), end to end on CPU with the
SGLang stand-in servers of test_sglang_loop.py (tests/rollout/sglang/hf_server.py: the tiny HF Qwen3-VL behind
SGLang 0.5.16's HTTP API, launched by the real host), disaggregated, `max_staleness=1`.

The stand-in holds one sample of the batch generated ahead (its "hold" fault, from a fault file: it decodes 2 tokens
and waits for an `/abort_request`): the batch cannot finish before the trainer is done with the step, so the weight
sync that ends the step meets a generation in flight. The driver pauses the engine (abort_all), syncs, and continues:
the held sample comes back with its 3 tokens so far, is sent again as prompt + those tokens under the new weights, and
is trained at the next step as one sample whose tokens carry two versions (span 1: the weights of step 0, span 2:
those of step 1): nothing lost, nothing trained twice; the step's per-token staleness is below its per-sample one.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
import ray

from miles_vl.orchestration import run_job
from miles_vl.orchestration.trainer import Trainer
from miles_vl.rollout.weight_sync import WeightSyncOptions
from tests.orchestration.jobs import metrics, stand_ins, write_checkpoint
from tests.orchestration.test_sglang_loop import config
from tests.rollout.sglang.fake_server import read_journal

SAMPLES = 4  # rollout.batch_size=2 x n_samples_per_prompt=2 (the tiny job)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture
def hooks():
    return stand_ins(sglang=True, weight_sync=WeightSyncOptions(bucket_bytes=64 * 1024))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny_qwen3vl"))


def test_a_generation_in_flight_at_a_sync_is_continued_and_trained_once(
    tmp_path, checkpoint, hooks, local_ray, monkeypatch
):
    trained: list[list] = []
    train = Trainer.train

    def record_train(trainer, samples):
        trained.append(list(samples))
        return train(trainer, samples)

    monkeypatch.setattr(Trainer, "train", record_train)
    journal_dir, fault = tmp_path / "journal", tmp_path / "fault.json"
    journal_dir.mkdir()
    # the first sample after batch 0's (generated before the trainer starts) is held until an abort reaches it
    fault.write_text(json.dumps({"path": "/generate", "kind": "hold", "value": 2, "times": 1, "after": SAMPLES}))
    run = run_job(
        config(
            tmp_path,
            checkpoint,
            "partial",
            "num_steps=3",
            "ray.placement=disaggregate",
            "rollout.num_engines=1",
            "eval.interval=0",
            "rollout.max_staleness=1",
            "rollout.partial_rollouts=true",
            "algo.tis.enabled=true",
            f"rollout.sglang.extra_args=[--fake-journal,{journal_dir},--fake-fault-file,{fault}]",
        ),
        hooks=hooks,
    )
    rows = metrics(run)
    assert [r["rollout/continued_samples"] for r in rows] == [0.0, 1.0, 0.0]
    assert rows[1]["rollout/staleness_mean"] == 1.0  # every sample began under the weights of step 0 ...
    assert rows[1]["rollout/token_staleness_mean"] < 1.0  # ... but the continued one's second span is fresh

    assert [len(samples) for samples in trained] == [SAMPLES] * 3  # nothing lost
    [continued] = [s for samples in trained for s in samples if s.token_versions is not None]
    assert continued in trained[1]  # trained once, at the step its batch belongs to
    versions = continued.token_versions.tolist()
    assert versions[:3] == [0, 0, 0] and set(versions[3:]) == {1} and len(versions) > 3  # span 1: 2 + 1 tokens
    assert continued.weight_version == 0  # the bound is measured by its oldest span
    prompts = collections.Counter(tuple(s.input_ids[: s.prompt_len].tolist()) for ss in trained for s in ss)
    assert sum(prompts.values()) == 3 * SAMPLES

    [records] = read_journal(journal_dir).values()
    paths = [r["path"] for r in records if "path" in r]
    assert paths.count("/abort_request") >= 1
    assert not fault.exists()  # the server took the fault
