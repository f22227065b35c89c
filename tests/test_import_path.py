"""Contract of `miles_vl.import_path`'s finder for Ray workers (issue 30.7): with the working directory put first on
`sys.path` (as Ray does for a worker), a top-level module is found among the installed packages before the working
directory, and a file of the working directory never stands in for a built-in module (the finder sits after the
built-in and frozen importers: a review found `pwd.py` loaded when it came first)."""

import subprocess
import sys

import pytest

SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])  # what Ray does to a worker's path
from miles_vl.import_path import ray_worker_setup
ray_worker_setup()
import {module}
print({module}.__file__ if getattr({module}, "__file__", None) else "built-in")
"""


@pytest.mark.parametrize("module", ["pwd", "safetensors"])
def test_a_stray_file_in_the_working_directory_shadows_no_module(tmp_path, module):
    if module == "pwd" and "pwd" not in sys.builtin_module_names:
        pytest.skip("pwd is not a built-in module of this Python")
    (tmp_path / f"{module}.py").write_text("raise SystemExit('STRAY MODULE RAN')\n")
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(module=module), str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "STRAY" not in out.stdout + out.stderr
    assert str(tmp_path) not in out.stdout
