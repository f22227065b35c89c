"""Where `import` looks in every process of a job: the installed packages before the working directory.

`module:function` extension points (rewards, dataset mappers) resolve from the folder a job is started in, so that
folder is on the path of the driver, its reward workers and its Ray workers. It comes LAST: a stray
`math_verify.py` there must not shadow the installed package and run. Python and Ray put it first on their own:

- the driver: `python -m` / `python -c` put the working directory ('' or its path) first; a console script
  (`miles-vl`) puts its bin folder there, and nothing of the working directory. `working_dir_last` moves it to the
  end (`cli.main` calls it before it imports anything of the job).
- reward workers (`reward/scoring.py`) get the driver's `sys.path`, in its order, as PYTHONPATH, and run with `-P`, so
  Python adds nothing before it.
- Ray workers: Ray 2.60 inserts the driver's working directory (and script folder) at the front of every worker's
  `sys.path` when the worker runs its first task (`JobConfig.py_driver_sys_path`). `ray_worker_setup`, the job's
  `worker_process_setup_hook` (`orchestration/placement.py`), runs before that and puts `WorkingDirLast` on
  `sys.meta_path` just before the path finder (after the built-in and frozen importers): it looks up top-level
  modules on `sys.path` with the working directories last.

The price: a user's module named like an installed package (a `datasets.py` for `datasets:score`) is no longer the
one imported. `shadowing_problem` names that case, so that the extension point's resolver refuses it instead of
running the installed package's function or failing on a missing attribute.

Imports only the standard library: Ray workers import this module before anything else of miles_vl.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence

# The driver's working directory, for Ray workers (set in the job's runtime_env by `placement.ray_session`).
DRIVER_WORKING_DIR_ENV = "MILES_VL_DRIVER_WORKING_DIR"


def working_dir_last(path: Sequence[str], working_dirs: Sequence[str]) -> list[str]:
    """`path` with every entry that names one of `working_dirs` ('' and '.' name the process's working directory)
    moved to the end, each directory once, in the order of `working_dirs`."""
    last = [os.path.realpath(d) for d in working_dirs]
    kept = [p for p in path if os.path.realpath(p or ".") not in last]
    return kept + list(dict.fromkeys(working_dirs))


def put_working_dir_last() -> None:
    """Reorder this process's `sys.path` in place: the working directory after everything else (added if missing, so
    `module:function` paths of the working directory resolve from a console script too)."""
    sys.path[:] = working_dir_last(sys.path, [os.getcwd()])


class WorkingDirLast(importlib.abc.MetaPathFinder):
    """Finds top-level modules on `sys.path` with `working_dirs` searched last, whatever else has put them first.

    Submodules are left to their package's `__path__`; a module found nowhere is left to the finders after this one.
    """

    def __init__(self, working_dirs: Sequence[str]):
        self.working_dirs = list(working_dirs)

    def find_spec(self, name: str, path: Sequence[str] | None = None, target: object = None):
        if path is not None:
            return None
        return importlib.machinery.PathFinder.find_spec(name, working_dir_last(sys.path, self.working_dirs), target)


def ray_worker_setup() -> None:
    """Ray's `worker_process_setup_hook` for the job: installs `WorkingDirLast` for the worker's working directory and
    the driver's (they differ on another node), before Ray puts the driver's first on `sys.path`."""
    dirs = [os.getcwd(), os.environ.get(DRIVER_WORKING_DIR_ENV) or os.getcwd()]
    if not any(isinstance(f, WorkingDirLast) for f in sys.meta_path):
        # Just before the path finder, after the built-in and frozen importers: a file of the working directory must
        # never stand in for a built-in module (`pwd.py` did when this finder came first).
        at = next((i for i, f in enumerate(sys.meta_path) if f is importlib.machinery.PathFinder), len(sys.meta_path))
        sys.meta_path.insert(at, WorkingDirLast(list(dict.fromkeys(dirs))))


def shadowing_problem(module_name: str, module: object, cwd: str | None = None) -> str | None:
    """Why `module` (imported for `module_name`) is not the user's module of that name in the working directory `cwd`
    (default: this process's), or None: an installed package of the same top-level name came first."""
    top = module_name.split(".")[0]
    cwd = os.path.realpath(cwd or os.getcwd())
    mine = [p for p in (os.path.join(cwd, top + ".py"), os.path.join(cwd, top)) if os.path.exists(p)]
    installed = sys.modules.get(top, module)
    where = getattr(installed, "__file__", None) or str(getattr(installed, "__path__", "") or "")
    if not mine or not where or os.path.realpath(where).startswith(cwd + os.sep):
        return None
    return (
        f"{mine[0]} in the working directory is not the module {top!r} that was imported: the installed package "
        f"{top!r} ({where}) comes first (the working directory is searched after the installed packages, so that a "
        f"stray file never shadows one); rename your module (e.g. my_{top}.py) and the path that names it"
    )
