"""Install the GPU stack made by scripts/gpu/bundle_stack.sh into a folder to put first on PYTHONPATH.

    python3 scripts/gpu/install_stack.py PARTS_DIR TARGET      # PARTS_DIR: the parts, flat or in part*/ folders
    python3 scripts/gpu/install_stack.py --dist-info PYPROJECT TARGET   # miles_vl's metadata and entry points

Standard library only (it runs before anything is installed), and with the machine's own packages on sys.path:
PYTHONPATH must not point at TARGET, because the `if-missing` policy asks the machine's Python which
distributions it already has.

1. SHA256SUMS (from the last part) names every part: a missing or damaged part is reported by name before anything is
   unpacked.
2. The parts are one xz-compressed tar of wheels: decompressed as a stream (the `xz` program with all cores, else
   Python's lzma) and read member by member.
3. Each wheel whose MANIFEST policy says so (`always`, or `if-missing` and the machine lacks that distribution) is
   unpacked straight into TARGET by a pool of threads, as `pip install --no-deps --target` would lay it out
   (`*.data/purelib` and `platlib` into TARGET, `scripts` into TARGET/bin, executable bits kept), but without
   pip's copy through a temporary folder: measured here, this is what makes the 3.5 GB stack install in seconds.
4. TARGET/.stack_complete records the SHA256SUMS it was installed from; a second run with the same parts returns at
   once, and a changed bundle installs afresh.

Exit status 2 with one line naming the problem for a missing/damaged part or a broken archive.

A variant of the stack (scripts/gpu/stack_requirements_<variant>.txt: only the wheels that differ from the base) is
installed the same way into a TARGET of its own, which stack.sh puts before the base's on PYTHONPATH.

`--dist-info` (`write_dist_info`): on the GPU machine miles_vl is on PYTHONPATH, not installed, so
`importlib.metadata.entry_points` would not see the entry points of its pyproject.toml, among them the SGLang plugin
(group `sglang.srt.plugins`) that SGLang's `load_plugins` looks up in every server process. This writes a minimal
`<name>-<version>.dist-info/` (METADATA and entry_points.txt, generated from pyproject.toml's `[project]` name,
version, `scripts`, `gui-scripts` and `entry-points` tables) into TARGET, a folder on that PYTHONPATH.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MARKER = ".stack_complete"


def fail(message: str) -> None:
    print(f"install_stack: {message}", file=sys.stderr)
    sys.exit(2)


def find_parts(parts_dir: Path) -> tuple[list[Path], Path, str]:
    """The parts in order, the MANIFEST, and the SHA256SUMS text; checks every part's hash."""
    sums = sorted(parts_dir.rglob("SHA256SUMS"))
    manifest = sorted(parts_dir.rglob("MANIFEST"))
    if not sums or not manifest:
        fail(f"no SHA256SUMS/MANIFEST under {parts_dir}: they come with the last part; carry every part")
    text = sums[0].read_text()
    parts, missing = [], []
    for line in text.splitlines():
        digest, name = line.split()
        hits = sorted(parts_dir.rglob(name))
        if not hits:
            missing.append(name)
            continue
        h = hashlib.sha256()
        with open(hits[0], "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        if h.hexdigest() != digest:
            fail(f"{hits[0]} is damaged (sha256 differs from SHA256SUMS): carry that part again")
        parts.append(hits[0])
    if missing:
        fail(f"missing part(s) under {parts_dir}: {' '.join(missing)} (of {len(text.splitlines())})")
    return parts, manifest[0], text


def wanted(manifest: Path) -> dict[str, str]:
    """wheel file name -> why it is installed, for the wheels this machine needs (policy of MANIFEST)."""
    norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()  # noqa: E731
    have = {norm(d.metadata["Name"] or "") for d in importlib.metadata.distributions()}
    out = {}
    for line in manifest.read_text().splitlines():
        wheel, dist, policy = line.split("\t")
        if policy == "always" or norm(dist) not in have:
            out[wheel] = policy
    return out


def unpack_wheel(data: bytes, target: Path) -> int:
    """Lay one wheel out in `target` as pip --target does; returns the number of files written."""
    n = 0
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        for info in zf.infolist():
            if info.is_dir():
                continue
            parts = info.filename.split("/")
            if parts[0].endswith(".data") and len(parts) > 2:
                kind, rest = parts[1], parts[2:]
                if kind in ("purelib", "platlib"):
                    dest = target.joinpath(*rest)
                elif kind == "scripts":
                    dest = target.joinpath("bin", *rest)
                else:  # headers, data: nothing on the import path needs them
                    continue
            else:
                dest = target.joinpath(*parts)
            dest.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 22)
            mode = (info.external_attr >> 16) & 0o777
            if mode & 0o111 or parts[1:2] == ["scripts"]:
                os.chmod(dest, 0o755)
            n += 1
    return n


def entry_point_groups(project: dict) -> dict[str, dict[str, str]]:
    """The entry points of a pyproject.toml `[project]` table by group, as installers write them (`scripts` are
    `console_scripts`, `gui-scripts` are `gui_scripts`)."""
    groups = {"console_scripts": project.get("scripts", {}), "gui_scripts": project.get("gui-scripts", {})}
    for group, entries in project.get("entry-points", {}).items():
        if group in ("console_scripts", "gui_scripts"):  # PEP 621: these belong in `scripts` / `gui-scripts`
            raise ValueError(f"[project.entry-points.{group}] is not allowed; use [project.{group.replace('_', '-')}]")
        groups[group] = entries
    out = {}
    for group, entries in groups.items():
        if not isinstance(entries, dict) or not all(isinstance(v, str) for v in entries.values()):
            raise ValueError(f"entry-point group {group!r} must map names to 'module:attr' strings, found {entries!r}")
        if entries:
            out[group] = dict(entries)
    return out


def write_dist_info(pyproject: Path, target: Path) -> Path:
    """Write `<name>-<version>.dist-info/` (METADATA, entry_points.txt) for the project of `pyproject` into `target`
    (module docstring); returns its path. Idempotent, and safe while other processes read `target`: each file is
    replaced whole; a dist-info of another version of the same project there is removed (one version is visible).

    Raises:
        ValueError: `pyproject` has no `[project]` name or a static version, or a malformed entry-point table.
    """
    project = tomllib.loads(pyproject.read_text()).get("project", {})
    name, version = project.get("name"), project.get("version")
    if not isinstance(name, str) or not isinstance(version, str):
        raise ValueError(
            f"{pyproject}: [project] needs a name and a static version to describe the installed project, "
            f"found name={name!r}, version={version!r}"
        )
    groups = entry_point_groups(project)
    stem = re.sub(r"[-_.]+", "_", name).lower()
    dist_info = target / f"{stem}-{version}.dist-info"
    for old in target.glob(f"{stem}-*.dist-info"):
        if old != dist_info:
            shutil.rmtree(old, ignore_errors=True)
    dist_info.mkdir(parents=True, exist_ok=True)
    files = {
        "METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        "entry_points.txt": "".join(
            f"[{group}]\n" + "".join(f"{key} = {value}\n" for key, value in entries.items()) + "\n"
            for group, entries in groups.items()
        ),
        "INSTALLER": "miles_vl scripts/gpu/stack.sh (on PYTHONPATH, not installed)\n",
    }
    for file_name, text in files.items():
        tmp = dist_info / f".{file_name}.{os.getpid()}"
        tmp.write_text(text)
        os.replace(tmp, dist_info / file_name)
    return dist_info


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--dist-info":
        try:
            path = write_dist_info(Path(sys.argv[2]), Path(sys.argv[3]))
        except (OSError, ValueError, tomllib.TOMLDecodeError) as e:
            fail(f"--dist-info: {e}")
        print(f"install_stack: {path} written (entry points: {(path / 'entry_points.txt').read_text().count(' = ')})")
        return
    if len(sys.argv) != 3:
        fail("usage: install_stack.py PARTS_DIR TARGET | install_stack.py --dist-info PYPROJECT TARGET")
    parts_dir, target = Path(sys.argv[1]), Path(sys.argv[2])
    t0 = time.time()
    parts, manifest, sums = find_parts(parts_dir)
    marker = target / MARKER
    if marker.exists() and marker.read_text() == sums:
        print(f"install_stack: {target} already holds this bundle")
        return
    todo = wanted(manifest)
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)

    cat = subprocess.Popen(["cat", *map(str, parts)], stdout=subprocess.PIPE)
    if shutil.which("xz"):
        xz = subprocess.Popen(["xz", "-dc", "-T0"], stdin=cat.stdout, stdout=subprocess.PIPE)
        stream = xz.stdout
    else:
        import lzma

        xz, stream = None, lzma.open(cat.stdout)
    files, done, skipped = 0, [], []
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 4)) as pool:
        futures = []
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for member in tar:
                name = Path(member.name).name
                if name not in todo:
                    skipped.append(name)
                    continue
                data = tar.extractfile(member).read()
                futures.append(pool.submit(unpack_wheel, data, target))
                done.append(name)
        files = sum(f.result() for f in futures)
    for proc in (xz, cat):
        if proc is not None and proc.wait() != 0:
            fail(f"decompressing the parts failed ({proc.args[0]} exited {proc.returncode})")
    missing = sorted(set(todo) - set(done))
    if missing:
        fail(f"the archive lacks wheels its MANIFEST names: {missing}")
    marker.write_text(sums)
    print(
        f"install_stack: {len(done)} wheels ({files} files) into {target} in {time.time() - t0:.0f}s; "
        f"{len(skipped)} left out (the machine has them: {' '.join(sorted(skipped)) or '-'})"
    )


if __name__ == "__main__":
    main()
