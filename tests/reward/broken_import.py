"""A module that fails on import: the registry must report the import error, not 'not found'."""

raise RuntimeError("this helper module is broken on purpose")
