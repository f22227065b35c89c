"""Build hook: the runnable configs of `configs/` ship inside the wheel as `miles_vl/configs/*.yaml`.

They stay at the repository root (the README, the Makefile, the scripts and the tests name `configs/...`); a wheel
user lists and copies them with `miles-vl configs`. Everything else about the package is in pyproject.toml.
An editable install (`make setup`) copies nothing: `miles-vl configs` reads `configs/` of the checkout.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CONFIGS = Path(__file__).resolve().parent / "configs"


class BuildPyWithConfigs(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        target = Path(self.build_lib, "miles_vl", "configs")
        self.mkpath(str(target))
        for config in sorted(CONFIGS.glob("*.yaml")):
            self.copy_file(str(config), str(target / config.name))


setup(cmdclass={"build_py": BuildPyWithConfigs})
