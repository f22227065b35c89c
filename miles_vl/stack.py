"""The software stack: the packages each backend needs, what for, and whether they import here.

    miles-vl doctor                                   # every package, its version, and which backends can run
    backend_problems("sglang", "megatron")            # what `miles-vl check` reports for a config's backends

Every job needs the core (torch, transformers, torchvision, Ray): that is all the embedded backends
(`rollout.backend=hf`, `train.backend=torch`) use. The production backends add SGLang (`rollout.backend=sglang`) and
megatron-core, megatron-bridge and Transformer Engine (`train.backend=megatron`). A package counts as present only if
it imports: megatron-bridge installed without Transformer Engine is there but cannot build Qwen3-VL.

Imports run quietly (`captured_output`): what libraries warn, log or print while they load (megatron's "Apex is not
installed", torch's "No CUDA runtime is found") is collected, not shown; `miles-vl doctor --log-level DEBUG` shows it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import io
import logging
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import ModuleType

CORE_INSTALL = "pip install -c constraints.txt -e . (or `make setup`)"
MEGATRON_INSTALL = (
    "pip install -c constraints.txt -e '.[megatron]' then scripts/setup_megatron.sh \"$(which python)\" "
    "(megatron-core 0.19.2 + megatron-bridge 0.6.2; docs/cluster.md)"
)


@dataclass(frozen=True)
class Package:
    """One package of the stack.

    Args:
        dist: the distribution name (whose version is reported).
        module: what to import to know that it works.
        backend: the config choice that needs it (`rollout.backend=sglang`); None: every job.
        purpose: what it does for miles_vl.
        install: how to get it.
    """

    dist: str
    module: str
    backend: str | None
    purpose: str
    install: str


PACKAGES = (
    Package("torch", "torch", None, "tensors, the torch train backend and the hf rollout engine", CORE_INSTALL),
    Package("transformers", "transformers", None, "the Qwen3-VL model and processor", CORE_INSTALL),
    Package("torchvision", "torchvision", None, "the Qwen3-VL processor (its video processor)", CORE_INSTALL),
    Package(
        "ray", "ray", None, "the driver places the rollout and train actors with Ray, also on one machine", CORE_INSTALL
    ),
    Package(
        "sglang",
        "sglang",
        "rollout.backend=sglang",
        "the production rollout engine, SGLang servers",
        "pip install -c constraints.txt -e '.[sglang]' (on a machine with CUDA)",
    ),
    Package(
        "megatron-core", "megatron.core", "train.backend=megatron", "the production train backend", MEGATRON_INSTALL
    ),
    Package(
        "megatron-bridge",
        "megatron.bridge",
        "train.backend=megatron",
        "loads the HF checkpoint into megatron (AutoBridge) and holds its Qwen3-VL model",
        MEGATRON_INSTALL,
    ),
    Package(
        "transformer-engine",
        "transformer_engine",
        "train.backend=megatron",
        "megatron-bridge's Qwen3-VL model is built from its layers",
        "pip install -c constraints.txt -e '.[gpu]' (on a machine with CUDA)",
    ),
)

# What to set instead when a production backend cannot run here.
FALLBACKS = {"rollout.backend=sglang": "rollout.backend=hf", "train.backend=megatron": "train.backend=torch"}


@dataclass
class Probe:
    """What `probe` found for one package: its version (None: not installed), why its import failed (None: it
    imports), and what the import warned, logged or printed."""

    package: Package
    version: str | None
    error: str | None
    output: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None

    def problem(self) -> str:
        """One line: who needs the package, why it failed, and the fix."""
        p = self.package
        who = p.backend or "every job"
        instead = f", or set {FALLBACKS[p.backend]}" if p.backend in FALLBACKS else ""
        return f"{who} needs {p.dist} ({p.purpose}), which does not import here: {self.error}; {p.install}{instead}"


def probe(package: Package) -> Probe:
    """Import `package.module` quietly and report."""
    try:
        version: str | None = importlib.metadata.version(package.dist)
    except importlib.metadata.PackageNotFoundError:
        version = None
    module, error, output = quiet_import(package.module)
    return Probe(package, version, error, output)


def quiet_import(name: str) -> tuple[ModuleType | None, str | None, list[str]]:
    """Import `name` with its output captured: (the module or None, the error or None, the captured lines)."""
    with captured_output() as output:
        try:
            module = importlib.import_module(name)
        except Exception as err:  # ImportError, but also whatever a broken package raises while it loads
            return None, f"{type(err).__name__}: {err}".splitlines()[0], output
    return module, None, output


def backend_problems(rollout_backend: str, train_backend: str) -> list[str]:
    """Every package that a job with these backends needs and that does not import here, one message each."""
    chosen = {None, f"rollout.backend={rollout_backend}", f"train.backend={train_backend}"}
    probes = [probe(p) for p in PACKAGES if p.backend in chosen]
    return [pr.problem() for pr in probes if not pr.ok and not fails_for_another(pr, probes)]


def fails_for_another(pr: Probe, probes: list[Probe]) -> bool:
    """Whether `pr` failed only because another listed package that also fails is missing (megatron-bridge without
    Transformer Engine): that package's own line says it."""
    return any(
        other is not pr and not other.ok and f"No module named '{other.package.module}" in (pr.error or "")
        for other in probes
    )


@contextlib.contextmanager
def captured_output() -> Iterator[list[str]]:
    """Collect, instead of showing, the warnings, log records and writes to stdout/stderr (Python's and the file
    descriptors', for C++ and subprocess output) made inside the block; the list fills when the block ends."""
    lines: list[str] = []
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved_fds = [os.dup(1), os.dup(2)]
    previous_disable = logging.root.manager.disable
    text = io.StringIO()
    with tempfile.TemporaryFile() as sink, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logging.disable(logging.CRITICAL)
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
                yield lines
        finally:
            os.dup2(saved_fds[0], 1)
            os.dup2(saved_fds[1], 2)
            for fd in saved_fds:
                os.close(fd)
            logging.disable(previous_disable)
            sink.seek(0)
            lines += text.getvalue().splitlines() + sink.read().decode(errors="replace").splitlines()
            lines += [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught]
