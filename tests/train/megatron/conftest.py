"""Fixtures of the CPU megatron harness's tests."""

from __future__ import annotations

import pytest

from tests.patches.harness.shims import require_bridge


@pytest.fixture(scope="module")
def megatron_bridge() -> None:
    """Fail (never skip) a module whose harness cannot load the pinned megatron-bridge: `make setup` installs it."""
    require_bridge("0.6.2")
