"""A module that fails to import because a package it needs is missing (tests/cli/test_cli.py)."""

import no_such_te_xyz  # noqa: F401
