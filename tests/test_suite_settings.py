"""tests/conftest.py: the suite's property tests draw fixed examples unless asked to explore, on CI and off it."""

import os
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
