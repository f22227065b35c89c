"""Contract of orchestration/export.py with the torch backend: `miles-vl export` and `checkpoint.save_hf` write a
directory that transformers loads with `from_pretrained`, whose logits equal the trainer's on the same inputs; a bad
run directory, step or output directory gets one message naming what exists, exit 2. `--force` replaces only an
earlier export: never a run, a folder holding one, or anything inside one (issue 30.1, checked as runs of the CLI on
copies of a run, every file compared byte for byte afterwards); stale temporary directories of dead exports go.

The reference is the trainer itself: the torch backend built from the run's config as the driver builds it, with the
checkpoint loaded through its own `load_checkpoint` (safetensors + optimizer state), not the export path. The
exported model is loaded by transformers' `AutoModelForImageTextToText` from the directory alone (config.json,
sharded safetensors with their index, the processor saved beside them).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForImageTextToText, AutoProcessor

from miles_vl import cli
from miles_vl.config import ConfigError, load_config
from miles_vl.data import load_processor
from miles_vl.models.qwen3_vl.tokens import special_tokens
from miles_vl.orchestration import export, run_job
from miles_vl.orchestration.checkpoint import list_checkpoints
from miles_vl.orchestration.export import EXPORT_MARKER, ExportError, export_run, find_checkpoint, save_hf_due
from miles_vl.orchestration.factories import build_torch
from tests.disks import with_tmpfs
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
        (["{run}", "{tmp}/full"], "exists and is not empty; it is not an earlier export (no .miles_vl_export.json)"),
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


def test_force_replaces_an_earlier_export_and_nothing_else(run, tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "old.txt").write_text("old")
    with pytest.raises(ExportError, match="not an earlier export"):
        export_run(run, tmp_path / "hf", step=2, force=True)
    (tmp_path / "hf" / EXPORT_MARKER).write_text("{}")  # as an earlier export leaves it
    with pytest.raises(ExportError, match="or --force to replace this earlier export"):
        export_run(run, tmp_path / "hf", step=2)
    export_run(run, tmp_path / "hf", step=2, force=True, max_shard_bytes=10**9)
    assert not (tmp_path / "hf" / "old.txt").exists() and (tmp_path / "hf" / "model.safetensors").is_file()
    marker = json.loads((tmp_path / "hf" / EXPORT_MARKER).read_text())
    assert marker["step"] == 2 and marker["run_dir"] == str(run.resolve()) and marker["by"] == "miles-vl export"
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left


# ---------------------------------------------------------------------------------------------------------------------
# `miles-vl export` as a user runs it, on copies of the run


def miles_vl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="300")  # rich wraps log lines at the terminal width
    cmd = [sys.executable, "-m", "miles_vl.cli", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("umask", [0o022, 0o077], ids=["umask-022", "umask-077"])
def test_exported_files_are_readable_as_the_users_other_files(run, tmp_path, umask):
    """Issue 35.5: safetensors writes its files 0600, so a model exported for others to load could not be read by
    them. Every file of an export gets the mode of a file written the ordinary way: 0644 under umask 022, 0600 under
    077 (a user who keeps files private keeps this too). The save_hf directories of the run alike."""
    env = dict(os.environ, COLUMNS="300")
    cmd = [sys.executable, "-m", "miles_vl.cli", "export", str(run), str(tmp_path / "out")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, preexec_fn=lambda: os.umask(umask))
    assert done.returncode == 0, done.stderr[-3000:]
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "out").rglob("*") if p.is_file()}
    assert any(name.endswith(".safetensors") for name in modes) and set(modes.values()) == {oct(0o666 & ~umask)}, modes
    ordinary = oct((run / "config.yaml").stat().st_mode & 0o777)  # written by the same process as hf/step_N
    for step in (run / "hf").iterdir():
        assert {oct(p.stat().st_mode & 0o777) for p in step.rglob("*") if p.is_file()} == {ordinary}


def tree(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) under `root`, by relative path."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


@pytest.fixture
def runs(run, tmp_path) -> Path:
    """tmp_path/runs/{r, r2}: two copies of the run (r2 with its checkpoint.save_hf directories, r without); beside
    them a user's folder (plain/), an earlier export (earlier/) and an earlier export that someone put a run into
    (export_with_a_run/)."""
    shutil.copytree(run, tmp_path / "runs" / "r", ignore=shutil.ignore_patterns("hf"))
    shutil.copytree(run, tmp_path / "runs" / "r2")
    shutil.copytree(run / "hf" / "step_00000001", tmp_path / "earlier")  # it holds the marker
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("mine")
    held = tmp_path / "export_with_a_run"
    shutil.copytree(run / "hf" / "step_00000001", held)  # an export: it holds the marker
    shutil.copytree(run, held / "deep" / "r3", ignore=shutil.ignore_patterns("hf"))
    return tmp_path / "runs"


def test_a_run_saved_under_an_earlier_rule_set_is_still_found_but_a_bad_key_is_named(runs):
    """A rule over several keys added since a run started (here: checkpoint.save_hf.steps past num_steps, refused
    since 2026-11-27) does not lock its checkpoints away: `export` reads the run's config.yaml key by key only. A key
    that is not valid on its own is still refused, by name."""
    config = runs / "r" / "config.yaml"
    saved = yaml.safe_load(config.read_text())
    saved["checkpoint"]["save_hf"]["steps"] = [1, 9]  # num_steps=2
    config.write_text(yaml.safe_dump(saved))
    with pytest.raises(ConfigError, match=r"checkpoint.save_hf.steps \[9\] are past"):
        load_config(config)
    cfg, path = find_checkpoint(runs / "r", None)
    assert cfg.checkpoint.save_hf.steps == [1, 9] and path.name == "step_00000002"
    saved["train"]["lr_typo"] = 1
    config.write_text(yaml.safe_dump(saved))
    with pytest.raises(ConfigError, match="unknown key 'train.lr_typo'"):
        find_checkpoint(runs / "r", None)


@pytest.mark.parametrize(
    ("argv", "message"),
    [  # run in tmp_path (below: "{tmp}"); the current-directory case in earlier/, which --force could replace
        (["runs/r", "runs/r", "--force"], "OUT_DIR runs/r is the run directory runs/r; an export never replaces a run"),
        (["runs/r2", "runs", "--force"], "OUT_DIR runs holds the run directory runs/r2"),
        (["runs/r", "runs/r2", "--force"], "runs/r2 belongs to a run (it holds metrics.jsonl); --force never"),
        (["runs/r", "plain", "--force"], "plain is not an earlier export (no .miles_vl_export.json); --force replaces"),
        (["runs/r", "runs/r2/hf/step_00000001", "--force"], "is inside {tmp}/runs/r2, which belongs to a run"),
        (["runs/r", "runs/r/hf_model"], "OUT_DIR runs/r/hf_model is inside the run directory runs/r"),
        (["runs/r", "export_with_a_run", "--force"], "holds export_with_a_run/deep/r3, which belongs to a run"),
        (["../runs/r", ".", "--force"], "OUT_DIR . is the current directory; an export writes a directory of its own"),
        (["runs/r", "/proc/miles_vl_hf"], "OUT_DIR /proc/miles_vl_hf cannot be written: a directory cannot be created"),
        (["runs/r", "hf", "--max-shard-bytes", "-1"], "--max-shard-bytes '-1': expected a whole number of bytes above"),
        (["runs/r", "hf", "--max-shard-bytes", "0"], "--max-shard-bytes '0': expected a whole number of bytes above"),
        (["runs/r", "hf", "--max-shard-bytes", "5GB"], "--max-shard-bytes '5GB': expected a whole number of bytes"),
    ],
    ids=[
        "run-onto-itself",
        "parent-of-runs",
        "another-run",
        "not-an-export",
        "save-hf-dir-inside-a-run",
        "new-dir-inside-the-run",
        "export-holding-a-run",
        "current-directory",
        "proc",
        "shard-negative",
        "shard-zero",
        "shard-not-a-number",
    ],
)
def test_export_refuses_to_write_over_or_into_a_run_and_every_file_stays(runs, argv, message):
    """Issue 30.1: `export runs/r runs/r --force` wrote the model over the run's checkpoints and metrics;
    `export runs/r2 runs --force` deleted every run in runs/. Now every such OUT_DIR is refused, one line, exit 2,
    before Ray starts, and every file under tmp_path is as it was, byte for byte (none added either). Issue 30.9: a
    --max-shard-bytes that is not a whole number above 0 (0 meant the default before) and an OUT_DIR that cannot be
    written are refused the same way."""
    tmp = runs.parent
    before = tree(tmp)
    done = miles_vl("export", *argv, cwd=tmp / "earlier" if argv[1] == "." else tmp)
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message.format(tmp=tmp) in errors[0], done.stderr
    assert "Traceback" not in done.stderr and "Ray" not in done.stderr
    assert tree(tmp) == before


def test_export_refuses_a_processor_that_is_not_the_runs(run, tmp_path):
    """Issue 31.5: with the check of the processor against the run's processor.yaml disabled, every test passed.
    Here the run's model.processor names a copy of the offline processor whose files changed after the run (another
    model's patch size: every image would get other token counts than the run trained on): the export is refused,
    one line naming both records and the fix, exit 2, before Ray starts, and nothing is written."""
    import yaml

    from miles_vl.models.qwen3_vl.processor import OFFLINE_PROCESSOR_DIR

    shutil.copytree(run, tmp_path / "r", ignore=shutil.ignore_patterns("hf"))
    shutil.copytree(OFFLINE_PROCESSOR_DIR, tmp_path / "proc")
    files = json.loads((tmp_path / "proc" / "processor_config.json").read_text())
    assert files["image_processor"]["patch_size"] == 16
    files["image_processor"]["patch_size"] = 14
    (tmp_path / "proc" / "processor_config.json").write_text(json.dumps(files))
    config = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
    assert config["model"]["processor"] == "offline"  # what the run loaded, and recorded in processor.yaml
    config["model"]["processor"] = str(tmp_path / "proc")
    (tmp_path / "r" / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    assert yaml.safe_load((tmp_path / "r" / "processor.yaml").read_text())["patch_size"] == 16
    before = tree(tmp_path)
    done = miles_vl("export", "r", "hf", cwd=tmp_path)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, done.stderr
    assert f"the processor at {tmp_path / 'proc'} is not the one the run recorded in r/processor.yaml" in errors[0]
    assert "'patch_size': 16" in errors[0] and "'patch_size': 14" in errors[0]
    assert errors[0].endswith("restore the run's processor files")
    assert "Traceback" not in done.stderr and "Ray" not in done.stderr
    assert tree(tmp_path) == before


def test_export_refuses_a_read_only_place(runs):
    """Issue 30.9: an OUT_DIR whose parent is read-only (a real read-only file system) is refused before Ray starts."""
    tmp = runs.parent
    cmd = [sys.executable, "-m", "miles_vl.cli", "export", "runs/r", str(tmp / "ro" / "hf")]
    done = with_tmpfs(tmp / "ro", cmd, read_only=True, cwd=tmp)
    assert done.returncode == 2, done.stdout + done.stderr
    want = f"error: OUT_DIR {tmp / 'ro' / 'hf'} cannot be written: a directory cannot be created in {tmp / 'ro'} "
    assert want + "(Read-only file system); choose a place this user can write" in done.stderr


def test_force_replaces_an_earlier_export_and_the_next_export_removes_stale_temp_dirs(runs, run):
    """Issue 30.1: an earlier export (a directory with the marker) is replaced with --force, the runs untouched.
    Issue 30.11: a SIGKILLed export left `.<name>.tmp-<pid>` (the whole model) that nothing removed; the next export
    removes those of dead processes (of its own name, or holding the marker), and keeps one of a process that is
    alive (it may be writing now), any that is not an export's, and another host's (its marker names its host)."""
    tmp = runs.parent
    shutil.copytree(run / "hf" / "step_00000001", tmp / "hf_model")  # an earlier export, moved out of its run
    (tmp / "hf_model" / "old.txt").write_text("from the earlier export")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: no process has this id now
    here, there = socket.gethostname(), socket.gethostname() + "-other-node"
    stale = {
        f".hf_model.tmp-{dead.pid}": None,  # this name's, killed before it wrote its marker
        f".other_model.tmp-{dead.pid}": here,  # another name's, its marker of this host
    }
    kept = {
        f".hf_model.tmp-{os.getpid()}": here,  # a live process's (this test's)
        f".notes.tmp-{dead.pid}": None,  # a dead process's, but neither this name nor the marker: not ours to remove
        # another host's export into this shared folder: its process id means nothing here (found by the review)
        f".third_model.tmp-{dead.pid}": there,
    }
    for name, host in (stale | kept).items():
        (tmp / name).mkdir()
        (tmp / name / "model.safetensors").write_bytes(b"x" * 100_000)
        if host:
            (tmp / name / EXPORT_MARKER).write_text(json.dumps({"host": host}))
    runs_before = tree(runs)
    done = miles_vl("export", "runs/r", "hf_model", "--step", "2", "--force", cwd=tmp)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not (tmp / "hf_model" / "old.txt").exists() and (tmp / "hf_model" / "model.safetensors.index.json").is_file()
    marker = json.loads((tmp / "hf_model" / EXPORT_MARKER).read_text())
    assert marker["step"] == 2 and marker["run_dir"] == str((runs / "r").resolve())
    assert sorted(p.name for p in tmp.iterdir() if p.name.startswith(".")) == sorted(kept)
    assert tree(runs) == runs_before


def test_the_checks_and_the_write_walk_a_symlink_then_dotdot_as_the_kernel_does(runs, monkeypatch):
    """Found by the review of issue 30: `lnk/../runs/r/checkpoints/step_9` with `lnk -> elsewhere/sub` was checked
    where the kernel leads (elsewhere/runs/..., no run: allowed) but written where the text leads once `..` is dropped
    as text (runs/r/checkpoints/step_9: a label planted inside the run). Now both use `write_path`: the export lands
    in elsewhere/ and no file of the runs changes."""
    tmp = runs.parent
    (tmp / "elsewhere" / "sub").mkdir(parents=True)
    (tmp / "lnk").symlink_to(tmp / "elsewhere" / "sub")
    monkeypatch.chdir(tmp)
    out = "lnk/../runs/r/checkpoints/step_00000009"
    assert export.write_path(out) == tmp / "elsewhere" / "runs" / "r" / "checkpoints" / "step_00000009"
    assert export.out_dir_problem(out, "runs/r", force=False) is None  # nothing of a run where the kernel leads
    before = tree(runs)

    class Processor:
        def save_pretrained(self, d):
            (Path(d) / "processor.json").write_text("{}")

    written = export.write_hf_dir(out, lambda d: (d / "config.json").write_text("{}"), Processor(), None, force=False)
    assert written == tmp / "elsewhere" / "runs" / "r" / "checkpoints" / "step_00000009"
    assert (written / "config.json").is_file() and (written / EXPORT_MARKER).is_file()
    assert tree(runs) == before
