"""Commit a device call's loop runs as docs/gpu-runs folders, as docs/gpu-runs/README.md says they are kept.

usage: python scripts/gpu/take_runs.py FILES_AT --machine 4xh100 --call "scripts/gpu/plans/owed.sh p1"
           [--date YYYY-MM-DD] [--commit REV] [--staging TEXT] [--runs-dir docs/gpu-runs]

FILES_AT is the folder the device tool copied the call's $OUT into. Each NAME.tar.gz there (scripts/gpu/loop_run.sh
leaves one per run) becomes docs/gpu-runs/<date>-<NAME>-<machine>/: its files, the run's own lines (NAME.out, loose or
in owed.sh's call_logs.tar.gz, as loop_run.out), and commands.txt (the machine, how the stack was staged, the commit,
the call, and the run's line of `owed.sh --dry-run`). A log over 16 KB is xz-compressed, as the tree's test asks. A
folder that exists is never written into: the run is skipped and said so (exit 1 at the end), so that an earlier record
is never replaced.
"""

from __future__ import annotations

import argparse
import datetime
import lzma
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LOG_LIMIT = 16 * 1024  # bytes, tests/test_gpu_runs.py
STAGING = (
    "staged as scripts/gpu/plans/owed.sh says: 10 calls `bash scripts/gpu/stack.sh --stage` carrying "
    ".bundle_stack/part1..10, the plan's first call carrying part11"
)


def _plan_lines(call: str) -> dict[str, str]:
    """Each run's line of `owed.sh --dry-run CALL` (GPUs, end second, loop_run.sh's arguments) by run name, if CALL
    is a plan's; else none."""
    argv = shlex.split(call)
    at = next((i for i, arg in enumerate(argv) if arg.endswith("owed.sh")), None)
    if at is None:
        return {}
    out = subprocess.run(
        ["bash", argv[at], "--dry-run", *argv[at + 1 :]], capture_output=True, text=True, cwd=REPO, check=False
    ).stdout
    return {line.split()[3]: line for line in out.splitlines() if len(line.split()) > 3}


CALL_LOGS = "call_logs.tar.gz"  # owed.sh's own logs of a call (stack.sh's, the checkpoints') and its runs' NAME.out


def _safe_members(tar: tarfile.TarFile, name: str) -> list[tarfile.TarInfo]:
    members = tar.getmembers()
    for m in members:
        parts = Path(m.name).parts
        if not (m.isfile() or m.isdir()) or not parts or parts[0] != name or ".." in parts:
            raise ValueError(f"{name}.tar.gz holds {m.name!r}: expected plain files under {name}/")
    return members


def _run_lines(files_at: Path, name: str) -> bytes | None:
    """NAME.out, the run's own lines: loose in `files_at` (loop_run.sh run alone), else in the call's CALL_LOGS
    (owed.sh packs them there: the device tool returns 8 files at most); None when neither has it."""
    if (loose := files_at / f"{name}.out").is_file():
        return loose.read_bytes()
    if (logs := files_at / CALL_LOGS).is_file():
        try:
            with tarfile.open(logs) as tar:
                member = next((m for m in tar.getmembers() if m.isfile() and m.name == f"{name}.out"), None)
                return tar.extractfile(member).read() if member else None
        except tarfile.TarError as e:  # a truncated transfer: the run itself is still taken
            print(f"take_runs: {logs} unreadable ({e}): {name} taken without its loop_run.out", file=sys.stderr)
            return None
    return None


def take(files_at: Path, runs_dir: Path, machine: str, call: str, date: str, commit: str, staging: str) -> int:
    tarballs = [t for t in sorted(files_at.glob("*.tar.gz")) if t.name != CALL_LOGS]
    if not tarballs:
        print(f"take_runs: no NAME.tar.gz in {files_at} (scripts/gpu/loop_run.sh leaves one per run)", file=sys.stderr)
        return 2
    status, plan = 0, _plan_lines(call)
    for tarball in tarballs:
        name = tarball.name.removesuffix(".tar.gz")
        dest = runs_dir / f"{date}-{name}-{machine}"
        if dest.exists():
            print(f"take_runs: {dest} exists: {name} not taken (an earlier record is never replaced)", file=sys.stderr)
            status = 1
            continue
        lines = _run_lines(files_at, name)  # before anything is written: a folder is made whole or not at all
        if lines is None:
            print(
                f"take_runs: no {name}.out loose or in {CALL_LOGS}: {name} taken without loop_run.out", file=sys.stderr
            )
        with tarfile.open(tarball) as tar:
            members = _safe_members(tar, name)
            dest.mkdir(parents=True)
            for m in members:
                if m.isfile():
                    target = dest / Path(m.name).relative_to(name)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(tar.extractfile(m).read())
        if lines is not None:
            (dest / "loop_run.out").write_bytes(lines)
        for log in [p for p in dest.rglob("*.log") if p.stat().st_size > LOG_LIMIT]:
            log.with_name(log.name + ".xz").write_bytes(lzma.compress(log.read_bytes(), preset=9))
            log.unlink()
        header = f"# machine: {machine}; {staging}; commit {commit}"
        body = [header, call] + ([f"# this run: {plan[name]}"] if name in plan else [])
        (dest / "commands.txt").write_text("\n".join(body) + "\n")
        print(dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest)
    return status


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files_at", type=Path, help="the folder holding the call's NAME.tar.gz and NAME.out files")
    ap.add_argument("--machine", required=True, help="as folder names spell it: h100, h200, 2xh100, 4xh200, ...")
    ap.add_argument("--call", required=True, help="the command the device call ran")
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    ap.add_argument("--commit", default=None, help="the commit the call ran (default: HEAD)")
    ap.add_argument("--staging", default=STAGING)
    ap.add_argument("--runs-dir", type=Path, default=REPO / "docs" / "gpu-runs")
    args = ap.parse_args(argv)
    commit = (
        args.commit
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO, check=True
        ).stdout.strip()
    )
    return take(args.files_at, args.runs_dir, args.machine, args.call, args.date, commit, args.staging)


if __name__ == "__main__":
    sys.exit(main())
