"""Fault injection on the embedded job (issue 15, "nothing lost, nothing hung"). The invariant, checked directly:

- a run stopped by SIGINT or SIGTERM in any phase of a step (rollout, train, sync, save) ends with the checkpoint of
  its last completed step, and resumed with the same command it equals the straight run metric for metric, weights
  and optimizer state included;
- no checkpoint that existed before a stop or a resume is changed (byte for byte), and no file of the run is
  truncated (each only grows);
- an engine killed in any phase (release, train, resume, sync) is replaced, re-synced, and the run equals the
  straight one;
- a broken newest checkpoint is skipped with the run still equal to the straight one; a start that would reuse
  another run's directory, or save a newer state under an older label, is refused before Ray starts.

Signals are real: the test sends them to its own process from inside the phase (a wrapper around the method that
runs it), so they arrive at a known point; one test sends SIGTERM from outside to a `miles-vl train` process.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import torch
import yaml
from safetensors.torch import load_file

from miles_vl.data import build_datasets, load_processor
from miles_vl.orchestration import run_job
from miles_vl.orchestration.checkpoint import CheckpointError, DiskFullError, list_checkpoints
from miles_vl.orchestration.engines import RolloutEngines
from miles_vl.orchestration.factories import TRAIN_BACKENDS, Hooks
from miles_vl.orchestration.loop import JobInterrupted, check_start
from miles_vl.orchestration.trainer import Trainer
from tests.disks import with_tmpfs
from tests.metrics.test_tensorboard import read_events, scalars
from tests.orchestration.jobs import (
    REPO,
    build_torch_failing_save,
    build_torch_gated_save,
    metrics,
    tiny_job,
    wait_for,
)
from tests.procs import kill_actor

STEPS = 5
# saves at 2, 4 and the final 5, nothing pruned; one reward worker (the test rewards are instant)
BASE = ("checkpoint.interval=2", "checkpoint.keep_last=10", "reward.num_workers=1")
SECRET = "s3cret-token-4242"
ENGINE_COUNTERS = ("rollout/engine_restarts", "rollout/weight_resyncs")


def config(tmp_path: Path, name: str, *overrides: str):
    return tiny_job(tmp_path, name, f"num_steps={STEPS}", *BASE, *overrides)


def comparable(record: dict, drop: tuple[str, ...] = ()) -> dict:
    """Everything but wall-clock figures (and `drop`)."""
    return {k: v for k, v in record.items() if not k.startswith(("time/", "perf/")) and k not in drop}


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The reference: 5 steps in one go (with an API key set and wandb offline: `test_secrets_never_reach_a_file`)."""
    secret = (f"rollout.sglang.api_key={SECRET}", "logging.wandb.mode=offline")
    return run_job(config(tmp_path_factory.mktemp("straight"), "straight", *secret))


def copy_of(straight: Path, dest: Path, steps: int) -> Path:
    """A run directory as a run of `steps` steps of the straight one leaves it (a deterministic run: the same files),
    made by copying, to start from there without running those steps again."""
    shutil.copytree(straight, dest, ignore=shutil.ignore_patterns("wandb", "plots"))
    for s, path in list_checkpoints(dest / "checkpoints"):
        if s > steps:
            shutil.rmtree(path)
    rows = (dest / "metrics.jsonl").read_text().splitlines(keepends=True)
    (dest / "metrics.jsonl").write_text("".join(rows[:steps]))
    return dest


# ---------------------------------------------------------------------------------------------------------------------
# helpers


def snapshot(run_dir: Path) -> dict[Path, bytes]:
    """Every file of a run (plots are drawn again at the end of each run and left out)."""
    return {
        p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and "plots" not in p.parts
    }


def assert_nothing_lost(before: dict[Path, bytes], run_dir: Path) -> None:
    """Checkpoint files are unchanged byte for byte; every other file only grew (its old bytes are a prefix), or,
    for a config.yaml/processor.yaml that the new start differs from, is kept whole beside it (`config.<time>.yaml`).
    """
    for rel, old in before.items():
        path = run_dir / rel
        assert path.is_file(), f"{rel} is gone"
        new = path.read_bytes()
        if rel.parts[0] == "checkpoints":
            assert new == old, f"checkpoint file {rel} changed"
        elif not new.startswith(old):
            kept = [p for p in path.parent.glob(f"{path.stem}.*{path.suffix}") if p.read_bytes() == old]
            assert kept, f"{rel} was truncated or rewritten"


def assert_same_state(a: Path, b: Path) -> None:
    """Two checkpoint directories hold the same weights and the same optimizer state, exactly."""
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa), f"weights differ: {a} vs {b}"
    oa = torch.load(a / "trainer_state.pt", weights_only=True)["optimizer"]["state"]
    ob = torch.load(b / "trainer_state.pt", weights_only=True)["optimizer"]["state"]
    assert oa.keys() == ob.keys()
    for k in oa:
        assert all(torch.equal(oa[k][n], ob[k][n]) for n in ("exp_avg", "exp_avg_sq")), f"optimizer differs: {a}"


def signal_during(monkeypatch, cls, method: str, call: int, signum: int) -> None:
    """Send `signum` to this process at the start of the `call`-th call of `cls.method` (counted from now)."""
    original = getattr(cls, method)
    seen = [0]

    def wrapper(self, *args, **kwargs):
        seen[0] += 1
        if seen[0] == call:
            os.kill(os.getpid(), signum)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, method, wrapper)


# (phase, the method that runs it, which call of it in the segment, the step the segment's checkpoint holds)
#   rollout: generate #2 is step 2's rollout (step 1 ran first): the step is abandoned, step 1 is saved
#   train:   the first train after resuming from 1 is step 2's: it finishes (eval, log, the periodic save of 2)
#   sync:    sync_weights #1 is the restore's, #2 is step 3's: step 3 finishes and is saved
#   save:    the first start_checkpoint after resuming from 3 is step 4's periodic one (written in the background):
#            the stop waits for it, it completes, nothing after it
CHAIN = [
    ("rollout", RolloutEngines, "generate", 2, 1),
    ("train", Trainer, "train", 1, 2),
    ("sync", RolloutEngines, "sync_weights", 2, 3),
    ("save", Trainer, "start_checkpoint", 1, 4),
]


def test_stopped_in_every_phase_and_resumed_equals_the_straight_run(tmp_path, monkeypatch, straight):
    """Issue 15.1: Ctrl-C saved a half-advanced state over a good checkpoint (4 prompts skipped, 15 metrics off after
    resume) and SIGTERM saved nothing. Four stops, one per phase, SIGTERM and SIGINT in turn (SIGINT in training and
    SIGTERM from outside are in the two tests below)."""
    run_dir = tmp_path / "chain"
    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGTERM, signal.SIGINT)
    for (phase, cls, method, call, saved), signum in zip(CHAIN, signals, strict=True):
        before = snapshot(run_dir) if run_dir.exists() else {}
        with monkeypatch.context() as m:
            signal_during(m, cls, method, call, signum)
            with pytest.raises(JobInterrupted) as info:
                run_job(config(tmp_path, "chain"))
        assert (info.value.signum, info.value.checkpoint) == (signum, saved), phase
        assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")][-1] == saved, phase
        assert [r["step"] for r in metrics(run_dir)] == list(range(1, saved + 1)), phase  # logged = saved
        assert_nothing_lost(before, run_dir)
    before = snapshot(run_dir)
    run_job(config(tmp_path, "chain"))  # the same command, to the end
    assert_nothing_lost(before, run_dir)
    assert [comparable(r) for r in metrics(run_dir)] == [comparable(r) for r in metrics(straight)]
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [1, 2, 3, 4, 5]
    for step in (2, 4, 5):  # the steps both runs saved
        name = f"step_{step:08d}"
        assert_same_state(run_dir / "checkpoints" / name, straight / "checkpoints" / name)
    assert any(r["train/grad_norm"] > 0 for r in metrics(straight))  # training moved the weights


def test_a_second_signal_stops_at_once_and_the_last_checkpoint_stands(tmp_path, monkeypatch, straight):
    """Ctrl-C twice during training: no checkpoint of a half-trained step; the newest one (step 2) is untouched and
    no temporary directory is left."""
    run_dir = copy_of(straight, tmp_path / "twice", steps=2)
    before = snapshot(run_dir)
    original = Trainer.train

    def train_twice_interrupted(self, samples):
        os.kill(os.getpid(), signal.SIGINT)  # deferred: training has started
        os.kill(os.getpid(), signal.SIGINT)  # again: stop now
        return original(self, samples)

    monkeypatch.setattr(Trainer, "train", train_twice_interrupted)
    with pytest.raises(JobInterrupted) as info:
        run_job(config(tmp_path, "twice"))
    assert info.value.forced and info.value.checkpoint == 2
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [2]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]
    assert_nothing_lost(before, run_dir)


def finished_like_straight(run_dir: Path, straight: Path, before: dict[Path, bytes]) -> None:
    """The run ended as the straight one did: every step logged alike, step 5's state equal, its report written."""
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")][-1] == STEPS
    name = f"step_{STEPS:08d}"
    assert_same_state(run_dir / "checkpoints" / name, straight / "checkpoints" / name)
    assert [comparable(r) for r in metrics(run_dir)] == [comparable(r) for r in metrics(straight)]
    assert list((run_dir / "plots").glob("*.png"))  # the report of a finished run (copy_of leaves none)
    assert_nothing_lost(before, run_dir)


@pytest.mark.parametrize(
    ("case", "cls", "method", "said"),
    [
        # the final save (the periodic saves of 2 and 4 are start_checkpoint's); on a GPU the budget's stop of a 2B run
        # came there, 2026-11-27, and the run was reported as stopped, "resume from step 5" of 5, with no report
        ("final-save", Trainer, "write_checkpoint", "this is the run's last step: finishing the run as it would have"),
        # the last step's training, with a final Hugging Face export due: the step, its checkpoint and the export
        ("last-train", Trainer, "train", "this is the run's last step: finishing the run as it would have"),
        # the engines and the trainer stopping after the run: it was raised out of close() ("saved no checkpoint")
        ("close", Trainer, "close", "the run is finished: stopping its engines and trainer"),
    ],
)
def test_a_stop_once_the_last_step_trains_lets_the_run_finish(
    case, cls, method, said, tmp_path, monkeypatch, straight, caplog
):
    """A first SIGINT once the last step trains changes nothing: the run ends as finished (no JobInterrupted: exit
    0), as the straight run, its report written, and says why."""
    run_dir = copy_of(straight, tmp_path / case, steps=4)
    before = snapshot(run_dir)
    signal_during(monkeypatch, cls, method, 1, signal.SIGINT)
    hf = ("checkpoint.save_hf.final=true",) if case == "last-train" else ()
    with caplog.at_level("WARNING", logger="miles_vl.orchestration.loop"):
        assert run_job(config(tmp_path, case, *hf)) == run_dir
    finished_like_straight(run_dir, straight, before)
    if hf:
        assert [p.name for p in (run_dir / "hf").iterdir()] == [f"step_{STEPS:08d}"]
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"SIGINT: {said}") for m in messages), messages
    finishing = "SIGINT came while the run was finishing: all 5 steps are done and saved"
    assert any(finishing in m for m in messages) == (case != "close"), messages


def test_a_stop_while_a_checkpoint_is_written_in_the_background_waits_for_it(tmp_path, monkeypatch, straight):
    """Issue 33.3: periodic saves are written in the background (checkpoint.async_save) while the next steps run.
    SIGINT in step 5's rollout while step 4's checkpoint is still being written (it is not visible yet, only its
    temporary directory is): the stop waits for that write, step 4 appears complete with the straight run's state
    exactly, no temporary directory is left, and the same command resumes from it to the straight run's end."""
    run_dir = copy_of(straight, tmp_path / "background", steps=2)
    gate = tmp_path / "gate"
    torch_backend = functools.partial(build_torch_gated_save, gate=str(gate))
    hooks = Hooks(train_backends={**TRAIN_BACKENDS, "torch": torch_backend})
    started, rollout, seen = Trainer.start_checkpoint, RolloutEngines.generate, {}

    def start_checkpoint(self, directory):
        seen["save"] = Path(directory)
        return started(self, directory)

    def generate(self, *args, **kwargs):
        if "save" in seen and "stopped" not in seen:  # the first rollout after step 4's save began: step 5's
            seen["stopped"] = True
            wait_for(Path(f"{gate}.writing"))
            assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [2]
            assert seen["save"].name.startswith(".step_00000004.tmp-") and seen["save"].is_dir()
            Path(f"{gate}.go").touch()  # the write goes on while the stop arrives
            os.kill(os.getpid(), signal.SIGINT)
        return rollout(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "start_checkpoint", start_checkpoint)
    monkeypatch.setattr(RolloutEngines, "generate", generate)
    with pytest.raises(JobInterrupted) as info:
        run_job(config(tmp_path, "background"), hooks=hooks)
    assert "stopped" in seen and info.value.checkpoint == 4
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [2, 4]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]
    assert_same_state(run_dir / "checkpoints" / "step_00000004", straight / "checkpoints" / "step_00000004")
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4]
    monkeypatch.undo()
    run_job(config(tmp_path, "background"))
    assert [comparable(r) for r in metrics(run_dir)] == [comparable(r) for r in metrics(straight)]
    assert_same_state(run_dir / "checkpoints" / "step_00000005", straight / "checkpoints" / "step_00000005")


def test_a_background_save_that_fails_raises_its_error_in_the_driver(tmp_path):
    """Issue 33.3: step 1's checkpoint is written in the train actor's background thread, which meets a full disk
    after the weights. The error is not lost in the thread: it ends the run before step 2's weight sync (a save in
    flight is published before a sync: a stop in a stalled sync ends the train ranks), so step 2 is not logged, with
    the full-disk message naming step 1, and no checkpoint or temporary directory is left (the driver's own files
    would fit: only the writer's error tells)."""
    hooks = Hooks(train_backends={**TRAIN_BACKENDS, "torch": build_torch_failing_save})
    cfg = config(tmp_path, "failing", "num_steps=2", "checkpoint.interval=1")
    message = "no space left on the device of .* while writing checkpoint step 1; the partial checkpoint was removed"
    with pytest.raises(DiskFullError, match=message):
        run_job(cfg, hooks=hooks)
    assert list((tmp_path / "failing" / "checkpoints").iterdir()) == []
    assert [r["step"] for r in metrics(tmp_path / "failing")] == [1]


def test_sigterm_from_outside_ends_miles_vl_train_with_a_checkpoint(tmp_path):
    """What Slurm and Kubernetes do on preemption: SIGTERM to the `miles-vl train` process while it trains. It used
    to die with rc -6 and no checkpoint (Ray's handler); now the step finishes, its checkpoint is written and the
    exit status is 143."""
    marker = tmp_path / "training"
    cmd = [
        sys.executable,
        "-m",
        "tests.orchestration.slow_train",
        str(marker),
        str(REPO / "configs" / "geo3k_tiny_cpu.yaml"),
        *tiny_overrides(tmp_path, "preempted"),
    ]
    env = dict(os.environ, COLUMNS="300")  # rich wraps log lines at the terminal width
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marker.exists(), proc.communicate()[0][-3000:]
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "stopped by SIGTERM: resume from step 1 with the same command" in out
    run_dir = tmp_path / "preempted"
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [1]
    assert [r["step"] for r in metrics(run_dir)] == [1]


@pytest.mark.parametrize("steps", [1, 2], ids=["final-wait", "next-step"])
def test_a_full_disk_during_a_save_ends_miles_vl_train_with_one_message(tmp_path, steps):
    """Issue 30.10: a full disk during a save gave ~90 lines of traceback: torch's writer (in the trainer actor) raises
    a RuntimeError, not an OSError. Now `miles-vl train` ends with the documented message (the place and the fix),
    exit 1, no traceback, and no partial checkpoint left. The checkpoint directory is a real 1.5 MiB disk: the
    weights (model.safetensors, about 1.1 MB) fit, the optimizer state (trainer_state.pt, twice that) does not, so
    it is torch's writer that meets the full disk. Issue 33.3: step 1's save is written in the background; its
    failure reaches the driver, not lost in the writer's thread, when the run's end waits for it (1 step) or
    before step 2's weight sync (2 steps): the same message, naming step 1."""
    disk = tmp_path / "disk"
    overrides = [
        *tiny_overrides(tmp_path, "full"),
        f"num_steps={steps}",
        "checkpoint.interval=1",
        f"checkpoint.dir={disk}",
    ]
    train = [sys.executable, "-m", "miles_vl.cli", "train", str(REPO / "configs" / "geo3k_tiny_cpu.yaml"), *overrides]
    # the disk exists only inside the namespace: list what the save left there before it goes
    script = 'cd "$1" && shift && "$@"; rc=$?; echo "left: [$(ls -A "$0")]"; exit $rc'
    env = dict(os.environ, COLUMNS="300")  # rich wraps log lines at the terminal width
    done = with_tmpfs(disk, ["sh", "-c", script, str(disk), str(REPO), *train], size="1536k", env=env, timeout=400)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    error = f"error: no space left on the device of {disk} while writing checkpoint step 1; the partial checkpoint was "
    assert error + "removed; free space there or point checkpoint.dir elsewhere" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert "left: []" in done.stdout
    assert [r["step"] for r in metrics(tmp_path / "full")] == [1]  # 2 steps: the error comes before step 2's sync


def tiny_overrides(tmp_path: Path, name: str) -> list[str]:
    from tests.orchestration.jobs import FAST

    return [
        *FAST,
        f"logging.output_dir={tmp_path}",
        f"logging.run_name={name}",
        "num_steps=3",
        "checkpoint.interval=0",
        "reward.num_workers=1",
    ]


# ---------------------------------------------------------------------------------------------------------------------
# engines, checkpoints and run directories


def test_an_engine_killed_in_any_phase_is_replaced_and_nothing_is_lost(tmp_path, monkeypatch, straight):
    """Issue 15.9: an engine killed while the trainer ran killed the job (release/resume had no recovery). Kills at
    release (step 1), during training (step 2: found at resume) and before the sync (step 2 again; step 3's rollout
    runs on that replacement): the run equals the straight one but for the restart counters (counted at rollout)."""
    kills = {"release_memory": 1, "train": 2, "sync_weights": 2}  # method -> the step whose call kills engine 0
    calls: dict[str, int] = {}

    def killing(cls, method):
        original = getattr(cls, method)

        def wrapper(self, *args, **kwargs):
            calls[method] = calls.get(method, 0) + 1
            if calls[method] == kills[method]:
                engines = self if isinstance(self, RolloutEngines) else job_engines[0]
                kill_actor(engines.engines[0])
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, method, wrapper)

    job_engines: list[RolloutEngines] = []
    init = RolloutEngines.__init__

    def remember(self, *args, **kwargs):
        init(self, *args, **kwargs)
        job_engines.append(self)

    monkeypatch.setattr(RolloutEngines, "__init__", remember)
    killing(RolloutEngines, "release_memory")
    killing(Trainer, "train")
    killing(RolloutEngines, "sync_weights")
    run = run_job(config(tmp_path, "engine-deaths", "num_steps=3"))
    rows = metrics(run)
    assert [r["rollout/engine_restarts"] for r in rows] == [0, 1, 3]
    expected = [comparable(r, ENGINE_COUNTERS) for r in metrics(straight)[:3]]
    assert [comparable(r, ENGINE_COUNTERS) for r in rows] == expected
    assert_same_state(run / "checkpoints" / "step_00000002", straight / "checkpoints" / "step_00000002")


def test_a_broken_newest_checkpoint_is_skipped_and_the_run_still_equals_the_straight_one(tmp_path, straight):
    """Issue 15.6: a truncated file in the newest checkpoint. `auto` resumes from the one before (the broken one is
    kept aside), and the step it repeats comes out as in the straight run."""
    run_dir = copy_of(straight, tmp_path / "broken", steps=4)
    model = run_dir / "checkpoints" / "step_00000004" / "model.safetensors"
    model.write_bytes(model.read_bytes()[:1000])
    run = run_job(config(tmp_path, "broken", "num_steps=4"))
    assert [s for s, _ in list_checkpoints(run / "checkpoints")] == [2, 4]
    assert len(list((run / "checkpoints").glob("step_00000004.broken-*"))) == 1
    assert [comparable(r) for r in metrics(run)] == [comparable(r) for r in metrics(straight)[:4]]
    assert_same_state(run / "checkpoints" / "step_00000004", straight / "checkpoints" / "step_00000004")


def test_starts_that_would_lose_another_runs_data_are_refused_before_ray(tmp_path, straight):
    """Issue 15.2: num_steps=2 with step_4 present saved step 4's state as step_2. Issue 15.3: resume=never with a
    fixed run_name truncated the old run's metrics and pruned across both runs. Both are refused, naming the fix,
    with every file of the existing run untouched."""
    name = straight.name
    before = snapshot(straight)
    with pytest.raises(CheckpointError, match=r"is at step 5, past num_steps=2.*raise num_steps to 5 or more"):
        run_job(config(straight.parent, name, "num_steps=2"))
    with pytest.raises(CheckpointError, match=r"holds another run \(5 logged steps and checkpoints .*set another"):
        run_job(config(straight.parent, name, "checkpoint.resume=never"))
    assert snapshot(straight) == before
    # a run that logged a step but left no checkpoint: a fresh start is refused as well
    (tmp_path / "no-ckpt").mkdir()
    (tmp_path / "no-ckpt" / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(CheckpointError, match="holds another run \\(1 logged steps\\)"):
        run_job(tiny_job(tmp_path, "no-ckpt", "num_steps=1", "checkpoint.resume=never"))
    assert (tmp_path / "no-ckpt" / "metrics.jsonl").read_text() == '{"step": 1}\n'
    # another run's checkpoint, resumed into that directory, would mix two runs' metrics
    other = straight / "checkpoints" / "step_00000002"
    with pytest.raises(CheckpointError, match="belongs to another run than .*no-ckpt, which holds metrics"):
        run_job(tiny_job(tmp_path, "no-ckpt", "num_steps=3", f"checkpoint.resume={other}"))
    assert (tmp_path / "no-ckpt" / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_auto_restarts_a_run_that_left_no_checkpoint_keeping_its_metrics(tmp_path):
    """A run that died before its first checkpoint (SIGKILL) is started again by the same command; what it logged
    is kept beside the new metrics.jsonl, not overwritten."""
    run_dir = tmp_path / "died-early"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    cfg = tiny_job(tmp_path, "died-early", "num_steps=1")
    assert check_start(cfg, run_dir, run_dir / "checkpoints", None) is None
    assert not (run_dir / "metrics.jsonl").exists()
    (kept,) = run_dir.glob("metrics.*.jsonl")
    assert kept.read_text() == '{"step": 1}\n'


def test_a_run_already_at_num_steps_does_nothing(tmp_path, straight):
    before = snapshot(straight)
    assert run_job(config(straight.parent, straight.name)) == straight
    assert snapshot(straight) == before


def train_cli(tmp_path: Path, name: str, *overrides: str) -> subprocess.CompletedProcess:
    """`miles-vl train` of this module's job (`config`) in a subprocess, writing into `tmp_path/name`; its stdout ends
    with whether the process had started Ray."""
    from tests.orchestration.jobs import FAST

    code = (
        "import sys, ray; from miles_vl.cli import main; rc = main(sys.argv[1:]); "
        "print(f'ray started: {ray.is_initialized()}'); sys.exit(rc)"
    )
    config_file = str(REPO / "configs" / "geo3k_tiny_cpu.yaml")
    where = (f"logging.output_dir={tmp_path}", f"logging.run_name={name}")
    cmd = [sys.executable, "-c", code, "train", config_file, *FAST, *where, f"num_steps={STEPS}", *BASE, *overrides]
    env = dict(os.environ, COLUMNS="300")  # rich wraps log lines at the terminal width
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def refused(out: subprocess.CompletedProcess) -> str:
    """The one error line of a start refused before Ray (exit 2), after asserting that it was."""
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert out.returncode == 2 and len(errors) == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and out.stdout.splitlines()[-1] == "ray started: False"
    return errors[0]


def test_resuming_an_older_checkpoint_of_the_run_is_refused_naming_both_ways_out(tmp_path, straight):
    """Issue 30.2: `checkpoint.resume=<run>/checkpoints/step_2` while step 4 existed dropped the later steps' records
    from metrics.jsonl; a later `auto` then picked the old branch's step 4, and the file read steps 1, 2, 3, 5. Now the
    start is refused before Ray, naming both steps, `auto` and how to branch, with every file of the run unchanged."""
    run_dir = copy_of(straight, tmp_path / "older", steps=STEPS)  # checkpoints 2, 4, 5; metrics of steps 1-5
    before = snapshot(run_dir)
    step2 = run_dir / "checkpoints" / "step_00000002"
    error = refused(train_cli(tmp_path, "older", f"checkpoint.resume={step2}"))
    assert f"checkpoint.resume={step2} is step 2 of {run_dir}, which has a newer checkpoint, step 5" in error
    assert "resume the newest (checkpoint.resume=auto)" in error
    assert (
        f"branch from step 2 into a new run directory (checkpoint.resume={step2} logging.run_name=<new name>)" in error
    )
    assert snapshot(run_dir) == before


def test_a_branch_from_an_older_checkpoint_runs_in_its_own_directory_and_leaves_the_source_untouched(
    tmp_path, straight
):
    """The way out the refusal names: the older checkpoint resumed into a new run directory. The branch repeats the
    straight run from there (records of steps 3-5, the weights and optimizer state of step 5), and not one byte of the
    source run changes."""
    source = copy_of(straight, tmp_path / "source", steps=STEPS)
    before = snapshot(source)
    step2 = source / "checkpoints" / "step_00000002"
    out = train_cli(tmp_path, "branch", f"checkpoint.resume={step2}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert snapshot(source) == before and sorted(p.name for p in tmp_path.iterdir()) == ["branch", "source"]
    branch = tmp_path / "branch"
    assert [comparable(r) for r in metrics(branch)] == [comparable(r) for r in metrics(straight)[2:]]
    assert [s for s, _ in list_checkpoints(branch / "checkpoints")] == [4, 5]
    assert_same_state(branch / "checkpoints" / "step_00000005", straight / "checkpoints" / "step_00000005")


def test_a_resume_with_a_changed_config_is_refused_listing_the_changed_keys(tmp_path, straight, capsys):
    """Issue 35.2: the run directory is named after the config file, so the same command with a changed override
    resumed the old run under the new settings. Now the start is refused before Ray, listing each changed key (old ->
    new) and both ways out, with every file unchanged; keys a resume may change (num_steps, logging, checkpoint: here
    run_name, wandb mode, the interval) and a secret (set in the straight run, unset here) are not listed.
    `checkpoint.accept_changes` resumes it; at num_steps the same command does nothing (exit 0) and says what changed.
    `miles-vl check` says the same before: the run directory, resume or not, from which step, or the refusal."""
    run_dir = copy_of(straight, tmp_path / "changed", steps=4)
    before = snapshot(run_dir)
    changes = ("rollout.temperature=0.5", "train.optimizer.lr=2e-4", "checkpoint.interval=3")
    error = refused(train_cli(tmp_path, "changed", *changes))
    assert "rollout.temperature: 1.0 -> 0.5; train.optimizer.lr: 0.0001 -> 0.0002;" in error, error
    assert f"differs from the one {run_dir} was trained with up to step 4" in error
    assert "logging.run_name=<new name>" in error
    assert "checkpoint.accept_changes=[rollout.temperature,train.optimizer.lr])" in error
    assert "api_key" not in error and "wandb" not in error and "interval" not in error
    assert snapshot(run_dir) == before

    from miles_vl.cli import main

    where = (*tiny_overrides(tmp_path, "changed"), f"num_steps={STEPS}")
    config_file = str(REPO / "configs" / "geo3k_tiny_cpu.yaml")
    assert main(["check", config_file, *where, *changes]) == 2
    assert "rollout.temperature: 1.0 -> 0.5" in capsys.readouterr().err
    assert main(["check", config_file, *where]) == 0
    start = yaml.safe_load(capsys.readouterr().out)["start"]
    assert start == {"run_dir": str(run_dir), "start": "resume", "from_step": 4,
                     "checkpoint": str(run_dir / "checkpoints" / "step_00000004")}  # fmt: skip
    assert main(["check", config_file, *where, "logging.run_name=new"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["start"] == {"run_dir": str(tmp_path / "new"), "start": "fresh"}
    assert snapshot(run_dir) == before and not (tmp_path / "new").exists()

    accept = "checkpoint.accept_changes=[rollout.temperature,train.optimizer]"  # a key, or a whole section
    out = train_cli(tmp_path, "changed", *changes, accept)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4, 5]
    assert_nothing_lost(before, run_dir)  # the config.yaml it started with is kept beside the new one
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["rollout"]["temperature"] == 0.5

    done = snapshot(run_dir)
    out = train_cli(tmp_path, "changed", "rollout.temperature=0.7", "train.optimizer.lr=2e-4")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "nothing to do" in out.stderr and "(nothing was run with it): rollout.temperature: 0.5 -> 0.7" in out.stderr
    assert snapshot(run_dir) == done


def test_the_driver_log_is_kept_in_the_run_directory(tmp_path, straight):
    """Issue 35.5: the driver's log was only on the console. `miles-vl train` writes what the console shows to
    <run dir>/driver.log as plain text (no ANSI codes), 0600, from its first line: the lines logged before the run
    directory was known (the machine check, the data) come first; a resume appends."""
    run_dir = copy_of(straight, tmp_path / "logged", steps=4)  # with the driver.log of the straight run (in-process:
    path = run_dir / "driver.log"  # what its logging level let through)
    copied = path.read_text()
    out = train_cli(tmp_path, "logged")
    assert out.returncode == 0, out.stderr[-3000:]
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.read_text().startswith(copied)
    first = path.read_text()[len(copied) :]
    lines = ["checking this machine for the job", "synthetic(n=24, seed=1234", f"resumed from {run_dir}/checkpoints",
             "step 5: 100% of the responses hit rollout.max_response_len", f"run finished: {run_dir}"]  # fmt: skip
    positions = [first.find(line) for line in lines]
    assert -1 not in positions and positions == sorted(positions), first
    assert all(line in out.stderr for line in lines)  # as the console showed them
    assert "\x1b" not in first
    out = train_cli(tmp_path, "logged", "num_steps=6")
    assert out.returncode == 0, out.stderr[-3000:]
    text = path.read_text()
    assert text.startswith(copied + first) and "step_00000005 at step 5" in text[len(copied + first) :]


def wandb_run_ids(run_dir: Path) -> list[str]:
    """The ids of the offline wandb runs under `run_dir`, as wandb names their files (run-<id>.wandb)."""
    return sorted(p.stem.removeprefix("run-") for p in (run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def test_a_resume_continues_the_runs_wandb_run(tmp_path, straight):
    """Issue 35.5: a resume started a new wandb run. The run directory keeps its wandb run id (wandb_run_id), and a
    resume continues that run (wandb offline here: the id read back from wandb's own files); a fresh start gets a
    new one."""
    run_id = (straight / "wandb_run_id").read_text().strip()
    assert wandb_run_ids(straight) == [run_id]
    run_dir = copy_of(straight, tmp_path / "wandb-resume", steps=4)  # without straight's wandb/ folder
    run_job(config(tmp_path, "wandb-resume", "logging.wandb.mode=offline"))
    assert wandb_run_ids(run_dir) == [run_id] and (run_dir / "wandb_run_id").read_text().strip() == run_id
    fresh = run_job(
        config(tmp_path, "wandb-fresh", "logging.wandb.mode=offline", "num_steps=2", "logging.tensorboard=true")
    )
    (new_id,) = wandb_run_ids(fresh)
    assert new_id != run_id and (fresh / "wandb_run_id").read_text().strip() == new_id
    # logging.tensorboard: every numeric metric of each step, as metrics.jsonl has it (float32)
    (events,) = (fresh / "tensorboard").glob("events.out.tfevents.*")
    written = {r["step"]: {k: v for k, v in r.items() if k != "step"} for r in metrics(fresh)}
    got = scalars(read_events(events))
    assert got.keys() == written.keys() == {1, 2}
    assert all(got[step] == pytest.approx(written[step], rel=1e-6) for step in written)


def test_a_bad_metrics_line_before_the_last_stops_a_resume_before_ray(tmp_path, straight):
    """Issue 30.9: a metrics.jsonl line that is not JSON, other than a torn last one, surfaced only once Ray was up
    (the resume's JsonlSink), as a traceback. Now: exit 2 before Ray, one line naming file:line, the file as it was."""
    run_dir = copy_of(straight, tmp_path / "corrupt", steps=4)
    path = run_dir / "metrics.jsonl"
    rows = path.read_text().splitlines(keepends=True)
    path.write_text("".join([rows[0], '{"step": 2, "reward/me\n', *rows[2:]]))
    before = snapshot(run_dir)
    error = refused(train_cli(tmp_path, "corrupt"))  # checkpoint.resume=auto: step 4
    assert error.startswith(f"error: {path}:2: not a JSON record") and "fix or remove the line" in error
    assert snapshot(run_dir) == before


def test_hostile_rewards_do_not_stop_the_run(tmp_path, monkeypatch):
    """Issue 15.7/15.8: a reward of 1e39 killed the run at the advantages; a reward that never returns hung it.
    Both score 0, are counted, and training goes on with finite numbers."""
    cfg = tiny_job(
        tmp_path,
        "hostile",
        "num_steps=1",
        "rollout.batch_size=3",
        "reward.num_workers=1",
        "reward.name=tests.orchestration.rewards:hostile_reward",
        "reward.timeout_s=1",
    )
    processor = load_processor(cfg.model.processor, cfg.data.min_pixels, cfg.data.max_pixels)
    first, second, _ = [p.index for p in build_datasets(cfg.data, processor, seed=cfg.seed).train.next_batch(3)]
    monkeypatch.setenv("HOSTILE_REWARD", f"{first}=huge,{second}=hang")  # the reward workers inherit it
    (row,) = metrics(run_job(cfg))
    n = cfg.rollout.n_samples_per_prompt
    assert (row["reward/errors"], row["reward/timeouts"]) == (n, n)  # every sample of the two prompts
    assert all(isinstance(v, float | int) and v == v for v in row.values())  # finite JSON numbers (no "nan" text)
    assert row["train/grad_norm"] > 0


def test_secrets_never_reach_a_file(straight):
    """Issue 15.10: rollout.sglang.api_key was written to config.yaml, every driver.json and the wandb config. The
    straight run had one set (and wandb offline): no file of the run holds it."""
    files = [p for p in straight.rglob("*") if p.is_file()]
    assert (
        any("wandb" in p.parts for p in files)
        and (straight / "checkpoints" / "step_00000005" / "driver.json").is_file()
    )
    assert [p for p in files if SECRET.encode() in p.read_bytes()] == []
    assert "<redacted>" in (straight / "config.yaml").read_text()
