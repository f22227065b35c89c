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


def test_a_users_module_named_like_an_installed_package_is_refused_by_name(tmp_path, monkeypatch):
    """The price of the order above (found by the review of issue 30.7): `reward.function=yaml:score` with the user's
    yaml.py in the working directory now imports the installed PyYAML, which has no `score` or, worse, a function of
    that name. The resolvers of both extension points refuse it, naming the file, the installed package and the fix;
    a module that exists only in the working directory still resolves."""
    import yaml

    from miles_vl.data.layouts import DataError, load_dataset_fn
    from miles_vl.import_path import shadowing_problem
    from miles_vl.reward import RewardResolutionError, resolve_reward

    (tmp_path / "yaml.py").write_text("def score(response, answer):\n    return 1.0\n")
    (tmp_path / "my_rewards.py").write_text("def score(sample):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # appended last by the CLI; here the installed yaml is already loaded
    problem = shadowing_problem("yaml", yaml)
    assert problem and str(tmp_path / "yaml.py") in problem and "rename your module" in problem
    with pytest.raises(RewardResolutionError, match=r"yaml\.py in the working directory is not the module 'yaml'"):
        resolve_reward("yaml:safe_load")
    with pytest.raises(DataError, match=r"is not the module 'yaml'"):
        load_dataset_fn("yaml:safe_load")
    assert shadowing_problem("json", __import__("json")) is None  # no json.py here: nothing shadowed
    assert resolve_reward("my_rewards:score")  # the user's own module, from the working directory
