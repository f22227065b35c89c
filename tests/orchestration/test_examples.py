"""Contract: the examples are real extension points: the custom dataset mapping and the custom reward are used
by `module:function` path from examples/custom_task.yaml, and that job runs with the tiny CPU setup."""

import json
from pathlib import Path

import ray

from examples.custom_dataset import from_qa_rows
from examples.custom_reward import concise_exact
from miles_vl.cli import main
from miles_vl.reward import RewardSample

REPO = Path(__file__).resolve().parents[2]


def test_custom_reward():
    assert concise_exact(RewardSample("so \\boxed{42}", "42")).overall == 1.0
    assert concise_exact(RewardSample("so \\boxed{41}", "42")).overall == 0.0
    long = "word " * 300 + "\\boxed{42}"
    assert concise_exact(RewardSample(long, "42")).overall == 1 - 101 / 200  # 301 words: 101 over the 200 budget


def test_custom_dataset_mapping_skips_rows_without_solution():
    rows = [json.loads(line) for line in (REPO / "examples/data/qa_rows.jsonl").read_text().splitlines()]
    mapped = [from_qa_rows(r) for r in rows]
    assert sum(m is None for m in mapped) == 1
    assert all(m["problem"].startswith("<image>") and len(m["images"]) == 1 for m in mapped if m)


def test_custom_task_config_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    try:
        code = main(
            [
                "train",
                "examples/custom_task.yaml",
                "num_steps=1",
                f"logging.output_dir={tmp_path}",
                "logging.run_name=custom",
                "logging.progress=false",
                "logging.wandb.mode=disabled",
            ]
        )
    finally:
        ray.shutdown()
    assert code == 0
    (record,) = [json.loads(line) for line in (tmp_path / "custom" / "metrics.jsonl").read_text().splitlines()]
    assert record["rollout/prompts"] == 2 and "reward/accuracy" in record
