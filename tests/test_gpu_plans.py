"""scripts/gpu/plans/owed.sh: every run a planned device call makes is a job that starts, checked here on the CPU
before device time is spent on it. Each run's config (loop_job.job: its file and overrides, as loop_job.py runs it)
validates; the job's GPUs are the ones the plan gives it; runs of one call use disjoint GPUs and distinct names;
each stops inside the device tool's 600 s per call; the megatron trainer's logits stay under the size the preflight
refuses, at the released model's vocabulary (p9's 16,384-token micro-batches stopped at start on 2026-11-28 for that,
the one check this test did not make then)."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from miles_vl.config.loader import load_config
from miles_vl.models.qwen3_vl.shapes import RELEASED_SHAPES
from miles_vl.orchestration.preflight import train_logits_problems
from tests.scripts import load_script

REPO = Path(__file__).resolve().parents[1]
OWED = REPO / "scripts" / "gpu" / "plans" / "owed.sh"
CALLS = (
    *("p1", "p2", "p3", "p4", "p5", "p6", "p7", "p7-sync", "p7-s1", "p8"),
    *("p9", "p9-x2", "p9-x2b", "p9-x2c", "p10", "p11", "p12", "p13", "p14", "p14b", "p15", "p15b", "p16"),
    *("p16-x1", "p16-x1-full", "p16-x1-lang"),
)
GPU_TESTS_ONLY = {"p16-x1"}  # calls that run GPU tests and write a checkpoint, no loop run
DEVICE_CALL_S = 600
RELEASED = {"2b": "Qwen3-VL-2B", "8b": "Qwen3-VL-8B"}  # loop_job.py's checkpoint shapes (tiny: a made-up one)


def planned_runs(call: str) -> list[list[str]]:
    out = subprocess.run(["bash", str(OWED), "--dry-run", call], capture_output=True, text=True, check=True, cwd=REPO)
    return [line.split() for line in out.stdout.splitlines()]


def gpus_of(cfg) -> int:
    """GPUs a job takes (miles_vl/orchestration/placement.py): colocated engines share the trainer's."""
    engines = cfg.rollout.num_engines * cfg.rollout.gpus_per_engine
    if cfg.ray.placement == "disaggregate":
        return cfg.train.num_gpus + engines
    assert engines <= cfg.train.num_gpus, "colocated engines need no more GPUs than the trainer has"
    return cfg.train.num_gpus


@pytest.mark.parametrize("call", CALLS)
def test_each_planned_run_is_a_valid_job_on_its_own_gpus(call, tmp_path):
    loop_job = load_script("scripts/gpu/loop_job.py")
    runs = planned_runs(call)
    assert bool(runs) != (call in GPU_TESTS_ONLY), f"owed.sh {call} plans {len(runs)} runs"
    taken: set[str] = set()
    names = [run[3] for run in runs]
    assert len(set(names)) == len(names), f"two runs of {call} share a name: {names}"
    for gpus, end_s, shape, name, steps, *extra in runs:
        devices = gpus.split(",")
        assert not taken & set(devices), f"{name} shares GPUs {sorted(taken & set(devices))} with another run"
        taken |= set(devices)
        assert int(end_s) <= DEVICE_CALL_S - 10, f"{name} stops at {end_s} s: no room before the call's limit"
        ckpt = tmp_path / f"ckpt_{shape}"
        if released := RELEASED.get(shape.split("_")[0]):  # the vocabulary the preflight reads from config.json
            ckpt.mkdir(exist_ok=True)
            (ckpt / "config.json").write_text(json.dumps(RELEASED_SHAPES[released]))
        cfg = load_config(*loop_job.job(shape, ckpt, tmp_path / "runs", name, int(steps), extra))
        assert gpus_of(cfg) == len(devices), f"{name}: the job takes {gpus_of(cfg)} GPUs, the plan gives it {gpus}"
        if released:
            assert train_logits_problems(cfg) == [], f"{name}: the preflight refuses it"


def test_an_unknown_call_is_refused_before_anything_runs():
    result = subprocess.run(["bash", str(OWED), "p99"], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2 and f"unknown call p99 ({' | '.join(CALLS)})" in result.stderr


def test_run_names_are_distinct_across_calls():
    """A name run again on the same warm machine resumes the earlier run (loop_run.sh): no two calls share one."""
    names = [run[3] for call in CALLS for run in planned_runs(call)]
    assert len(set(names)) == len(names), names


STACK_STAND_IN = """#!/usr/bin/env bash
# scripts/gpu/stack.sh's stand-in: records each command (its GPUs and budget), answers it
echo "$(date +%s.%N) start ${CUDA_VISIBLE_DEVICES:--} ${BUDGET_S:--} $*" >> "$LOG"
echo "$*" >> "$OUT/stack.log"  # as stack.sh logs to $OUT; loop_run.sh leaves its files there (below)
case "$*" in  # loop_run.sh --checkpoint fails with exit 1 (tests/test_loop_run.py, which also shows it writes once)
  "bash scripts/gpu/loop_run.sh --checkpoint "*) touch "$OUT/checkpoint_$4.log"; [ -n "${CKPT_FAILS:-}" ] && exit 1 ;;
  "bash scripts/gpu/loop_run.sh "*) mkdir -p "$LOG.meet"; touch "$LOG.meet/$4"  # MEET runs started before any goes on
    for _ in $(seq 300); do [ "$(ls "$LOG.meet" | wc -l)" -ge "${MEET:-1}" ] && break; sleep 0.1; done
    sleep 1; touch "$OUT/$4.tar.gz"; [ "$4" = "${RUN_FAILS:-}" ] && exit 3 ;;
  "python3 benchmarks/bench_export.py "*) sleep 1; [ -n "${BENCH_FAILS:-}" ] && exit 1 ;;
  "python3 -m pytest "*) sleep 1; [ "${*: -1}" = "${TEST_FAILS:-}" ] && exit 1 ;;
  true) [ -n "${INSTALL_FAILS:-}" ] && exit 1 ;;  # the install, when the call carries the bundle
  *) echo "unexpected: $*" >&2; exit 9 ;;
esac
echo "$(date +%s.%N) end $*" >> "$LOG"
"""


def run_plan(tmp_path: Path, call: str, **env: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    stand_in = tmp_path / "stack.sh"
    stand_in.write_text(STACK_STAND_IN)
    log = tmp_path / "log"
    log.unlink(missing_ok=True)
    shutil.rmtree(tmp_path / "log.meet", ignore_errors=True)
    environ = {
        "PATH": "/usr/bin:/bin",
        "OWED_STACK": str(stand_in),
        "CKPTS": str(tmp_path / "ckpts"),
        "OUT": str(tmp_path / "out"),
        "OWED_BUNDLE": str(tmp_path / "bundle"),
        "LOG": str(log),
        **env,
    }
    result = subprocess.run(["bash", str(OWED), call], env=environ, capture_output=True, text=True, timeout=60)
    return result, [line.split() for line in log.read_text().splitlines()] if log.exists() else []


def loop_runs(log: list[list[str]], event: str) -> list[list[str]]:
    """The log's rows of the runs' loop_run.sh calls (not the checkpoint's) for `event`, start or end."""
    return [row for row in log if row[1] == event and "scripts/gpu/loop_run.sh" in row and "--checkpoint" not in row]


def test_a_call_writes_the_checkpoint_first_then_runs_side_by_side_and_fails_when_one_run_fails(tmp_path):
    result, log = run_plan(tmp_path, "p1", MEET="2")  # were they started one after the other, they would not meet
    assert result.returncode == 0, result.stdout + result.stderr
    runs = loop_runs(log, "start")
    assert sorted((row[2], row[7]) for row in runs) == [("0,1", "async-2b-sync-p1"), ("2,3", "async-2b-s1")]
    assert all(570 <= int(row[3]) <= 585 for row in runs)  # the call's second 585, less what has passed
    ends = [float(row[0]) for row in loop_runs(log, "end")]
    assert max(float(row[0]) for row in runs) < min(ends)  # both started before either ended: side by side
    [ckpt_end] = [float(row[0]) for row in log if row[1] == "end" and row[-2:] == ["--checkpoint", "2b"]]
    assert ckpt_end < min(float(row[0]) for row in runs)

    again, log = run_plan(tmp_path, "p1", RUN_FAILS="async-2b-s1")
    assert again.returncode == 1 and "done (exit 1)" in again.stdout


def test_a_checkpoint_that_fails_starts_no_run(tmp_path):
    result, log = run_plan(tmp_path, "p5", CKPT_FAILS="1")
    assert result.returncode == 1 and "checkpoint tiny FAILED" in result.stdout
    assert loop_runs(log, "start") == [] and [row[-2:] for row in log] == [["--checkpoint", "tiny"]]


def _tarball(files_at: Path, name: str, files: dict[str, bytes]) -> None:
    import io
    import tarfile

    files_at.mkdir(exist_ok=True)
    with tarfile.open(files_at / f"{name}.tar.gz", "w:gz") as tar:
        for path, data in files.items():
            info = tarfile.TarInfo(path)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_take_runs_commits_each_run_once_with_its_plan_line_and_compressed_logs(tmp_path):
    import lzma

    take_runs = load_script("scripts/gpu/take_runs.py")
    files_at, runs_dir = tmp_path / "files", tmp_path / "gpu-runs"
    driver = b"step 1\n" * 4000  # 28 KB: over the tree's 16 KB for a plain log
    _tarball(
        files_at,
        "async-2b-s1",
        {
            "async-2b-s1/metrics.jsonl": b'{"step": 1}\n',
            "async-2b-s1/driver.log": driver,
            "async-2b-s1/p/s.json": b"{}",
        },
    )
    # owed.sh's logs of the call, not a run; with the run's own lines (NAME.out), which become loop_run.out
    _tarball(files_at, "call_logs", {"stack.log": b"x", "async-2b-s1.out": b"[loop_run +9s] train exited 0\n"})
    call = "bash scripts/gpu/plans/owed.sh p1"
    assert take_runs.take(files_at, runs_dir, "4xh100", call, "2026-11-28", "abc1234", "staged") == 0
    dest = runs_dir / "2026-11-28-async-2b-s1-4xh100"
    assert [p.name for p in runs_dir.iterdir()] == [dest.name]
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == [
        "commands.txt",
        "driver.log.xz",
        "loop_run.out",
        "metrics.jsonl",
        "p/s.json",
    ]
    assert lzma.decompress((dest / "driver.log.xz").read_bytes()) == driver
    assert (dest / "loop_run.out").read_text() == "[loop_run +9s] train exited 0\n"
    commands = (dest / "commands.txt").read_text().splitlines()
    assert commands[0] == "# machine: 4xh100; staged; commit abc1234" and commands[1] == call
    assert commands[2] == "# this run: " + next(" ".join(r) for r in planned_runs("p1") if r[3] == "async-2b-s1")

    before = {p: p.read_bytes() for p in dest.rglob("*") if p.is_file()}
    (files_at / "async-2b-s1.out").write_text("another call\n")
    assert take_runs.take(files_at, runs_dir, "4xh100", call, "2026-11-28", "abc1234", "staged") == 1
    assert {p: p.read_bytes() for p in dest.rglob("*") if p.is_file()} == before  # an earlier record stays


def test_take_runs_takes_a_run_whose_lines_are_lost_and_says_so(tmp_path, capsys):
    """A call_logs.tar.gz cut short in transfer (or one without the run's NAME.out): the run's folder is still made
    whole, without loop_run.out, and the missing lines are named."""
    take_runs = load_script("scripts/gpu/take_runs.py")
    files_at = tmp_path / "files"
    _tarball(files_at, "r1", {"r1/metrics.jsonl": b"{}\n"})
    (files_at / "call_logs.tar.gz").write_bytes(b"\x1f\x8b truncated")
    assert take_runs.take(files_at, tmp_path / "gpu-runs", "h100", "x", "2026-11-28", "c", "s") == 0
    assert sorted(p.name for p in (tmp_path / "gpu-runs" / "2026-11-28-r1-h100").iterdir()) == [
        "commands.txt",
        "metrics.jsonl",
    ]
    err = capsys.readouterr().err
    assert "call_logs.tar.gz unreadable" in err and "no r1.out loose or in call_logs.tar.gz" in err


def test_take_runs_refuses_a_tarball_that_writes_outside_its_folder(tmp_path):
    take_runs = load_script("scripts/gpu/take_runs.py")
    _tarball(tmp_path / "files", "r", {"r/../../escape.txt": b"x"})
    with pytest.raises(ValueError, match="expected plain files under r/"):
        take_runs.take(tmp_path / "files", tmp_path / "gpu-runs", "h100", "x", "2026-11-28", "c", "s")
    assert not (tmp_path / "escape.txt").exists()


@pytest.mark.parametrize("call", CALLS)
def test_a_call_leaves_no_more_files_than_the_device_tool_returns(tmp_path, call):
    """At most 8 files come back from $OUT (the device tool's limit; p2 once left 10 and lost a run's tarball): the
    call's own logs go into one call_logs.tar.gz, which holds each of them."""
    import tarfile

    (tmp_path / "bundle").mkdir()  # the first call of a machine: it installs too
    result, _ = run_plan(tmp_path, call)
    assert result.returncode == 0, result.stdout + result.stderr
    files = sorted(p.name for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert len(files) <= 8, files
    with tarfile.open(tmp_path / "out" / "call_logs.tar.gz") as tar:
        assert "stack.log" in tar.getnames()
        assert {f"{run[3]}.out" for run in planned_runs(call)} <= set(tar.getnames())  # take_runs reads them there
    if call not in GPU_TESTS_ONLY:
        assert f"== {planned_runs(call)[0][3]}.out" in result.stdout  # their tails, printed before packing


def test_p2_chains_each_gpu_test_after_the_work_on_its_gpus(tmp_path):
    """p2's GPU tests follow the work on their GPUs (bench_export on GPU 1, the tiny run on GPUs 2,3), never beside
    it; the tiny run stops early enough to leave the test its time."""
    result, log = run_plan(tmp_path, "p2")
    assert result.returncode == 0, result.stdout + result.stderr

    def when(event: str, part: str) -> float:  # the time of the one `event` row whose command contains `part`
        (t,) = [float(row[0]) for row in log if row[1] == event and part in " ".join(row[2:])]
        return t

    gpus = {" ".join(row[4:]): row[2] for row in log if row[1] == "start"}
    assert [g for cmd, g in gpus.items() if "bench_export" in cmd or "-k offload" in cmd] == ["1", "1"]
    assert [g for cmd, g in gpus.items() if "max_response_len" in cmd or "-k cp2" in cmd] == ["2,3", "2,3"]
    assert when("end", "bench_export.py") < when("start", "-k offload")
    assert when("end", "max_response_len=256") < when("start", "-k cp2")
    budgets = {row[-1]: int(row[3]) for row in loop_runs(log, "start")}
    assert 400 <= budgets["rollout.max_response_len=256"] <= 420  # the cp2 test after it needs ~2 minutes

    for fails in ({"BENCH_FAILS": "1"}, {"TEST_FAILS": "offload"}, {"TEST_FAILS": "cp2"}):  # each link counts
        again, log = run_plan(tmp_path, "p2", **fails)
        assert again.returncode == 1 and "done (exit 1)" in again.stdout, fails
        assert any("-k cp2" in " ".join(row) for row in log) and any("-k offload" in " ".join(row) for row in log)


def test_a_chain_with_no_time_left_starts_nothing_rather_than_running_without_a_limit():
    """`timeout 0` sets no limit: `left` refuses under 5 s instead, so a link that would start too late fails."""
    script = f'source <(sed -n "/^ts()/p;/^left()/,/^}}/p" {OWED}); SECONDS=598; left 600 || echo refused; left 700'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert out.stdout.split() == ["refused", "102"] and "no time left before second 600" in out.stderr


def test_the_call_that_carries_the_bundle_installs_it_once_and_a_failed_install_starts_nothing(tmp_path):
    (tmp_path / "bundle").mkdir()
    result, log = run_plan(tmp_path, "p1", INSTALL_FAILS="1")
    assert result.returncode == 1 and "stack install failed" in result.stdout
    assert [row[-1] for row in log] == ["true"] and (tmp_path / "out" / "install.out").exists()

    result, log = run_plan(tmp_path, "p1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert log[0][-1] == "true" and not (tmp_path / "bundle").exists()  # installed first, then the bundle dropped
    assert not (tmp_path / "out" / "install.out").exists()  # kept only on failure: 8 files come back at most
    result, log = run_plan(tmp_path, "p1")
    assert "true" not in [row[-1] for row in log]  # the next call on the warm machine installs nothing


def test_p16_x1_writes_the_checkpoint_then_runs_the_gpu_test_alone_on_gpu_0(tmp_path):
    """p16's one-GPU split: its first call leaves the 2B checkpoint for the two loop calls after it, and its GPU
    test starts after the checkpoint is written (the card is the test's alone)."""
    result, log = run_plan(tmp_path, "p16-x1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert loop_runs(log, "start") == []
    [ckpt_end] = [float(row[0]) for row in log if row[1] == "end" and row[-2:] == ["--checkpoint", "2b"]]
    [test_start] = [row for row in log if row[1] == "start" and "deepstack" in row]
    assert float(test_start[0]) >= ckpt_end and test_start[2] == "0", test_start

    failed, _ = run_plan(tmp_path, "p16-x1", TEST_FAILS="deepstack")
    assert failed.returncode == 1 and "done (exit 1)" in failed.stdout
