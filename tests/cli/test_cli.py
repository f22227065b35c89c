"""Contract: `miles-vl check` prints the resolved config (exit 0) or every problem (exit 2);
`--version` and `--help` work without a config."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from miles_vl import __version__
from miles_vl.cli import main
from tests.disks import with_tmpfs

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
    ["duplicate-key", "parquet-is-text", "jsonl-not-utf8", "reward-missing", "checkpoint-broken", "reward-weight-1e39"],
)
def test_bad_input_exits_2_with_one_message_before_ray(tmp_path, capsys, case):
    """Issue 15.15: each bad input gets one message naming the file (and line), exit status 2, and no traceback,
    before Ray starts. Issue 30.9: a reward weight of 1e39 passed and killed the job at step 1."""
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
    elif case == "reward-weight-1e39":
        overrides = ["reward.name=null", "reward.functions=[{name: geo3k, weight: 1e39}]"]
        expected = "'reward.functions': reward.functions.0.weight=1e+39: the weights' magnitudes sum to 1e+39, expected"
    code = main(["train", config, f"logging.output_dir={tmp_path / 'runs'}", "logging.wandb.mode=disabled", *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    assert not ray.is_initialized()
    error = err[err.index("error: ") :]  # after the log lines of what loaded fine
    assert expected in " ".join(error.split())
    assert "Traceback" not in err


def test_a_yaml_alias_bomb_is_refused_at_once_with_one_message(tmp_path):
    """Issue 30.13: nine levels of nine aliases (the "billion laughs", 9^9 strings from a 16-line file) kept `miles-vl
    check` busy for over 5 minutes at 3.2 GB. Refused while the file is parsed, naming the file, the alias's line and
    the bound; the timeout ends the run that would expand it."""
    from tests.config.test_hostile_config import MINIMAL, nested_aliases

    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(MINIMAL + "reward:\n  kwargs:\n" + nested_aliases(9, 9, indent="    "))
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "miles_vl.cli", "check", "--config-only", str(bomb)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert time.monotonic() - start < 5, run.stderr
    assert run.returncode == 2, run.stderr
    # a0 .. a3 stand for 10, 91, 820 and 7381 nodes; the aliases in a1 .. a3 add 8289, a4's first *a3 makes it 15670
    assert run.stderr.splitlines() == [
        f"error: invalid config {bomb} (1 problem):",
        "  - YAML aliases would add more than 10000 nodes (the alias *a3 at line 12 brings them to 15670; a config "
        "needs at most a few hundred): write the repeated parts out, or use fewer aliases",
    ]


@pytest.mark.parametrize(
    "argv, level",
    [
        (["check", "--config-only", TINY], "INFO"),  # the config's logging.level default
        (["check", "--config-only", TINY, "logging.level=WARNING"], "WARNING"),  # the config's, read
        (["--log-level", "debug", "check", "--config-only", TINY, "logging.level=WARNING"], "DEBUG"),  # before
        (["check", "--config-only", TINY, "logging.level=WARNING", "--log-level", "DEBUG"], "DEBUG"),  # after
        (["check", "--config-only", TINY, "--log-level", "ERROR", "num_steps=7"], "ERROR"),  # overrides go on
    ],
)
def test_log_level_before_or_after_the_subcommand_and_from_the_config(capsys, argv, level):
    """Issue 16: `--log-level` was refused after the subcommand, and `logging.level` was never read. The command
    line wins over the config; overrides may follow the option."""
    import logging

    assert main(argv) == 0
    assert logging.getLevelName(logging.getLogger().level) == level
    if "num_steps=7" in argv:
        assert yaml.safe_load(capsys.readouterr().out)["num_steps"] == 7


def test_data_inspect_takes_the_file_before_or_after_the_config(tmp_path, capsys):
    """Issue 16: `data inspect --config CFG FILE` took FILE for an override and failed; both orders now give the same
    report, with the config's overrides applied."""
    data = tmp_path / "synth.parquet"
    assert main(["data", "synth", str(data), "--n", "3"]) == 0
    capsys.readouterr()
    outputs = []
    for argv in (
        ["data", "inspect", str(data), "--config", TINY, "data.max_prompt_len=300"],
        ["data", "inspect", "--config", TINY, str(data), "data.max_prompt_len=300"],
        ["data", "inspect", "--config", TINY, "data.max_prompt_len=300", str(data)],
    ):
        assert main(argv) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] == outputs[2]
    assert f"file: {data}" in outputs[0] and "max_prompt_len 300" in outputs[0]
    assert main(["data", "inspect", "--config", TINY, "data.max_prompt_len=300"]) == 2
    assert "data inspect takes one dataset file (found none)" in capsys.readouterr().err


def dry_run_problems(tmp_path: Path) -> tuple[list[str], list[str]]:
    """Overrides with one problem in every part `check` looks at, and a phrase of each expected message."""
    (tmp_path / "broken.parquet").write_text("not parquet")
    (tmp_path / "columns.jsonl").write_text('{"question": "x", "answer": "1"}\n')
    (tmp_path / "no_weights").mkdir()
    (tmp_path / "no_weights" / "config.json").write_text("{}")
    overrides = [
        f"logging.output_dir={tmp_path / 'runs'}",
        "reward.name=no_such_reward_module:score",
        "data.dataset_fn=no_such_data_module:row",
        "data.synthetic_n=0",
        f"data.train_path={tmp_path / 'missing.parquet'}",
        f"data.eval_path={tmp_path / 'broken.parquet'}",
        "model.init=pretrained",
        f"model.path={tmp_path / 'no_model'}",
        f"checkpoint.resume={tmp_path / 'ckpt' / 'step_00000002'}",
        "checkpoint.dir=/proc/miles_vl_checkpoints",
    ]
    expected = [
        "reward.name='no_such_reward_module:score'",
        "module 'no_such_reward_module' not found",
        "data.dataset_fn='no_such_data_module:row': cannot import 'no_such_data_module'",
        f"data.train_path: dataset file not found: {tmp_path / 'missing.parquet'}",
        f"data.eval_path: {tmp_path / 'broken.parquet'}: cannot read it as parquet",
        f"model.path='{tmp_path / 'no_model'}': no such directory, and not a hub id (owner/name)",
        f"checkpoint.resume='{tmp_path / 'ckpt' / 'step_00000002'}' is not a checkpoint directory (no driver.json)",
        "checkpoint.dir: the job writes /proc/miles_vl_checkpoints, but a directory cannot be created in /proc",
    ]
    return overrides, expected


@pytest.mark.parametrize("command", ["check", "train"])
def test_check_and_train_report_every_problem_of_the_machine_at_once_and_create_nothing(tmp_path, capsys, command):
    """Issue 16: `check` only validated the config; a missing data file, reward module or model directory surfaced
    one at a time when `train` reached it. Now both commands run the same dry run first: every problem at once, each
    with its fix, exit 2, no traceback, no run directory, no Ray."""
    import ray

    overrides, expected = dry_run_problems(tmp_path)
    assert main([command, TINY, *overrides]) == 2
    captured = capsys.readouterr()
    err = " ".join(captured.err.split())
    for phrase in expected:
        assert phrase in err, phrase
    assert "Traceback" not in err and captured.out == ""
    assert not (tmp_path / "runs").exists()
    assert not ray.is_initialized()
    config_only = (
        "validate the config without them (on a laptop, before sending it to the cluster): "
        f"miles-vl check --config-only {TINY} with the same overrides"
    )
    assert (config_only in err) == (command == "check")  # `check` says how to check the config alone


def test_check_tests_that_the_run_and_checkpoint_directories_can_be_written_and_leaves_nothing(tmp_path, capsys):
    """Issue 30.9: `check` passed a job whose output directory could not be written; `train` then failed after
    loading everything. Now the run directory and the checkpoint directory are probed (a directory made and removed
    where they will be, or in the nearest parent that exists): a place that cannot be written is named with the key
    to change, and a writable one is left as it was."""
    runs, ckpt = tmp_path / "new" / "runs", tmp_path / "ckpt"
    ckpt.mkdir()
    assert main(["check", TINY, f"logging.output_dir={runs}", f"checkpoint.dir={ckpt}"]) == 0
    assert [p.name for p in tmp_path.rglob("*")] == ["ckpt"]  # nothing made, nothing left
    capsys.readouterr()
    assert main(["check", TINY, "logging.output_dir=/proc/miles_vl_runs", "logging.run_name=job"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert (
        "logging.output_dir: the job writes /proc/miles_vl_runs/job, but a directory cannot be created in /proc "
        "(No such file or directory); point logging.output_dir (or logging.run_name) at a writable place" in err
    )
    assert err.count("a directory cannot be created in /proc") == 1  # <run dir>/checkpoints: the same place


def test_check_names_a_read_only_output_directory(tmp_path):
    """Issue 30.9, on a real read-only file system: the message names the place and the reason."""
    cmd = [sys.executable, "-m", "miles_vl.cli", "check", TINY, f"logging.output_dir={tmp_path / 'ro' / 'runs'}"]
    done = with_tmpfs(tmp_path / "ro", cmd, read_only=True, env=dict(os.environ, COLUMNS="300"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"a directory cannot be created in {tmp_path / 'ro'} (Read-only file system)" in done.stderr


def test_check_names_a_model_directory_without_weights_and_a_data_file_without_the_columns(tmp_path, capsys):
    (tmp_path / "rows.jsonl").write_text('{"question": "x", "answer": "1"}\n')
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    argv = ["check", TINY, "data.synthetic_n=0", f"data.train_path={tmp_path / 'rows.jsonl'}"]
    argv += ["model.init=pretrained", f"model.path={tmp_path / 'ckpt'}", "model.processor=offline"]
    assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"model.path='{tmp_path / 'ckpt'}': {tmp_path / 'ckpt'} has no weights (*.safetensors or *.bin)" in err
    assert "data.train_path: " in err and "no prompt column 'problem'" in err


def test_check_config_only_skips_the_machine(tmp_path, capsys):
    overrides, _ = dry_run_problems(tmp_path)
    assert main(["check", "--config-only", TINY, *overrides]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["reward"]["name"] == "no_such_reward_module:score"


def test_check_names_each_missing_backend_package_with_its_fix(monkeypatch, capsys):
    """The packages of the chosen backends must import; one line each, naming the backend, the fix and the fallback.
    A package that fails only because another listed one is missing is not repeated."""
    from miles_vl import stack

    te = stack.Package("fake-te", "no_such_te_xyz", "train.backend=megatron", "layers", "pip install fake-te")
    bridge = stack.Package("fake-bridge", "tests.cli.needs_fake_te", "train.backend=megatron", "bridge", "pip b")
    monkeypatch.setattr(stack, "PACKAGES", (*stack.PACKAGES[:4], te, bridge))
    assert stack.backend_problems("hf", "torch") == []
    problems = stack.backend_problems("hf", "megatron")
    assert problems == [
        "train.backend=megatron needs fake-te (layers), which does not import here: ModuleNotFoundError: No module "
        "named 'no_such_te_xyz'; pip install fake-te, or set train.backend=torch"
    ]


def test_configs_lists_prints_and_copies_the_shipped_configs(tmp_path, capsys):
    """Issue 16: the configs did not ship with the package; `miles-vl configs` lists them and copies one."""
    shipped = sorted(p.stem for p in (REPO / "configs").glob("*.yaml"))
    assert main(["configs"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line and not line.startswith("(")]
    assert listed == shipped
    assert main(["configs", "geo3k_tiny_cpu"]) == 0
    assert capsys.readouterr().out == Path(TINY).read_text()
    dest = tmp_path / "jobs" / "my_job.yaml"
    assert main(["configs", "geo3k_tiny_cpu.yaml", str(dest)]) == 0
    assert dest.read_text() == Path(TINY).read_text() and capsys.readouterr().out.strip() == str(dest)
    assert main(["configs", "geo3k_tiny_cpu", str(dest)]) == 2  # never overwrites unasked
    assert "exists; choose another path, or --force" in capsys.readouterr().err
    assert main(["configs", "geo3k_tiny_cpu", str(tmp_path)]) == 0  # a folder: the config's own name in it
    assert (tmp_path / "geo3k_tiny_cpu.yaml").is_file()
    assert main(["configs", "geo3k_tiny_cpus"]) == 2
    assert "did you mean geo3k_tiny_cpu?" in capsys.readouterr().err


@pytest.mark.slow
def test_the_wheel_ships_the_configs(tmp_path):
    """Build the sdist and, from it, the wheel (setuptools, offline), install the wheel into a folder and run
    `miles-vl configs` from there, away from the checkout: every config of configs/ is in it."""
    import shutil
    import tarfile

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in ("miles_vl", "configs"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    build = "from setuptools import build_meta as b; import sys; print(getattr(b, sys.argv[1])(sys.argv[2]))"
    run = dict(capture_output=True, text=True, check=True, timeout=300)
    sdist = subprocess.run([sys.executable, "-c", build, "build_sdist", str(tmp_path)], cwd=src, **run)
    with tarfile.open(tmp_path / sdist.stdout.split()[-1]) as tar:
        tar.extractall(tmp_path / "sdist", filter="data")
    [unpacked] = (tmp_path / "sdist").iterdir()
    wheel = subprocess.run([sys.executable, "-c", build, "build_wheel", str(tmp_path)], cwd=unpacked, **run)
    wheel_path = tmp_path / wheel.stdout.split()[-1]
    shipped = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))
    import zipfile

    names = zipfile.ZipFile(wheel_path).namelist()
    assert sorted(n.rsplit("/", 1)[1] for n in names if n.startswith("miles_vl/configs/")) == shipped
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site)]
    subprocess.run([*pip, str(wheel_path)], **run)
    env = {**os.environ, "PYTHONPATH": str(site)}
    cli = [sys.executable, "-m", "miles_vl.cli", "configs"]
    listed = subprocess.run(cli, cwd=tmp_path, env=env, **run).stdout
    assert f"({site / 'miles_vl' / 'configs'})" in listed
    assert sorted(f"{line.split()[0]}.yaml" for line in listed.splitlines() if line and line[0] != "(") == shipped
    subprocess.run([*cli, "geo3k_tiny_cpu", "job.yaml"], cwd=tmp_path, env=env, **run)
    assert (tmp_path / "job.yaml").read_text() == Path(TINY).read_text()


@pytest.mark.parametrize("how", ["console script", "python -m"])
def test_a_stray_module_in_the_working_directory_is_never_imported(tmp_path, how):
    """Issue 30.7: the CLI put the working directory first on sys.path (for `module:function` rewards), so a stray
    math_verify.py there ran instead of the package that the geo3k reward imports; `python -m` puts it first too. The
    working directory now comes after the installed packages: `check` of the geo3k job never imports the stray file,
    and a reward `mymod:reward` that only the working directory holds still resolves."""
    marker = tmp_path / "imported"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "math_verify.py").write_text(f"open({str(marker)!r}, 'w').write('x')\nraise ImportError('stray')\n")
    (cwd / "mymod.py").write_text("def reward(sample):\n    return 1.0\n")
    exe = Path(sys.executable).with_name("miles-vl")
    cli = [str(exe)] if how == "console script" else [sys.executable, "-m", "miles_vl.cli"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    for reward in ("geo3k", "mymod:reward"):
        cmd = [*cli, "check", TINY, f"reward.name={reward}", "logging.wandb.mode=disabled"]
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert not marker.exists(), f"the stray math_verify.py was imported by `{' '.join(cmd)}`"


def test_a_secret_on_the_command_line_is_redacted_in_sys_argv_with_a_warning(monkeypatch, capsys):
    """Issue 30.8: wandb records sys.argv (and uploads it online): a secret override there reached its files. The CLI
    redacts it in sys.argv itself before anything else runs, in every spelling, still runs with the real value, and
    warns once that the command line is visible to other local users, with the way to pass it instead."""
    argv = ["miles-vl", "check", "--config-only", TINY, "rollout.sglang={api_key: s3cret-value, port: 30001}"]
    monkeypatch.setattr(sys, "argv", list(argv))
    assert main() == 0
    assert sys.argv == [*argv[:-1], "rollout.sglang=<redacted>"]
    captured = capsys.readouterr()
    out = yaml.safe_load(captured.out)
    assert out["rollout"]["sglang"]["port"] == 30001  # parsed from the real command line
    assert out["rollout"]["sglang"]["api_key"] == "<redacted>"
    err = " ".join(captured.err.split())
    assert "s3cret-value" not in err
    assert err.count("given on the command line: other users of this machine can read it") == 1
    assert "rollout.sglang.api_key='${oc.env:SGLANG_API_KEY}'" in err
    monkeypatch.setattr(sys, "argv", ["miles-vl", "check", "--config-only", TINY, "rollout.sglang.api_key=${oc.env:K}"])
    monkeypatch.setenv("K", "from-the-environment")
    assert main() == 0
    assert sys.argv[-1] == "rollout.sglang.api_key=${oc.env:K}"
    assert "given on the command line" not in capsys.readouterr().err
