"""Real full and read-only file systems for tests, with no root and nothing left on the machine: a small tmpfs
mounted in a private user and mount namespace (`unshare --user --map-root-user --mount`), seen only by the command
run there and its children (Ray's workers included).

    done = with_tmpfs(tmp_path / "disk", [sys.executable, "-c", code], size="1m")  # a disk of 1 MiB: ENOSPC

Tests that use it skip where unprivileged namespaces are turned off (some container runtimes and distributions).
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

# Mount on "$1", then run the rest of the arguments in its place (so that signals and the exit status are theirs).
_MOUNT = 'mount -t tmpfs -o "$1" tmpfs "$2" && shift 2 && exec "$@"'


@functools.cache
def namespaces_available() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /tmp"]
    return subprocess.run(probe, capture_output=True).returncode == 0


def with_tmpfs(
    mountpoint: Path, cmd: Sequence[str], *, size: str = "1m", read_only: bool = False, **run
) -> subprocess.CompletedProcess:
    """Run `cmd` (text output captured) with a tmpfs of `size` (mount's units: 1m, 512k) mounted at `mountpoint`,
    an empty directory that this creates when missing; `read_only`: mounted read-only. `run`: more subprocess.run
    arguments (cwd, env, timeout)."""
    if not namespaces_available():
        pytest.skip("unprivileged user and mount namespaces are not available here (unshare --user --mount)")
    mountpoint.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    argv = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", _MOUNT, "sh", options, str(mountpoint)]
    return subprocess.run([*argv, *cmd], capture_output=True, text=True, **run)
