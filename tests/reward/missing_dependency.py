"""A module that imports a dependency that does not exist."""

import miles_vl_no_such_dependency  # noqa: F401
