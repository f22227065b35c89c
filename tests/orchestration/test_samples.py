"""Contracts of the sample files (issue 35.1), on the tiny CPU job:
- every `logging.samples_interval` steps, rollouts/step_N.jsonl holds every sample of step N (prompts x n), whose mean
  reward is the step's `reward/mean`; every eval writes rollouts/eval_step_N.jsonl; a few are shown on the console;
  an offline wandb run gets the table;
- a resume that computes a step again replaces its file with the same samples: none lost, none duplicated;
- a warning when every group has zero advantage and when most responses hit the length limit, and none otherwise;
- the progress line shows the latest eval accuracy, labelled, on the steps after it.
"""

from __future__ import annotations

import io
import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import ray
import torch
from rich.console import Console

from miles_vl.orchestration import run_job
from miles_vl.orchestration.checkpoint import list_checkpoints
from miles_vl.orchestration.progress import Progress
from miles_vl.orchestration.samples import sample_records, warn_if_stuck
from miles_vl.reward import RewardResult
from miles_vl.rollout import Generation
from miles_vl.rollout.collect import GeneratedGroup
from tests.orchestration.jobs import metrics
from tests.orchestration.jobs import tiny_job as config

SAMPLES = ("num_steps=4", "logging.samples_interval=2", "logging.samples_shown=1")


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, str]:
    """4 steps with samples every 2 steps, wandb offline; the run directory and what the driver logged."""
    tmp = tmp_path_factory.mktemp("samples")
    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("miles_vl")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        run_dir = run_job(config(tmp, "straight", *SAMPLES, "checkpoint.interval=0", "logging.wandb.mode=offline"))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return run_dir, "\n".join(records)


def test_sample_files_hold_every_sample_of_their_step(straight):
    run_dir, _ = straight
    cfg = config(run_dir.parent, "straight", *SAMPLES)
    by_step = {r["step"]: r for r in metrics(run_dir)}
    files = sorted(p.name for p in (run_dir / "rollouts").iterdir())
    assert files == ["eval_step_2.jsonl", "eval_step_4.jsonl", "step_2.jsonl", "step_4.jsonl"]
    n = cfg.rollout.n_samples_per_prompt
    for step in (2, 4):
        samples = read(run_dir / "rollouts" / f"step_{step}.jsonl")
        assert len(samples) == cfg.rollout.batch_size * n
        assert {s["step"] for s in samples} == {step}
        rewards = [s["reward"] for s in samples]
        assert sum(rewards) / len(rewards) == pytest.approx(by_step[step]["reward/mean"])
        truncated = [s["truncated"] for s in samples]
        assert sum(truncated) / len(truncated) == pytest.approx(by_step[step]["rollout/truncated_fraction"])
        lengths = [s["response_len"] for s in samples]
        assert sum(lengths) / len(lengths) == pytest.approx(by_step[step]["rollout/response_len_mean"])
        assert all(s["kept"] and isinstance(s["advantage"], float) for s in samples)
        for g in {s["group"] for s in samples}:  # grpo: a group's advantages sum to zero
            assert sum(s["advantage"] for s in samples if s["group"] == g) == pytest.approx(0.0, abs=1e-5)
        # the reward function scores the decoded response: length_reward = min(len, 40) / 40
        assert all(s["reward"] == pytest.approx(min(len(s["response"]), 40) / 40) for s in samples)
        assert all(s["answer"] and s["prompt"].count("<image>") == 1 for s in samples)  # one image, one placeholder
        assert not any("<|" in s["prompt"] for s in samples)  # special tokens (pads, chat markers) skipped
        evals = read(run_dir / "rollouts" / f"eval_step_{step}.jsonl")
        assert len(evals) == by_step[step]["eval/prompts"] * cfg.eval.n_samples_per_prompt
        assert sum(s["reward"] for s in evals) / len(evals) == pytest.approx(by_step[step]["eval/reward_mean"])


def test_console_shows_a_few_samples_at_the_interval(straight):
    run_dir, logged = straight
    first = read(run_dir / "rollouts" / "step_2.jsonl")[0]
    assert f"step 2: 1 of 4 samples (all in {run_dir / 'rollouts' / 'step_2.jsonl'})" in logged
    assert f"answer {first['answer']!r}" in logged
    assert "eval step 4: 1 of" in logged
    assert "step 1: 1 of" not in logged and "step 3: 1 of" not in logged


def test_offline_wandb_run_gets_the_sample_table(straight):
    run_dir, _ = straight
    tables = sorted((run_dir / "wandb").glob("offline-run-*/files/media/table/samples/*.table.json"))
    names = sorted(re.match(r"(eval_)?step_\d+", p.name)[0] for p in tables)  # <key>_<wandb step>_<hash>
    assert names == ["eval_step_2", "eval_step_4", "step_2", "step_4"], [p.name for p in tables]
    table = json.loads(next(p for p in tables if p.name.startswith("step_2")).read_text())
    assert len(table["data"]) == 4 and "response" in table["columns"] and "reward" in table["columns"]


def test_a_resume_replaces_a_recomputed_step_file_without_duplicates(straight, tmp_path):
    run_dir, _ = straight
    split = run_job(config(tmp_path, "split", *SAMPLES, "checkpoint.interval=2"))
    ckpts = list_checkpoints(split / "checkpoints")
    assert [s for s, _ in ckpts] == [2, 4]
    shutil.rmtree(ckpts[-1][1])  # as if killed after step 4 wrote its samples, before its checkpoint
    before = (split / "rollouts" / "step_4.jsonl").read_text()
    run_job(config(tmp_path, "split", *SAMPLES))  # resumes step 2, computes 3 and 4 again
    for name in ("step_2.jsonl", "step_4.jsonl", "eval_step_2.jsonl", "eval_step_4.jsonl"):
        assert (split / "rollouts" / name).read_text() == (run_dir / "rollouts" / name).read_text(), name
    assert (split / "rollouts" / "step_4.jsonl").read_text() == before
    assert sorted(p.name for p in (split / "rollouts").iterdir()) == sorted(
        p.name for p in (run_dir / "rollouts").iterdir()
    )  # no temp file left behind


def test_records_carry_reward_parts_and_no_advantage_for_a_group_not_trained_on():
    """Dynamic sampling: a refused group's samples are in the file (kept: false, advantage null); a summed reward's
    parts and a failed reward's error are kept; each run of image pads (9) is one placeholder."""
    decode = lambda ids, skip_special_tokens: " ".join(str(int(i)) for i in ids)  # noqa: E731
    gen = Generation(torch.tensor([3, 4]), torch.zeros(2), "length")
    parts = RewardResult(1.0, accuracy=1.0, by_function={"geo3k": 0.9, "len": 0.1})
    kept = GeneratedGroup(torch.tensor([1, 9, 9, 9, 2, 9, 9]), [gen, gen], [parts, RewardResult(0.0, error="boom")])
    refused = GeneratedGroup(torch.tensor([1]), [gen, gen], [RewardResult(0.5)] * 2, "B", 7)
    records = sample_records(
        3, [kept, refused], decode, media={9: "<image>"}, advantages={id(kept.generations): [1, -1]}
    )
    assert records[0]["prompt"] == "1<image>2<image>" and records[0]["truncated"] and records[0]["response"] == "3 4"
    assert records[0]["by_function"] == {"geo3k": 0.9, "len": 0.1} and records[0]["accuracy"] == 1.0
    assert records[1]["error"] == "boom" and records[1]["advantage"] == -1 and records[1]["kept"]
    assert [(r["group"], r["kept"], r["advantage"], r["answer"], r["index"]) for r in records[2:]] == [
        (1, False, None, "B", 7)
    ] * 2


@pytest.mark.parametrize(
    "metrics_, warned",
    [
        ({"rollout/zero_adv_group_fraction": 1.0, "rollout/truncated_fraction": 0.0}, ["zero advantage"]),
        ({"rollout/zero_adv_group_fraction": 0.75, "rollout/truncated_fraction": 0.5}, []),
        ({"rollout/zero_adv_group_fraction": 0.0, "rollout/truncated_fraction": 0.75}, ["max_response_len=32"]),
        ({"rollout/zero_adv_group_fraction": 1.0, "rollout/truncated_fraction": 1.0}, ["zero", "max_response_len"]),
    ],
)
def test_warnings_when_a_step_cannot_teach(caplog, metrics_, warned):
    with caplog.at_level(logging.WARNING, logger="miles_vl"):
        warn_if_stuck(7, metrics_, max_response_len=32)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == len(warned)
    for message, words in zip(messages, warned, strict=True):
        assert message.startswith("step 7: ") and words in message


def test_the_job_warns_when_most_responses_are_truncated(straight):
    """The tiny job's random model mostly runs to max_response_len: the warning follows the step's metric."""
    run_dir, logged = straight
    for record in metrics(run_dir):
        if record["step"] == 0:
            continue
        truncated = f"step {record['step']}: {100 * record['rollout/truncated_fraction']:.0f}% of the responses hit"
        assert (truncated in logged) == (record["rollout/truncated_fraction"] > 0.5)


def test_progress_line_shows_the_latest_eval_accuracy():
    out = io.StringIO()
    progress = Progress(30, 0, console=Console(file=out, width=200))
    progress.update({"step": 1, "reward/mean": 0.5})
    progress.update({"step": 2, "reward/mean": 0.5, "eval/accuracy": 0.8333, "eval/reward_mean": 0.9})
    progress.update({"step": 3, "reward/mean": 0.5})
    progress.update({"step": 4, "reward/mean": 0.5, "eval/reward_mean": 0.25})  # no accuracy: the reward, labelled
    progress.close()
    lines = out.getvalue().splitlines()
    assert "eval" not in lines[0]
    assert lines[1].endswith("eval 0.833@step 2") and lines[2].endswith("eval 0.833@step 2")
    assert lines[3].endswith("eval reward 0.25@step 4")
