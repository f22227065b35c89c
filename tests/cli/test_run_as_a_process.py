"""`miles-vl train` as a process, the way another local user could meet it (issue 30, items 5, 7, 8): started from a
working directory that holds stray modules named like installed packages, with Ray's default temp folder holding a
planted address of a cluster that is not there, and with a secret on the command line.

The contract, checked on one run of the tiny job (two steps, wandb offline):
- no module of the working directory shadows an installed one, in the driver, its reward workers or Ray's workers,
  while a `module:function` reward from the working directory still resolves (item 7);
- the job starts its own Ray at once, never the planted address; that Ray's folder is 0700 while the job runs and is
  gone after; Ray's token file is 0600 in a 0700 folder (item 5);
- the secret is in no file the run leaves (run directory, wandb, HOME, Ray's temp folder) nor in any file of Ray's
  folder while the job runs, and the driver says once that a secret on the command line is visible in `ps` (item 8).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.orchestration.jobs import FAST, REPO

TINY = REPO / "configs" / "geo3k_tiny_cpu.yaml"
# Modules a stray file could shadow: the reward's dependency (driver, reward workers) and two that Ray's workers
# import only once they run the job's actors (the trainer, the hf engine), after Ray has put the working directory on
# their path.
PLANTED = ("math_verify", "safetensors", "transformers")
# A stray module leaves a marker (which process imported it), then puts the installed package in its place, so that
# the run goes on and each test below fails only for its own item when its fix is reverted.
PLANT = """import importlib, os, sys
with open(os.path.join({markers!r}, f"{{__name__}}-{{os.getpid()}}"), "w") as f:
    f.write(" ".join(sys.argv))
_here, _path = os.path.dirname(os.path.abspath(__file__)), sys.path[:]
del sys.modules[__name__]
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
try:
    sys.modules[__name__] = importlib.import_module(__name__)
finally:
    sys.path[:] = _path
"""
# The `module:function` reward of the working directory. Its first call (in a reward worker, while Ray runs) looks
# at Ray's temp folder: the private Ray's folder and its mode, and every file there that holds the secret.
REWARD = """import json, os, stat
from pathlib import Path

import math_verify  # the installed package, not the stray one beside this file

ROOT = Path({root!r})


def reward(sample) -> float:
    try:
        fd = os.open(ROOT / "during.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return min(len(sample.response), 40) / 40
    secret = (ROOT / "secret").read_bytes()
    tmp = Path(os.environ["RAY_TMPDIR"])
    files = [p for p in tmp.rglob("*") if p.is_file() and not p.is_symlink()]
    seen = {{
        "folders": {{p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp.iterdir()}},
        "sessions": [str(p.relative_to(tmp)) for p in tmp.glob("*/ray/session_2*")],
        "holding_the_secret": [str(p) for p in files if secret in p.read_bytes()],
        "files": len(files),
        "math_verify": math_verify.__file__,
    }}
    with os.fdopen(fd, "w") as f:
        json.dump(seen, f)
    return min(len(sample.response), 40) / 40
"""


@dataclass
class Run:
    root: Path  # the test's folder: cwd/, runs/, home/, markers/, secret, during.json
    ray_tmp: Path  # RAY_TMPDIR
    secret: str
    returncode: int
    output: str

    @property
    def during(self) -> dict:
        return json.loads((self.root / "during.json").read_text())


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    root = tmp_path_factory.mktemp("as_a_process")
    cwd, markers, home = root / "cwd", root / "markers", root / "home"
    for folder in (cwd, markers, home):
        folder.mkdir()
    for name in PLANTED:
        (cwd / f"{name}.py").write_text(PLANT.format(markers=str(markers)))
    (cwd / "mymod.py").write_text(REWARD.format(root=str(root)))
    secret = secrets.token_hex(16)
    (root / "secret").write_text(secret)
    # Ray's default temp folder for this run (RAY_TMPDIR/ray), with a planted address of a cluster that is not there.
    # Short, under /tmp: a private Ray's unix sockets go under it (placement.private_session_problem).
    ray_tmp = Path(tempfile.mkdtemp(prefix="mvl", dir="/tmp"))
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:1\n")
    exe = Path(sys.executable).with_name("miles-vl")
    overrides = [o for o in FAST if not o.startswith(("reward.name=", "logging.wandb.mode="))]
    cmd = [
        str(exe),
        "train",
        str(TINY),
        *overrides,
        f"logging.output_dir={root / 'runs'}",
        "logging.run_name=r",
        "num_steps=2",
        "checkpoint.interval=1",
        "reward.num_workers=1",
        "reward.name=mymod:reward",
        "logging.wandb.mode=offline",
        f"rollout.sglang.api_key={secret}",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH", "WANDB_"))}
    env |= {
        "HOME": str(home),
        "RAY_TMPDIR": str(ray_tmp),
        "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "COLUMNS": "300",  # rich wraps log lines at the terminal width
    }
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        yield Run(root, ray_tmp, secret, proc.returncode, proc.stdout + proc.stderr)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_no_module_of_the_working_directory_shadows_an_installed_one(run):
    """Item 7: cli.py put the working directory first on sys.path, so a stray math_verify.py there ran instead of the
    package; reward workers and Ray's workers put it first too. None of the stray modules is imported anywhere, and
    the reward `mymod:reward` of the working directory resolves (in the driver's check and in the reward worker)."""
    written = {p.name: p.read_text() for p in (run.root / "markers").iterdir()}
    assert written == {}, f"stray modules were imported (module-pid: command line): {written}"
    assert run.returncode == 0, run.output[-4000:]
    assert "site-packages" in run.during["math_verify"]


def test_a_job_without_ray_address_starts_its_own_private_ray(run):
    """Item 5: with ray.address unset a job joined the cluster Ray's address file names (a planted dead address:
    150 s of retries, or with ray.num_cpus set, as here, a crash). Now: a private Ray in a folder of its own, 0700
    while the job runs and removed after; the planted file is untouched; Ray's token file is 0600 in a 0700 folder."""
    assert run.returncode == 0, run.output[-4000:]
    assert "started a private Ray in" in run.output and "127.0.0.1:1" not in run.output
    folders = run.during["folders"]
    private = [name for name in folders if name.startswith("ray-")]
    assert len(private) == 1 and folders[private[0]] == 0o700, folders
    assert [s.split("/")[0] for s in run.during["sessions"]] == private  # Ray's session is in it
    assert [str(p.relative_to(run.ray_tmp)) for p in run.ray_tmp.rglob("*")] == ["ray", "ray/ray_current_cluster"]
    assert (run.ray_tmp / "ray" / "ray_current_cluster").read_text() == "127.0.0.1:1\n"
    token = run.root / "home" / ".ray" / "auth_token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and stat.S_IMODE(token.parent.stat().st_mode) == 0o700
    assert len(token.read_text()) == 64  # Ray's format: 32 random bytes in hex


def test_a_secret_on_the_command_line_reaches_no_file(run):
    """Item 8: rollout.sglang.api_key=... on the command line was written into wandb's run file (wandb records
    sys.argv) and would have been uploaded online. No file of the run directory, wandb, HOME or Ray's temp folder holds
    it after the run, nor did any file of Ray's folder while it ran; the driver warns, without repeating it."""
    assert run.returncode == 0, run.output[-4000:]
    assert run.during["files"] > 0 and run.during["holding_the_secret"] == []
    files = [p for folder in (run.root, run.ray_tmp) for p in folder.rglob("*") if p.is_file() and not p.is_symlink()]
    assert any(p.suffix == ".wandb" for p in files)  # wandb's offline run file, which held it
    secret = run.secret.encode()
    assert [p for p in files if secret in p.read_bytes() and p != run.root / "secret"] == []
    assert run.secret not in run.output
    warning = " ".join(run.output.split())
    assert "rollout.sglang.api_key given on the command line: other users of this machine can read it" in warning
    assert "rollout.sglang.api_key='${oc.env:SGLANG_API_KEY}'" in warning
