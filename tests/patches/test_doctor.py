"""Contract: `miles-vl doctor` lists every package of the stack (version, whether it imports, what needs it), CUDA and
the state of the megatron-bridge patches, without the warnings libraries print while they load, and exits 0 exactly
when the embedded backends (hf rollout + torch train) can run."""

import subprocess
import sys
from pathlib import Path

from miles_vl import stack
from miles_vl.cli import main


def test_doctor_reports_the_stack_quietly_and_passes_when_the_embedded_backends_can_run():
    """Issue 16: doctor exited 1 on every CPU machine (no Transformer Engine) and dumped megatron's import warnings."""
    exe = Path(sys.executable).with_name("miles-vl")
    out = subprocess.run([str(exe), "doctor"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    for dist in ("torch", "transformers", "ray", "sglang", "megatron-core", "megatron-bridge", "transformer-engine"):
        assert f"\n{dist} " in out.stdout, dist
    assert "CUDA" in out.stdout
    assert "embedded backends (rollout.backend=hf, train.backend=torch)" in out.stdout
    assert "megatron-bridge patches (train.backend=megatron)" in out.stdout
    for noise in ("Warning", "warnings.warn", "Traceback", "Apex", "INFO"):
        assert noise not in out.stdout + out.stderr, noise
    # On this CPU machine Transformer Engine is missing: named, with what needs it and the fix.
    if "transformer-engine   not installed" in out.stdout:
        assert "train.backend=megatron                                       cannot run: missing" in out.stdout
        assert "fix: pip install -c constraints.txt -e '.[gpu]'" in out.stdout


def test_doctor_fails_when_a_core_package_does_not_import(monkeypatch, capsys):
    core = stack.Package("no-such-dist", "no_such_module_xyz", None, "a core part", "pip install it")
    extra = stack.Package("no-such-extra", "no_such_extra_xyz", "rollout.backend=sglang", "an extra", "pip install")
    monkeypatch.setattr(stack, "PACKAGES", (stack.PACKAGES[0], core, extra))
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "embedded backends (rollout.backend=hf, train.backend=torch)  cannot run: missing no-such-dist" in out
    assert "No module named 'no_such_module_xyz'" in out and "fix: pip install it" in out
    monkeypatch.setattr(stack, "PACKAGES", (stack.PACKAGES[0], extra))
    assert main(["doctor"]) == 0  # a production backend missing is reported, not a failure
    assert "rollout.backend=sglang" in capsys.readouterr().out
