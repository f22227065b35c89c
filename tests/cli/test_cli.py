"""Contract: `miles-vl check` prints the resolved config (exit 0) or every problem (exit 2);
`--version` and `--help` work without a config."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from miles_vl import __version__
from miles_vl.cli import main

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "geo3k_tiny_cpu.yaml")


def test_check_prints_resolved_config_with_overrides(capsys):
    assert main(["check", TINY, "rollout.n_samples_per_prompt=8"]) == 0
    out = yaml.safe_load(capsys.readouterr().out)
    assert out["rollout"]["n_samples_per_prompt"] == 8
    assert out["train"]["optimizer"]["grad_clip"] == 1.0  # a schema default made visible
    assert out["derived"]["samples_per_step"] == out["rollout"]["batch_size"] * 8


def test_check_never_prints_a_secret(capsys):
    """Issue 15.10: `miles-vl check` printed rollout.sglang.api_key in plain text."""
    assert main(["check", TINY, "rollout.sglang.api_key=s3cret-value"]) == 0
    out = capsys.readouterr().out
    assert "s3cret-value" not in out
    assert yaml.safe_load(out)["rollout"]["sglang"]["api_key"] == "<redacted>"


def test_check_reports_errors_with_exit_2(capsys):
    assert main(["check", TINY, "rollout.temprature=0.5", "train.cp=2"]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'rollout.temperature'?" in err
    assert "train.cp=2 needs a backend with model parallelism" in err


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "miles-vl check" in capsys.readouterr().out


def test_version_and_help_from_the_console_script():
    exe = Path(sys.executable).with_name("miles-vl")
    if not exe.exists():
        pytest.fail(f"console script not installed next to {sys.executable}; run `make setup`")
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"miles-vl {__version__}"
    help_text = subprocess.run([str(exe), "--help"], capture_output=True, text=True, check=True).stdout
    for word in ("check", "train", "make run", "key.sub=value"):
        assert word in help_text


def test_report_writes_plots(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "reward/mean": 0.1, "time/step_s": 3.0}\n{"step": 2, "reward/mean": 0.4, "time/step_s": 2.5}\n'
    )
    assert main(["report", str(tmp_path)]) == 0
    written = capsys.readouterr().out.split()
    assert sorted(p.rsplit("/", 1)[-1] for p in written) == ["reward.png", "time.png"]
    assert (tmp_path / "plots" / "reward.png").stat().st_size > 1000


def test_report_on_a_non_run_dir(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 1
    assert "no metrics.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize(
    "case",
    ["duplicate-key", "parquet-is-text", "jsonl-not-utf8", "reward-missing", "checkpoint-broken"],
)
def test_bad_input_exits_2_with_one_message_before_ray(tmp_path, capsys, case):
    """Issue 15.15: each bad input gets one message naming the file (and line), exit status 2, and no traceback,
    before Ray starts."""
    import ray

    config, overrides, expected = TINY, [], ""
    if case == "duplicate-key":
        config = str(tmp_path / "dup.yaml")
        Path(config).write_text(Path(TINY).read_text() + "\nrollout:\n  batch_size: 2\n")
        expected = "key 'rollout' appears twice in one mapping"
    elif case == "parquet-is-text":
        (tmp_path / "train.parquet").write_text("problem,answer\nx,1\n")
        overrides = ["data.synthetic_n=0", f"data.train_path={tmp_path / 'train.parquet'}"]
        expected = f"{tmp_path / 'train.parquet'}: cannot read it as parquet"
    elif case == "jsonl-not-utf8":
        (tmp_path / "train.jsonl").write_bytes(b'{"problem": "x", "answer": "1"}\n{"problem": "\xe9"}\n')
        overrides = ["data.synthetic_n=0", f"data.train_path={tmp_path / 'train.jsonl'}"]
        expected = f"{tmp_path / 'train.jsonl'}:2: not UTF-8 text"
    elif case == "reward-missing":
        overrides = ["reward.name=no_such_module_xyz:score"]
        expected = "module 'no_such_module_xyz' not found"
    elif case == "checkpoint-broken":
        ckpt = tmp_path / "ckpt" / "step_00000001"
        ckpt.mkdir(parents=True)
        (ckpt / "driver.json").write_text('{"step": 1}')
        (ckpt / "manifest.json").write_text('{"files": {"model.safetensors": 1000, "driver.json": 11}}')
        overrides = [f"checkpoint.resume={ckpt}"]
        expected = f"{ckpt / 'model.safetensors'}: missing"
    code = main(["train", config, f"logging.output_dir={tmp_path / 'runs'}", "logging.wandb.mode=disabled", *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    assert not ray.is_initialized()
    error = err[err.index("error: ") :]  # after the log lines of what loaded fine
    assert expected in " ".join(error.split())
    assert "Traceback" not in err
