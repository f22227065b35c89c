"""scripts/gpu/loop_run.sh's stop: the budget's SIGINT comes early enough for the last step and its checkpoint, and the
checkpoints go to RAM where it holds them. The 2026-11-27 GPU runs (8B at TP=2 x CP=2, the 2B sync/async pair) were
killed 60 s after their SIGINT, in the middle of writing their last checkpoint.

The script runs for real (bash, coreutils' timeout) with a stand-in for Python that answers each of its calls
(loop_job.py's pixels and job, make_tiny_qwen3vl.py, summarize_run.py) and records the job's arguments."""

import os
import re
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LOOP_RUN = REPO / "scripts" / "gpu" / "loop_run.sh"

# coreutils' timeout, recording its arguments first (the SIGINT's time and the kill's delay)
TIMEOUT = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$TIMEOUT_ARGS"
args=("$@")
for i in "${!args[@]}"; do  # FIRE_AFTER: the SIGINT's time, the argument after `-k GRACE`
  [ -n "${FIRE_AFTER:-}" ] && [ "${args[$i]}" = -k ] && { args[$((i + 2))]=$FIRE_AFTER; break; }
done
exec /usr/bin/timeout "${args[@]}"
"""

STAND_IN = """#!/usr/bin/env bash
echo "$*" >> "$CALLS"
case "$1 $2" in
  "scripts/gpu/loop_job.py --pixels") echo "1 2" ;;
  scripts/gpu/make_tiny_qwen3vl.py*) [ -n "${MAKE_FAILS:-}" ] && { echo "no space left" >&2; exit 1; }; mkdir -p "$2" ;;
  scripts/gpu/loop_job.py*) shift; printf '%s\\n' "$@" > "$JOB_ARGS"
    # as miles-vl train: a SIGINT during the last step or its save finishes the run (0), earlier it stops it (130)
    if [ -n "${JOB_ON_INT:-}" ]; then trap 'exit $JOB_ON_INT' INT; sleep 20 & wait $!; exit 3; fi ;;
  scripts/gpu/cap_memory.py*) [ -n "${CAP_FAILS:-}" ] && { echo "cap_memory: no CUDA device" >&2; exit 1; }
    trap 'echo stopped >> "$CALLS"; exit 0' TERM; echo "0, 61440" > "$3"; while :; do sleep 0.1; done ;;
  scripts/gpu/summarize_run.py*) [ -n "${NO_METRICS:-}" ] && { echo "FileNotFoundError: no metrics.jsonl" >&2; exit 1; }
    echo "{}" ;;
  *) echo "unexpected call: $*" >&2; exit 9 ;;
esac
"""


def loop_run(tmp_path: Path, *args: str, ram_gib: int = 512, shm: Path | None = None, budget: int = 540, **extra):
    stand_in = tmp_path / "python"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    (tmp_path / "bin").mkdir(exist_ok=True)
    (tmp_path / "bin" / "timeout").write_text(TIMEOUT)
    (tmp_path / "bin" / "timeout").chmod(0o755)
    env = {
        **os.environ,
        "PYTHON": str(stand_in),
        "JOB_ARGS": str(tmp_path / "job_args"),
        "OUT": str(tmp_path / "out"),
        "RUNS": str(tmp_path / "runs"),
        "CKPTS": str(tmp_path / "ckpts"),
        "LOOP_SHM": str(shm or tmp_path / "no-shm-here"),
        "LOOP_RAM_GIB": str(ram_gib),
        "BUDGET_S": str(budget),
        "TIMEOUT_ARGS": str(tmp_path / "timeout_args"),
        "CALLS": str(tmp_path / "calls"),
        **extra,
        "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin",  # the recording timeout; no nvidia-smi
    }
    result = subprocess.run(
        ["bash", str(LOOP_RUN), *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    job_args = (tmp_path / "job_args").read_text().split("\n")[:-1] if (tmp_path / "job_args").exists() else None
    return result, job_args


def sigint_and_grace(stderr: str) -> tuple[int, int]:
    match = re.search(r"SIGINT after (\d+)s, killed (\d+)s later", stderr)
    assert match, stderr
    return int(match[1]), int(match[2])


def test_a_2b_run_on_a_disk_is_stopped_early_enough_for_its_30_gb_checkpoint(tmp_path):
    result, job_args = loop_run(tmp_path, "2b", "pair", "5", "ray.placement=disaggregate")
    assert result.returncode == 0, result.stderr
    sigint, grace = sigint_and_grace(result.stderr)
    assert grace == 60 + 30 * 10 // 4  # the step, then 30 GB at 0.4 GB/s
    assert sigint + grace + 25 in (540, 539)  # and the summary's 25 s: all within the budget (a second may pass)
    assert "checkpoints of ~30 GB in a disk" in result.stderr
    # what the job ran under: SIGINT after `sigint` seconds, SIGKILL `grace` seconds after that
    timeout_args = (tmp_path / "timeout_args").read_text().split("\n")
    assert timeout_args[:6] == ["--preserve-status", "-s", "INT", "-k", str(grace), str(sigint)]
    assert job_args == [
        "2b",
        str(tmp_path / "ckpts" / "ckpt_loop_2b"),
        str(tmp_path / "runs"),
        "pair",
        "5",
        "ray.placement=disaggregate",
    ]


def shm_with(tmp_path, gib: int, why: str):
    """A folder standing for /dev/shm, on a disk with at least `gib` GiB free (else the test is skipped: `why`)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    free_gib = os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize // 2**30
    if free_gib < gib:
        pytest.skip(f"{shm} has {free_gib} GiB free; {why} want {gib}")
    return shm


def test_checkpoints_go_to_ram_where_it_holds_them_and_leaves_the_host_enough(tmp_path):
    shm = shm_with(tmp_path, 3, "the tiny job's 3 checkpoints (1 GB each, counted 1.1)")
    result, job_args = loop_run(tmp_path, "tiny", "t", "20", "rollout.max_staleness=1", shm=shm, ram_gib=128)
    assert result.returncode == 0, result.stderr
    assert job_args[5:] == [f"checkpoint.dir={shm}/miles_vl_ckpt/t", "rollout.max_staleness=1"]
    _, grace = sigint_and_grace(result.stderr)
    assert grace == 60 + 1  # 1 GB at 1 GB/s
    # a host that RAM-held checkpoints would leave under 64 GiB: a disk (3 checkpoints of 1 GB for 20 steps)
    result, job_args = loop_run(tmp_path, "tiny", "t2", "20", shm=shm, ram_gib=66)
    assert not any(a.startswith("checkpoint.dir=") for a in job_args)
    assert sigint_and_grace(result.stderr)[1] == 60 + 10 // 4


def test_the_callers_checkpoint_dir_wins_and_counts_as_a_disk(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    result, job_args = loop_run(tmp_path, "tiny", "t", "4", "checkpoint.dir=/elsewhere", shm=shm, ram_gib=512)
    assert result.returncode == 0, result.stderr
    assert job_args[5:] == ["checkpoint.dir=/elsewhere"]
    assert sigint_and_grace(result.stderr)[1] == 60 + 10 // 4


def test_a_budget_that_leaves_no_room_for_the_stop_does_not_start_the_job(tmp_path):
    result, job_args = loop_run(tmp_path, "2b", "short", "5", budget=200)  # 200 - 25 - 135 < 60 s
    assert result.returncode == 1 and job_args is None
    assert re.search(r"only \d+s left before the stop's 135s: not starting the run", result.stderr), result.stderr


def test_8b_on_one_gpu_is_refused_on_a_host_without_the_ram_for_its_optimizer(tmp_path):
    result, job_args = loop_run(tmp_path, "8b_1gpu", "one", "4", ram_gib=128)
    assert result.returncode == 2 and job_args is None
    assert "8b_1gpu needs >= 150 GiB of available RAM" in result.stderr
    assert "this host has 128 GiB of RAM available" in result.stderr


def test_a_run_keeps_the_place_of_its_checkpoints_so_that_a_resume_finds_them(tmp_path):
    """Where checkpoints go is decided per call; a run's next call (a resume with more steps) must look where its
    checkpoints are, even if the free space or the step count alone would now choose the other place."""
    shm = tmp_path / "shm"
    (shm / "miles_vl_ckpt" / "r" / "step_00000010").mkdir(parents=True)
    result, job_args = loop_run(tmp_path, "2b", "r", "30", shm=shm, ram_gib=16)  # RAM alone would say: a disk
    assert result.returncode == 0, result.stderr
    assert job_args[5:] == [f"checkpoint.dir={shm}/miles_vl_ckpt/r"]
    (tmp_path / "runs" / "d" / "checkpoints" / "step_00000005").mkdir(parents=True)
    result, job_args = loop_run(tmp_path, "tiny", "d", "8", shm=shm, ram_gib=512)  # RAM would hold it
    assert job_args[5:] == [] and "in a disk" in result.stderr


def test_ram_must_hold_the_checkpoints_at_their_peak_keep_last_and_the_one_being_written(tmp_path):
    shm = shm_with(tmp_path, 5, "4 checkpoints of the tiny job (1 GB each, counted 1.1)")
    # tiny at 30 steps: 4 checkpoints of 1 GB at once: 4 GiB of RAM for them beside the host's 64
    result, job_args = loop_run(tmp_path, "tiny", "a", "30", shm=shm, ram_gib=68)
    assert job_args[5:] == [f"checkpoint.dir={shm}/miles_vl_ckpt/a"]
    result, job_args = loop_run(tmp_path, "tiny", "b", "30", shm=shm, ram_gib=67)
    assert job_args[5:] == []


def test_checkpoint_only_writes_the_shapes_checkpoint_once_and_starts_no_job(tmp_path):
    """`loop_run.sh --checkpoint SHAPE` (scripts/gpu/plans/owed.sh, before two runs of one shape start side by side):
    the checkpoint the runs would write, once per machine; no job; a failed write is exit 1 and no `.complete`."""
    failed, _ = loop_run(tmp_path, "--checkpoint", "8b_1gpu", MAKE_FAILS="1")
    assert failed.returncode == 1 and "checkpoint FAILED: no space left" in failed.stderr, failed.stderr
    assert not (tmp_path / "ckpts" / "ckpt_loop_8b" / ".complete").exists()
    result, job_args = loop_run(tmp_path, "--checkpoint", "8b_1gpu")
    assert result.returncode == 0 and job_args is None, result.stderr
    assert (tmp_path / "ckpts" / "ckpt_loop_8b" / ".complete").is_file()  # the 8b shapes share one checkpoint
    written = (tmp_path / "calls").read_text()
    assert "make_tiny_qwen3vl.py" in written and "loop_job.py --pixels 8b_1gpu" in written
    (tmp_path / "calls").unlink()
    again, _ = loop_run(tmp_path, "--checkpoint", "8b")  # the same checkpoint: complete, nothing called
    assert again.returncode == 0 and not (tmp_path / "calls").exists()
    run, job_args = loop_run(tmp_path, "8b", "r", "2")  # a run finds it: no second write
    assert run.returncode == 0 and job_args[:2] == ["8b", str(tmp_path / "ckpts" / "ckpt_loop_8b")]
    assert "make_tiny_qwen3vl.py" not in (tmp_path / "calls").read_text()


def test_a_run_without_metrics_leaves_no_empty_summary_and_says_why(tmp_path):
    """A run refused at start (2026-11-28: the preflight's logits check) has no metrics: summarize_run.py fails, and
    its empty summary.json once sat beside the run's logs as if it were one."""
    result, _ = loop_run(tmp_path, "tiny", "refused", "2", NO_METRICS="1")
    assert "no summary: FileNotFoundError: no metrics.jsonl" in result.stderr
    with tarfile.open(tmp_path / "out" / "refused.tar.gz") as tar:  # what the device tool returns of the run
        assert "refused/summary.json" not in tar.getnames()
    result, _ = loop_run(tmp_path, "tiny", "ran", "2")
    assert "summary: {}" in result.stderr
    with tarfile.open(tmp_path / "out" / "ran.tar.gz") as tar:
        assert tar.extractfile("ran/summary.json").read() == b"{}\n"


def test_gpu_memory_gib_holds_the_cards_for_the_run_and_the_summary_leaves_the_ballast_out(tmp_path):
    """GPU_MEMORY_GIB=79.65: scripts/gpu/cap_memory.py holds the rest of each GPU before the job starts, until it ends,
    and summarize_run.py gets its ballast; a ballast that cannot be held starts no job."""
    result, job_args = loop_run(tmp_path, "tiny", "capped", "2", GPU_MEMORY_GIB="79.65")
    assert result.returncode == 0, result.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    cap = next(i for i, c in enumerate(calls) if c.startswith("scripts/gpu/cap_memory.py 79.65 "))
    job = next(i for i, c in enumerate(calls) if c.startswith("scripts/gpu/loop_job.py tiny"))
    assert cap < job and job_args is not None
    assert "GPUs held to 79.65 GiB each: 0, 61440; (index, ballast MiB)" in result.stderr
    for _ in range(50):  # SIGTERM'd once the job ended (its trap runs after its current sleep)
        if "stopped" in (calls := (tmp_path / "calls").read_text().splitlines()):
            break
        time.sleep(0.1)
    assert "stopped" in calls[job:]
    summary = next(c for c in calls if c.startswith("scripts/gpu/summarize_run.py"))
    assert summary.endswith("capped/gpu_ballast.csv")
    with tarfile.open(tmp_path / "out" / "capped.tar.gz") as tar:
        assert tar.extractfile("capped/gpu_ballast.csv").read() == b"0, 61440\n"

    (other := tmp_path / "other").mkdir()
    failed, job_args = loop_run(other, "tiny", "uncapped", "2", GPU_MEMORY_GIB="79.65", CAP_FAILS="1")
    assert failed.returncode == 1 and job_args is None
    assert "the ballast was not held within 60 s (cap_memory: no CUDA device): not starting the run" in failed.stderr


def test_8b_on_one_gpu_with_weights_only_checkpoints_keeps_them_in_a_256_gib_hosts_ram(tmp_path):
    """checkpoint.optimizer_state=false: 8B checkpoints of ~18 GB (bf16 weights) instead of ~123, which a 2-GPU host's
    256 GiB hold in RAM beside the 131 GiB of offloaded optimizer state; the stop's grace is sized for 18 GB."""
    shm = shm_with(tmp_path, 20, "one 8B weights-only checkpoint (18 GB, counted 1.1)")
    weights_only = "checkpoint.optimizer_state=false"
    result, job_args = loop_run(tmp_path, "8b_1gpu", "one", "4", weights_only, shm=shm, ram_gib=251)
    assert result.returncode == 0, result.stderr
    assert f"checkpoint.dir={shm}/miles_vl_ckpt/one" in job_args and weights_only in job_args
    assert sigint_and_grace(result.stderr)[1] == 60 + 18
    assert "checkpoints of ~18 GB in" in result.stderr


@pytest.mark.parametrize("job_status", [0, 130])
def test_the_script_exits_with_the_jobs_own_status_after_the_budgets_sigint(tmp_path, job_status):
    """A run whose SIGINT came during its last step or final save finishes as it would have (miles-vl train exits 0)
    and the script says so with 0, not timeout's 124 (on 2026-11-28 owed.sh p4 and p13 reported such finished runs as
    failures); a run the SIGINT stopped earlier exits 130 (its last completed step saved)."""
    result, _ = loop_run(tmp_path, "tiny", "t", "4", FIRE_AFTER="1", JOB_ON_INT=str(job_status))
    assert result.returncode == job_status, result.stderr
    assert f"train exited {job_status}" in result.stderr
