"""Contract of orchestration/export.py with the torch backend: `miles-vl export` and `checkpoint.save_hf` write a
directory that transformers loads with `from_pretrained`, whose logits equal the trainer's on the same inputs; a bad
run directory, step or output directory gets one message naming what exists, exit 2.

The reference is the trainer itself: the torch backend built from the run's config as the driver builds it, with the
checkpoint loaded through its own `load_checkpoint` (safetensors + optimizer state), not the export path. The
exported model is loaded by transformers' `AutoModelForImageTextToText` from the directory alone (config.json,
sharded safetensors with their index, the processor saved beside them).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from miles_vl import cli
from miles_vl.config import load_config
from miles_vl.data import load_processor
from miles_vl.models.qwen3_vl.tokens import special_tokens
from miles_vl.orchestration import run_job
from miles_vl.orchestration.checkpoint import list_checkpoints
from miles_vl.orchestration.export import ExportError, export_run, save_hf_due
from miles_vl.orchestration.factories import build_torch
from tests.orchestration.jobs import tiny_job

SHARD = 300_000  # bytes: the tiny model (~1.5 MB in fp32) is written in several shards


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    cfg = tiny_job(
        tmp,
        "run",
        "num_steps=2",
        "eval.interval=0",
        "checkpoint.interval=1",
        "checkpoint.save_hf.steps=[1]",
        "checkpoint.save_hf.final=true",
        f"checkpoint.save_hf.max_shard_bytes={SHARD}",
        "train.optimizer.lr=1e-2",  # steps big enough that step 1 and step 2 differ clearly
    )
    return run_job(cfg)


def _trainer_logits(run_dir, step: int, inputs: dict):
    cfg = load_config(run_dir / "config.yaml")
    tokens = special_tokens(load_processor("offline", cfg.data.min_pixels, cfg.data.max_pixels))
    backend = build_torch(cfg, tokens)
    backend.load_checkpoint(dict(list_checkpoints(run_dir / "checkpoints"))[step])
    with torch.no_grad():
        return backend.model(**inputs).logits


def _inputs(processor):
    """One image prompt through the run's processor and chat template."""
    image = torch.randint(0, 255, (3, 64, 80), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is x?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    batch = processor(text=[text], images=[image], return_tensors="pt")
    return dict(batch)  # input_ids, attention_mask, mm_token_type_ids, pixel_values, image_grid_thw


def _exported_logits(directory, inputs: dict):
    model = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(**inputs).logits


def test_export_loads_in_transformers_with_the_trainers_logits(run, tmp_path):
    out = export_run(run, tmp_path / "hf", step=1)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded at max_shard_bytes
    processor = AutoProcessor.from_pretrained(out)  # the processor and chat template travel with the weights
    assert processor.image_processor.size.longest_edge == 12544  # the run's max_pixels, not the processor default
    inputs = _inputs(processor)
    want = _trainer_logits(run, 1, inputs)
    got = _exported_logits(out, inputs)
    assert torch.equal(got, want)  # fp32 weights written as they are: the same bits, the same kernels
    # step 2's weights moved: the export is of the step asked for
    assert not torch.allclose(_trainer_logits(run, 2, inputs), want, atol=1e-4)


def test_save_hf_writes_the_chosen_steps_during_the_run(run, tmp_path):
    """checkpoint.save_hf.steps=[1] and final=true: hf/step_1 and hf/step_2, each equal to the checkpoint's export."""
    assert sorted(p.name for p in (run / "hf").iterdir()) == ["step_00000001", "step_00000002"]
    inputs = _inputs(AutoProcessor.from_pretrained(run / "hf" / "step_00000002"))
    assert torch.equal(_exported_logits(run / "hf" / "step_00000002", inputs), _trainer_logits(run, 2, inputs))
    newest = export_run(run, tmp_path / "newest")  # no --step: the newest checkpoint, step 2
    assert torch.equal(_exported_logits(newest, inputs), _trainer_logits(run, 2, inputs))


def test_save_hf_due():
    assert [s for s in range(1, 8) if save_hf_due(s, [2], 3, True, s == 7)] == [2, 3, 6, 7]
    assert not save_hf_due(0, [], 1, True, True)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["{tmp}/nope", "{tmp}/out"], "is not a run directory (no config.yaml); runs in {tmp}: run"),
        (["{run}", "--step", "5", "{tmp}/out"], "has no checkpoint of step 5; its checkpoints are steps [1, 2]"),
        (["{run}", "{tmp}/full"], "exists and is not empty; choose another directory, or --force"),
    ],
)
def test_bad_run_step_or_output_exit_2_naming_what_exists(run, tmp_path, capsys, argv, message):
    (tmp_path / "run").symlink_to(run)  # a run beside the missing one, for the "runs in" hint
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    fill = dict(tmp=tmp_path, run=tmp_path / "run")
    assert cli.main(["export", *[a.format(**fill) for a in argv]]) == cli.EXIT_CONFIG
    assert message.format(**fill) in capsys.readouterr().err
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine" and not (tmp_path / "out").exists()


def test_force_replaces_a_non_empty_output(run, tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "old.txt").write_text("old")
    with pytest.raises(ExportError):
        export_run(run, tmp_path / "hf", step=2)
    export_run(run, tmp_path / "hf", step=2, force=True, max_shard_bytes=10**9)
    assert not (tmp_path / "hf" / "old.txt").exists() and (tmp_path / "hf" / "model.safetensors").is_file()
    assert not list(tmp_path.glob(".hf.tmp-*"))
