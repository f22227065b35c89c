"""Issue 35.4: the cluster kit's files (scripts/cluster/). Docker and Slurm are not on this machine: the tests read the
files and run the parts that can run here (the pin generator, bash's parser).

- The Dockerfile installs exactly the GPU stack's pins (scripts/gpu/stack_requirements.txt) within constraints.txt,
  read through scripts/cluster/stack_pins.py: the generator's commands, as the Dockerfile writes them, are run here
  and their output compared with the stack list parsed on its own; the Dockerfile itself names no version.
- The Slurm template parses, joins its own cluster by address and sets the environment the driver sets.
"""

import re
import shlex
import subprocess
import sys
from pathlib import Path

from miles_vl.gpu_env import NO_MULTICAST_ENV

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "scripts" / "cluster"
DOCKERFILE = CLUSTER / "Dockerfile"
SBATCH = CLUSTER / "slurm_ray.sbatch"
PINS = CLUSTER / "stack_pins.py"


def pins_of(path: Path) -> set[str]:
    """`name==version` of every entry of a pin list, names normalised (PEP 503)."""
    out = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split()[0].split("==")
            out.add(f"{re.sub(r'[-_.]+', '-', name).lower()}=={version}")
    return out


def normalised(text: str) -> set[str]:
    return {re.sub(r"[-_.]+", "-", n).lower() + "==" + v for n, v in (ln.split("==") for ln in text.split())}


def dockerfile_commands() -> str:
    """The Dockerfile's instructions without comments, continuation lines joined."""
    lines = [ln for ln in DOCKERFILE.read_text().splitlines() if not ln.lstrip().startswith("#")]
    return "\n".join(lines).replace("\\\n", " ")


def test_the_dockerfile_installs_exactly_the_stacks_pins():
    text = dockerfile_commands()
    literal = re.findall(r"[A-Za-z0-9_.\-\]]+==\s*[0-9]", text)
    assert not literal, f"the Dockerfile pins versions of its own: {literal}; read them from the stack's lists"
    generated: dict[str, str] = {}
    for args, out in re.findall(r"python3 (scripts/cluster/stack_pins\.py [^>&]+?) > (\S+)", text):
        run = subprocess.run([sys.executable, *shlex.split(args)], cwd=REPO, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        generated[out] = run.stdout
    assert re.search(r"COPY \. /opt/miles_vl", text)
    installed_with_deps = re.findall(r"pip install [^&\n]*-c (\S+) [^&\n]*-r (\S+)", text)
    installed_without = re.findall(r"pip install --no-deps -r (\S+)", text)
    assert len(installed_with_deps) == 1 and len(installed_without) == 1, (installed_with_deps, installed_without)
    (constraints, stack_file), megatron_file = installed_with_deps[0], installed_without[0]
    stack, megatron = normalised(generated[stack_file]), normalised(generated[megatron_file])
    assert not stack & megatron
    assert stack | megatron == pins_of(REPO / "scripts" / "gpu" / "stack_requirements.txt")
    assert {p.split("==")[0] for p in megatron} == {"megatron-core", "megatron-bridge"}
    # every other package pip resolves is held to the tested environment's version
    assert pins_of(REPO / "constraints.txt") <= normalised(generated[constraints])
    assert all(f"-c {constraints}" in line for line in re.findall(r"pip install (?!--no-deps)[^&\n]*", text)), text


def test_the_pin_generator_refuses_lists_that_disagree(tmp_path):
    (tmp_path / "stack.txt").write_text("# a comment\ntorch==2.11.0   always\nray==2.60.0 if-missing\n")
    (tmp_path / "constraints.txt").write_text("torch==2.10.0\nnumpy==2.5.5\n")
    cmd = [sys.executable, str(PINS), "constraints", "--stack", str(tmp_path / "stack.txt")]
    run = subprocess.run([*cmd, "--constraints", str(tmp_path / "constraints.txt")], capture_output=True, text=True)
    assert run.returncode == 2 and run.stdout == ""
    assert "torch==2.11.0 in stack_requirements.txt but ==2.10.0 in constraints.txt" in run.stderr
    (tmp_path / "constraints.txt").write_text("torch==2.11.0\nnumpy==2.5.5\n")
    run = subprocess.run([*cmd, "--constraints", str(tmp_path / "constraints.txt")], capture_output=True, text=True)
    assert run.returncode == 0 and sorted(run.stdout.split()) == ["numpy==2.5.5", "ray==2.60.0", "torch==2.11.0"]


def test_the_slurm_template_parses_and_joins_its_own_cluster():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    text = SBATCH.read_text()
    assert re.search(r"ray start --head\b", text) and re.search(r'ray start --block --address="\$ADDRESS"', text)
    (train,) = [ln for ln in text.splitlines() if "miles-vl train" in ln and not ln.lstrip().startswith("#")]
    assert '"ray.address=$ADDRESS"' in train  # the driver never falls back to a private Ray
    for key, value in NO_MULTICAST_ENV.items():  # what the driver's runtime env sets, also for `ray start`'s raylets
        assert re.search(rf"export .*\b{key}={value}\b", text), key
        assert re.search(rf"ENV .*\b{key}={value}\b", DOCKERFILE.read_text()), key
    assert "export RAY_AUTH_MODE=token" in text
