"""tests/conftest.py: the suite's property tests draw fixed examples unless asked to explore."""

import os
import subprocess
import sys
from pathlib import Path

from hypothesis import settings

REPO = Path(__file__).resolve().parents[1]


def test_the_gate_draws_fixed_examples_and_explore_draws_new_ones():
    if os.environ.get("MILES_VL_HYPOTHESIS", "gate") == "gate":
        assert settings.default.derandomize and settings.default.database is None
    probe = "import tests.conftest; from hypothesis import settings; print(settings.default.derandomize)"
    env = dict(os.environ, MILES_VL_HYPOTHESIS="explore")
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True, cwd=REPO
    ).stdout
    assert out.strip() == "False"
    env["MILES_VL_HYPOTHESIS"] = "nope"
    bad = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, cwd=REPO)
    assert bad.returncode != 0 and "use 'gate' (the default: fixed draws) or 'explore'" in bad.stderr
