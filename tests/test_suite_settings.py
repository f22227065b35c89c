"""The suite's own settings: its property tests draw fixed examples unless asked to explore, on CI and off it
(tests/conftest.py), and a worker that dies ends `make test` red, naming the test (Makefile, pyproject.toml)."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROBE = (
    "import tests.conftest; from hypothesis import settings; d = settings.default; "
    "print(d.derandomize, d.database is None, d.deadline)"
)


def _probe(profile: str | None, on_ci: bool) -> subprocess.CompletedProcess:
    # a bare environment: hypothesis takes any of a dozen CI systems' variables as CI (GITLAB_CI, BUILDKITE, ...)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp")}
    if profile is not None:
        env["MILES_VL_HYPOTHESIS"] = profile
    if on_ci:
        env["CI"] = "true"  # one of the variables by which hypothesis loads its "ci" profile on its own
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, cwd=REPO)


@pytest.mark.parametrize("on_ci", [False, True], ids=["local", "ci"])
def test_the_gate_draws_fixed_examples_and_explore_draws_new_ones(on_ci):
    gate, explore = _probe(None, on_ci), _probe("explore", on_ci)
    assert gate.returncode == 0 and explore.returncode == 0, gate.stderr + explore.stderr
    assert gate.stdout.split() == ["True", "True", "None"]  # fixed draws, nothing replayed, no deadline
    assert explore.stdout.split() == ["False", "False", "0:00:00.200000"]  # hypothesis's own defaults


def test_an_unknown_profile_names_the_two_there_are():
    bad = _probe("nope", on_ci=False)
    assert bad.returncode != 0 and "use 'gate' (the default: fixed draws) or 'explore'" in bad.stderr


def test_a_worker_that_dies_ends_make_test_red_naming_its_test_instead_of_hanging(tmp_path):
    """CI of 2026-11-29 ran into its 90-minute limit: a worker died, pytest-xdist 3.8 (--dist loadfile) replaced it,
    and then waited forever with idle workers (its issues #784, #1378). This is #784's case, run through the Makefile's
    own command: two of three files kill their worker. It hangs with the replacement (checked: `--max-worker-restart`
    taken out of XDIST_ARGS, it ran into the timeout) and ends at once without it, red, naming the test and saying how
    the worker died (its exit status: tests/conftest.py)."""
    for name, body in (
        ("test_1_kill", "os.kill(os.getpid(), 9)"),
        ("test_2_lives", "pass"),
        ("test_3_kill", "os.kill(os.getpid(), 9)"),
    ):
        (tmp_path / f"{name}.py").write_text(f"import os\n\n\ndef test_fn():\n    {body}\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    # the suite's own hooks (tests/conftest.py) as a plugin: these files are outside tests/
    args = f"-c {tmp_path / 'pytest.ini'} --rootdir {tmp_path} -p no:cacheprovider -p tests.conftest {tmp_path}"
    make = subprocess.Popen(
        ["make", "-s", "-C", str(REPO), "test", f"PYTEST_ARGS={args}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # on a hang: its pytest and workers go with it (below)
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        out, _ = make.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(make.pid, signal.SIGKILL)
        raise AssertionError(f"make test hung after a worker died:\n{make.communicate()[0][-3000:]}") from None
    assert make.returncode != 0 and "test] Error 1" in out, out[-3000:]
    assert "crashed and worker restarting disabled" in out
    assert re.search(r"\[gw\d\] the worker process \d+ killed by SIGKILL", out), out[-3000:]  # how it died
    assert re.search(r"worker 'gw\d' crashed while running 'test_[13]_kill.py::test_fn'", out), out[-3000:]
