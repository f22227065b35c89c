"""Contract of the format warm-up (`train.format_warmup_steps`, orchestration/warmup.py): it teaches the answer
format and nothing about the images.

- Every target is `<think></think>\\boxed{a}` + EOS, which the geo3k reward scores as well-formatted, with `a` one
  of the training answers.
- The targets do not depend on the prompts they are paired with: the same job with blank images and the answers
  shuffled between rows trains on exactly the same response ids, and a target's answer agrees with its prompt's
  true answer at chance rate (1/4 on polygon_colour).
- The data cursor does not move (RL sees the same data order with or without a warm-up), and the weights are synced
  once, labelled step-0, before the eval that is logged as step 0.
- `train.format_warmup_lr` is the lr of the warm-up steps only: RL gets `train.optimizer.lr` back; unset, the lr
  is never touched.
- A warm-up step is the RL train step with advantage 1: it raises the targets' logprobs (plain SFT). Its samples
  carry the prompts' images and videos.
- Through the real driver loop, the step-0 record holds the warm-up and the eval, and RL step 1 follows.
"""

import random
from types import SimpleNamespace

import pytest
import torch

from miles_vl.config import load_config
from miles_vl.data import build_datasets, load_processor
from miles_vl.data.records import PromptRow
from miles_vl.models.qwen3_vl.tokens import special_tokens
from miles_vl.orchestration import run_job
from miles_vl.orchestration.factories import build_torch
from miles_vl.orchestration.warmup import format_warmup, warmup_samples, warmup_targets
from miles_vl.reward import RewardSample, geo3k_reward
from miles_vl.reward.math_answer import extract_last_boxed
from miles_vl.train import train_step
from tests.orchestration.jobs import PIXELS, REPO, metrics, tiny_job


@pytest.fixture(scope="module")
def processor():
    return load_processor("offline", *PIXELS)


def job_config(*overrides: str):
    return load_config(
        REPO / "configs" / "geo3k_tiny_cpu.yaml",
        ["data.synthetic_n=64", "data.synthetic_task=polygon_colour", *overrides],
    )


class ServedLog:
    """A train set that records which rows it encodes (the warm-up must not move its cursor)."""

    def __init__(self, dataset):
        self.dataset, self.served = dataset, []
        self.rows = dataset.rows

    def __getitem__(self, i):
        self.served.append(i)
        return self.dataset[i]


def fake_job(cfg, processor, dataset):
    calls = SimpleNamespace(train=[], sync=[], events=[])
    job = SimpleNamespace(
        cfg=cfg,
        train_set=ServedLog(dataset),
        processor=processor,
        tokens=special_tokens(processor),
        trainer=SimpleNamespace(
            train=lambda samples: calls.train.append(samples) or calls.events.append("train") or {},
            set_lr=lambda lr: calls.events.append(lr),
            set_vision_trainable=lambda on: calls.events.append(f"vision {'on' if on else 'off'}"),
        ),
        rollout=SimpleNamespace(sync_weights=calls.sync.append),
        evaluate=lambda step: {"eval/accuracy": 0.25},
    )
    return job, calls


def test_targets_are_well_formatted_training_answers():
    pool = ["3", "4", "5", "6"]
    targets = warmup_targets(200, pool, random.Random(0))
    assert targets == warmup_targets(200, pool, random.Random(0))
    for t in targets:
        result = geo3k_reward(RewardSample(t, label=t[len("<think></think>\\boxed{") : -1]))
        assert result.format == 1.0 and result.accuracy == 1.0
    assert {t[-2] for t in targets} == set("3456")
    with pytest.raises(ValueError, match="at least one training answer"):
        warmup_targets(1, [], random.Random(0))


def test_warmup_targets_ignore_the_image_and_the_answer_of_their_prompt(processor):
    cfg = job_config("train.format_warmup_steps=3", "rollout.batch_size=4", "rollout.n_samples_per_prompt=4")
    real = build_datasets(cfg.data, processor, seed=cfg.seed).train
    cursor = real.state_dict()
    job, calls = fake_job(cfg, processor, real)
    record = format_warmup(job)
    assert record.pop("time/warmup_s") > 0 and record == {"step": 0, "warmup/steps": 3.0, "eval/accuracy": 0.25}
    assert real.state_dict() == cursor and calls.sync == ["step-0"] and len(calls.train) == 3

    # The same rows with blank images and the answers shuffled between them: the same warm-up, token for token.
    blank_cfg = job_config(
        "train.format_warmup_steps=3",
        "rollout.batch_size=4",
        "rollout.n_samples_per_prompt=4",
        "data.blank_images=true",
    )
    blank = build_datasets(blank_cfg.data, processor, seed=cfg.seed).train
    labels = [r.label for r in blank.rows]
    random.Random(1).shuffle(labels)
    assert labels != [r.label for r in blank.rows]
    blank.rows = [PromptRow(**{**vars(r), "label": a}) for r, a in zip(blank.rows, labels, strict=True)]
    blank_job, blank_calls = fake_job(blank_cfg, processor, blank)
    format_warmup(blank_job)
    assert torch.equal(blank_calls.train[0][0].pixel_values, torch.ones_like(blank_calls.train[0][0].pixel_values))
    for step, blank_step in zip(calls.train, blank_calls.train, strict=True):
        assert [s.input_ids.tolist() for s in step] == [s.input_ids.tolist() for s in blank_step]
        assert all(s.advantage == 1.0 for s in step)
    text = processor.tokenizer.decode(calls.train[0][0].input_ids[calls.train[0][0].prompt_len :])
    assert text.startswith("<think></think>\\boxed{") and text.endswith("}<|im_end|>")


def test_warmup_answers_agree_with_the_prompt_at_chance(processor):
    """2000 (prompt, target) pairs: a target names its prompt's true answer 1/4 of the time (3 sigma ~ 0.03)."""
    cfg = job_config("train.format_warmup_steps=25", "rollout.batch_size=8", "rollout.n_samples_per_prompt=10")
    dataset = build_datasets(cfg.data, processor, seed=cfg.seed).train
    dataset.encoder = SimpleNamespace(  # no pixels needed: only the pairing of prompts and targets is checked
        encode=lambda row: SimpleNamespace(
            prompt_ids=torch.tensor([1]),
            image_grid_thw=None,
            pixel_values=None,
            video_grid_thw=None,
            pixel_values_videos=None,
        )
    )
    job, calls = fake_job(cfg, processor, dataset)
    format_warmup(job)
    n = cfg.rollout.n_samples_per_prompt
    true = [dataset.rows[i].label for i in job.train_set.served for _ in range(n)]
    said = [
        extract_last_boxed(processor.tokenizer.decode(s.input_ids[s.prompt_len :])) for st in calls.train for s in st
    ]
    assert len(said) == 2000 and set(said) == set("ABCD")
    assert abs(sum(a == b for a, b in zip(true, said, strict=True)) / len(said) - 0.25) < 0.035


def test_warmup_samples_carry_the_prompts_videos(processor):
    """A video prompt's warm-up sample carries its video and grid (its prompt ids hold video pads the trainer must
    fill), like its images: the warm-up (issue 16) met the video prompts (issue 18) in a merge."""
    prompt = SimpleNamespace(
        prompt_ids=torch.tensor([1, 2, 3]),
        image_grid_thw=None,
        pixel_values=None,
        video_grid_thw=torch.tensor([[2, 4, 4]]),
        pixel_values_videos=torch.rand(32, 1536),  # [2*4*4 patches, C*T*P*P]
    )
    (sample,) = warmup_samples([prompt], ["<think></think>\\boxed{A}"], processor.tokenizer, 0)
    assert sample.pixel_values_videos is prompt.pixel_values_videos and sample.video_grid_thw is prompt.video_grid_thw
    assert sample.pixel_values is None and sample.image_grid_thw is None and sample.prompt_len == 3


def test_the_warmup_lr_holds_for_the_warmup_steps_only(processor):
    overrides = ("train.format_warmup_steps=2", "train.optimizer.lr=1e-4")
    cfg = job_config(*overrides, "train.format_warmup_lr=3e-3")
    job, calls = fake_job(cfg, processor, build_datasets(cfg.data, processor, seed=cfg.seed).train)
    format_warmup(job)
    assert calls.events == [3e-3, "vision off", "train", "train", "vision on", 1e-4]
    cfg = job_config(*overrides)
    job, calls = fake_job(cfg, processor, build_datasets(cfg.data, processor, seed=cfg.seed).train)
    format_warmup(job)
    assert calls.events == ["vision off", "train", "train", "vision on"]  # the tower trains again before the sync


def test_torch_backend_set_lr_sets_the_peak_lr_under_the_lr_warmup(processor):
    """optimizer.warmup_steps=4: step k (0-based) runs at lr * (k+1)/4; set_lr changes lr and keeps the factor."""
    tokens = special_tokens(processor)
    cfg = job_config("train.optimizer.lr=1e-3", "train.optimizer.warmup_steps=4")
    backend = build_torch(cfg, tokens)
    options = backend.options
    dataset = build_datasets(job_config().data, processor, seed=0).train
    samples = warmup_samples([dataset[0]], ["<think></think>\\boxed{A}"], processor.tokenizer, tokens.eos_token_ids[0])
    backend.set_lr(1e-2)
    assert backend.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 / 4) == backend.lr()
    assert train_step(backend, samples)["train/lr"] == pytest.approx(1e-2 * 2 / 4)  # after the step: the next one's
    backend.set_lr(1e-4)
    assert backend.optimizer.param_groups[0]["lr"] == pytest.approx(1e-4 * 2 / 4) == backend.lr()
    assert backend.options.optimizer.lr == 1e-4 and backend.options.optimizer.warmup_steps == 4
    assert options.optimizer.lr == cfg.train.optimizer.lr == 1e-3  # the options it was built with are not changed


def test_torch_backend_holds_the_vision_tower_while_it_is_not_trainable(processor):
    """set_vision_trainable(False): a step moves the language model and leaves every `model.visual` tensor (tower,
    merger, deepstack mergers) and its optimizer state as they were; True: the tower trains again, and its weights
    are exported again. Under freeze_vision the call changes nothing."""
    tokens = special_tokens(processor)
    dataset = build_datasets(job_config().data, processor, seed=0).train
    samples = warmup_samples([dataset[i] for i in range(2)], ["<think></think>\\boxed{A}"] * 2, processor.tokenizer,
                             tokens.eos_token_ids[0])  # fmt: skip
    backend = build_torch(job_config("train.optimizer.lr=1e-2"), tokens)

    def snapshot(prefix):
        return {n: p.detach().clone() for n, p in backend.model.named_parameters() if n.startswith(prefix)}

    vision, language = snapshot("model.visual."), snapshot("model.language_model.")
    assert vision and language
    backend.set_vision_trainable(False)
    train_step(backend, samples)
    assert all(torch.equal(p, vision[n]) for n, p in snapshot("model.visual.").items())
    assert any(not torch.equal(p, language[n]) for n, p in snapshot("model.language_model.").items())
    assert not any(backend.optimizer.state.get(p) for n, p in backend.model.named_parameters() if n in vision)
    assert not {n for n, _ in backend.export_weights()} & set(vision)
    backend.set_vision_trainable(True)
    train_step(backend, samples)
    assert any(not torch.equal(p, vision[n]) for n, p in snapshot("model.visual.").items())
    assert set(vision) <= {n for n, _ in backend.export_weights()}

    frozen = build_torch(job_config("train.freeze_vision=true"), tokens)
    frozen.set_vision_trainable(True)
    assert not any(p.requires_grad for p in frozen.model.model.visual.parameters())


def test_a_warmup_step_is_sft(processor):
    cfg = job_config("train.optimizer.lr=1e-2")
    tokens = special_tokens(processor)
    backend = build_torch(cfg, tokens)
    dataset = build_datasets(cfg.data, processor, seed=cfg.seed).train
    prompts = [dataset[i] for i in range(4)]
    samples = warmup_samples(
        prompts, warmup_targets(4, ["3", "4"], random.Random(0)), processor.tokenizer, tokens.eos_token_ids[0]
    )
    before = torch.cat(backend.compute_logprobs(samples)).mean()
    for _ in range(3):
        train_step(backend, samples)
    assert torch.cat(backend.compute_logprobs(samples)).mean() > before + 1.0


def test_the_driver_logs_the_warmup_as_step_0(tmp_path, caplog):
    """... and says in its log when the warm-up starts and ends (a new user saw 32 s without a line)."""
    cfg = tiny_job(
        tmp_path,
        "warm",
        "num_steps=1",
        "train.format_warmup_steps=2",
        "data.synthetic_task=polygon_colour",
        "reward.name=geo3k",
        "eval.interval=1",
    )
    with caplog.at_level("INFO", logger="miles_vl.orchestration.warmup"):
        records = metrics(run_job(cfg))
    said = [r.getMessage() for r in caplog.records if r.name == "miles_vl.orchestration.warmup"]
    assert said[0].startswith("format warm-up: 2 supervised steps of") and said[1].startswith(
        "format warm-up: 2 steps in"
    )
    assert [r["step"] for r in records] == [0, 1]
    assert records[0]["warmup/steps"] == 2.0 and "eval/accuracy" in records[0]
    assert "reward/mean" not in records[0] and "eval/accuracy" in records[1]
