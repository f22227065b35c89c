"""Contract: `miles-vl doctor` prints the installed megatron-bridge / megatron-core / TE versions and, where the
model module cannot be imported (here: no Transformer Engine on a CPU machine), says why and exits 1."""

import subprocess
import sys
from pathlib import Path


def test_doctor_reports_versions_and_the_import_problem():
    exe = Path(sys.executable).with_name("miles-vl")
    out = subprocess.run([str(exe), "doctor"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert "megatron-bridge              0.6.2" in out.stdout
    assert "megatron-core                0.19.2" in out.stdout
    assert "error: cannot import megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model" in out.stdout
    assert "transformer_engine" in out.stdout
