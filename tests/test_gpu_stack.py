"""Contract of the GPU stack's scripts (scripts/gpu/stack.sh, install_stack.py, bundle_stack.sh; issue 31.2), on CPU
with made-up wheels in the bundle's own format:
- a variant (`STACK_VARIANT=V`, scripts/gpu/stack_requirements_V.txt) installs into a site folder of its own that goes
  before the base's on PYTHONPATH: its wheels win, the base's others stay visible, and the base site is not changed,
  so the base runs as before on the same machine;
- stack.sh writes miles_vl's dist-info from pyproject.toml, so that `importlib.metadata.entry_points` finds the SGLang
  plugin of a miles_vl that is only on PYTHONPATH (SGLang's `load_plugins` looks it up that way);
- a variant name without a list, or a list that is not only the wheels that differ, is refused before anything runs."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GPU = REPO / "scripts" / "gpu"
VARIANT = "sglang0517"
PLUGIN_TABLE = '\n[project.entry-points."sglang.srt.plugins"]\nmiles_vl = "miles_vl.sglang_plugin:register"\n'


def requirements(path: Path) -> dict[str, tuple[str, str]]:
    """normalized distribution -> (version, policy) of a stack_requirements*.txt."""
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            spec, policy = line.split()
            name, version = spec.split("==")
            out[re.sub(r"[-_.]+", "-", name).lower()] = (version, policy)
    return out


def make_wheel(name: str, version: str, body: str) -> tuple[str, bytes]:
    """A wheel of one module `name` whose `__init__.py` is `body`, with its dist-info."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(f"{name}/__init__.py", body)
        zf.writestr(
            f"{name}-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        )
        zf.writestr(f"{name}-{version}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n")
    return f"{name}-{version}-py3-none-any.whl", buf.getvalue()


def make_bundle(folder: Path, wheels: list[tuple[str, bytes]]) -> None:
    """The layout bundle_stack.sh writes: part1/stack.tar.xz.00 (an xz tar of the wheels), SHA256SUMS and MANIFEST."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:xz") as tar:
        for file_name, data in wheels:
            info = tarfile.TarInfo(file_name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    part = folder / "part1"
    part.mkdir(parents=True)
    (part / "stack.tar.xz.00").write_bytes(raw.getvalue())
    (part / "SHA256SUMS").write_text(f"{hashlib.sha256(raw.getvalue()).hexdigest()}  stack.tar.xz.00\n")
    (part / "MANIFEST").write_text("".join(f"{w}\t{w.split('-')[0]}\talways\n" for w, _ in wheels))


PROBE = """
import importlib.metadata as md, json, os, sys
import probepkg, baseonly
print(json.dumps({
    "probepkg": probepkg.VERSION, "probepkg_dist": md.version("probepkg"), "baseonly": baseonly.VERSION,
    "active": os.environ["STACK_ACTIVE_SITE"], "path": os.environ["PYTHONPATH"].split(os.pathsep),
    "miles_vl_dist": str(md.distribution("miles-vl")._path),
}))
"""


def run_stack(tmp_path: Path, *command: str, variant: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "STACK_VARIANT")}
    env |= {
        "PYTHON": sys.executable,
        "STACK_BUNDLE": str(tmp_path / "bundle"),
        "STACK_PARTS": str(tmp_path / "parts"),
        "STACK_SITE": str(tmp_path / "site"),
        "OUT": str(tmp_path),
    }
    if variant is not None:
        env["STACK_VARIANT"] = variant
    return subprocess.run(
        ["bash", str(GPU / "stack.sh"), *command], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def bundles(tmp_path: Path) -> Path:
    """A base bundle (probepkg 1, baseonly 1) and a variant bundle (probepkg 2), as carried: .bundle_stack[_V]."""
    make_bundle(
        tmp_path / "bundle",
        [make_wheel("probepkg", "1", 'VERSION = "1"\n'), make_wheel("baseonly", "1", 'VERSION = "1"\n')],
    )
    make_bundle(tmp_path / f"bundle_{VARIANT}", [make_wheel("probepkg", "2", 'VERSION = "2"\n')])
    return tmp_path


def test_a_variant_goes_before_the_base_and_leaves_it_as_it_was(bundles: Path):
    tmp = bundles
    variant = run_stack(tmp, sys.executable, "-c", PROBE, variant=VARIANT)
    assert variant.returncode == 0, variant.stderr
    seen = json.loads(variant.stdout.strip().splitlines()[-1])
    site, vsite = str(tmp / "site"), str(tmp / f"site_{VARIANT}")
    assert (seen["probepkg"], seen["probepkg_dist"], seen["baseonly"]) == ("2", "2", "1")
    assert seen["active"] == vsite and seen["path"][:3] == [vsite, site, str(REPO)]
    # the base stack on the same machine, after the variant: the base's own wheels, from an unchanged base site
    base = run_stack(tmp, sys.executable, "-c", PROBE)
    assert base.returncode == 0, base.stderr
    seen = json.loads(base.stdout.strip().splitlines()[-1])
    assert (seen["probepkg"], seen["probepkg_dist"], seen["baseonly"]) == ("1", "1", "1")
    assert seen["active"] == site and seen["path"][:2] == [site, str(REPO)]
    assert not (tmp / "site" / "probepkg-2.dist-info").exists() and (tmp / "site" / "probepkg-1.dist-info").is_dir()
    # every carried bundle was staged to its own folder, whichever stack ran
    assert (tmp / "parts" / "stack.tar.xz.00").is_file() and (tmp / f"parts_{VARIANT}" / "stack.tar.xz.00").is_file()


def test_stack_sh_makes_miles_vls_entry_points_visible(bundles: Path):
    """The dist-info stack.sh writes into the base site names miles_vl and shadows any other metadata of it (the
    machine has none; here the venv's editable install is behind it on sys.path)."""
    # -P: the repository root (stack.sh's working directory) not first on sys.path, so a checkout's own
    # `miles_vl.egg-info` from `pip install -e .` (absent on the GPU machine: git ignores it) does not answer first
    result = run_stack(bundles, sys.executable, "-P", "-c", PROBE, variant=VARIANT)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert Path(seen["miles_vl_dist"]).parent == bundles / "site"
    entry_points = (Path(seen["miles_vl_dist"]) / "entry_points.txt").read_text()
    assert "miles-vl = miles_vl.cli:main" in entry_points  # pyproject.toml's [project.scripts]


def write_dist_info(pyproject: Path, target: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(GPU / "install_stack.py"), "--dist-info", str(pyproject), str(target)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def plugin_entry_points(site: Path) -> list[list[str]]:
    """`importlib.metadata.entry_points(group="sglang.srt.plugins")` in a Python with `site` first on its path, as
    SGLang's `load_plugins_by_group` asks it: [name, value, the dist-info folder] of each."""
    probe = (
        "import importlib.metadata as md, json; print(json.dumps([[ep.name, ep.value, str(ep.dist._path)] "
        "for ep in md.entry_points(group='sglang.srt.plugins')]))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}
    # -P: the working directory not first on sys.path (a checkout's root may hold an editable install's
    # miles_vl.egg-info, which would answer for the distribution name first)
    out = subprocess.run(
        [sys.executable, "-P", "-c", probe], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    return json.loads(out.stdout)


def test_the_generated_dist_info_carries_the_sglang_plugin_entry_point(tmp_path: Path):
    pyproject = tmp_path / "pyproject.toml"
    text = (REPO / "pyproject.toml").read_text()
    assert PLUGIN_TABLE.strip() in text  # the project declares its SGLang plugin
    pyproject.write_text(text)
    site = tmp_path / "site"
    site.mkdir()
    # not written yet: nothing in `site` (an editable install of this checkout may answer from further down the path)
    assert not [ep for ep in plugin_entry_points(site) if ep[0] == "miles_vl" and ep[2].startswith(str(site))]
    result = write_dist_info(pyproject, site)
    assert result.returncode == 0, result.stderr
    dist_info = site / "miles_vl-0.1.0.dist-info"
    assert plugin_entry_points(site) == [["miles_vl", "miles_vl.sglang_plugin:register", str(dist_info)]]
    assert "Name: miles-vl\nVersion: 0.1.0\n" in (dist_info / "METADATA").read_text()
    # again, and for a new version: one dist-info, the new one
    assert write_dist_info(pyproject, site).returncode == 0
    pyproject.write_text(pyproject.read_text().replace('version = "0.1.0"', 'version = "0.2.0"', 1))
    assert write_dist_info(pyproject, site).returncode == 0
    assert sorted(p.name for p in site.iterdir()) == ["miles_vl-0.2.0.dist-info"]
    assert plugin_entry_points(site)[0][2] == str(site / "miles_vl-0.2.0.dist-info")


def test_a_pyproject_without_a_static_version_is_one_line_exit_2(tmp_path: Path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "miles-vl"\ndynamic = ["version"]\n' + PLUGIN_TABLE)
    result = write_dist_info(pyproject, tmp_path / "site")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "needs a name and a static version" in result.stderr
    assert "version=None" in result.stderr and not (tmp_path / "site").exists()


def test_an_unknown_variant_is_refused_before_anything_is_staged(bundles: Path):
    result = run_stack(bundles, "true", variant="sglang9999")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "STACK_VARIANT=sglang9999 names no variant" in result.stderr and VARIANT in result.stderr
    assert not (bundles / "parts").exists() and not (bundles / "site").exists()
    bundle = subprocess.run(
        ["bash", str(GPU / "bundle_stack.sh"), str(bundles / "out")],
        env=os.environ | {"STACK_VARIANT": "sglang9999", "PYTHON": "false"},  # refused before pip would run
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bundle.returncode == 2 and "stack_requirements_sglang9999.txt" in bundle.stderr
    assert not (bundles / "out").exists()


def test_the_sglang0517_variant_lists_only_wheels_that_replace_the_bases():
    """Each line replaces the base's wheel of its distribution (`always`, another version): a line the base already
    has at that version would only be carried twice; a new distribution would belong in the base list."""
    base = requirements(GPU / "stack_requirements.txt")
    variant = requirements(GPU / f"stack_requirements_{VARIANT}.txt")
    assert variant == {"sglang": ("0.5.17", "always"), "flashinfer-python": ("0.6.15.post1", "always")}
    for name, (version, _) in variant.items():
        assert name in base and base[name][0] != version, name


def test_run_sglang_checks_under_a_variant_has_its_own_import_check_and_logs(tmp_path: Path):
    """Under a variant the real-server checks record their import check in the variant's site folder (the base's
    says nothing about the variant's SGLang) and log to $OUT/<variant>/, so that base and variant can run side by
    side. The variant's marker is set here, so no stage runs (no GPU needed)."""
    base_site, variant_site = tmp_path / "site", tmp_path / f"site_{VARIANT}"
    for site in (base_site, variant_site):
        site.mkdir()
    (variant_site / ".miles_vl_import_ok").touch()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {
        "PYTHON": sys.executable,
        "STACK_VARIANT": VARIANT,
        "STACK_SITE": str(base_site),
        "STACK_ACTIVE_SITE": str(variant_site),
        "OUT": str(tmp_path / "out"),
    }
    result = subprocess.run(
        ["bash", str(GPU / "run_sglang_checks.sh"), "--skip-tests", "--skip-bench"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    log = (tmp_path / "out" / VARIANT / "driver.log").read_text()
    assert "import: checked by an earlier run" in log and "all stages passed" in log
    assert not (base_site / ".miles_vl_import_ok").exists()


def test_run_sglang_checks_shards_split_the_real_server_tests_into_contiguous_parts(tmp_path: Path):
    """`--shard K/N` runs the K-th of N contiguous parts of the collected tests: the parts of 1/2 and 2/2 are
    disjoint, in pytest's order, and together every test once. Here without CUDA every test skips, and the import
    check and the checkpoint are marked done, so only the test stage runs (its `-v` lines name each test)."""
    site, ckpt = tmp_path / "site", tmp_path / "ckpt"
    site.mkdir()
    ckpt.mkdir()
    (site / ".miles_vl_import_ok").touch()
    (ckpt / ".complete").touch()
    env = {k: v for k, v in os.environ.items() if k not in ("STACK_VARIANT", "STACK_ACTIVE_SITE")} | {
        "PYTHON": sys.executable,
        "STACK_SITE": str(site),
        "MILES_VL_SGLANG_CKPT": str(ckpt),
        "MILES_VL_SGLANG_PIDFILE": str(tmp_path / "pids"),
    }
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "tests/gpu/test_sglang_real.py", "tests/rollout/sglang/test_gpu.py"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    everything = [line for line in collected.stdout.splitlines() if "::" in line]
    assert len(everything) > 10, collected.stdout[-2000:]
    ran, pid_files = [], set()
    for k in (1, 2):
        out = tmp_path / f"out{k}"
        result = subprocess.run(
            ["bash", str(GPU / "run_sglang_checks.sh"), "--skip-bench", "--shard", f"{k}/2"],
            env=env | {"OUT": str(out)},
            capture_output=True,
            text=True,
            timeout=600,
        )
        log = (out / "driver.log").read_text()
        assert result.returncode == 0, result.stdout + log[-3000:]
        assert f"shard {k}/2: tests" in log
        pid_files |= set(re.findall(r"servers' pid file: (\S+)", log))
        ran.append(re.findall(r"^(tests/\S+::\S+) SKIPPED", log, flags=re.M))
    assert ran[0] and ran[1] and not set(ran[0]) & set(ran[1])
    assert ran[0] + ran[1] == everything
    assert len(pid_files) == 2  # shards run at once on two GPUs: each stops only its own leftover servers


def test_run_sglang_checks_refuses_a_malformed_shard():
    for bad in ("3/2", "0/2", "1-2", "a/b"):
        result = subprocess.run(
            ["bash", str(GPU / "run_sglang_checks.sh"), "--shard", bad],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert result.returncode == 2 and f"--shard {bad}: expected K/N" in result.stderr, (bad, result.stderr)
