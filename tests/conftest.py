"""The suite's property tests draw the same examples on every run: `make test` is what CI gates on, and a failure
there must be reproducible by running it again, not a new random draw on a busy day. To explore new inputs locally:
`MILES_VL_HYPOTHESIS=explore make test` (random draws, as hypothesis does by default)."""

import os

from hypothesis import settings

settings.register_profile("gate", derandomize=True, database=None)
settings.register_profile("explore")
_profile = os.environ.get("MILES_VL_HYPOTHESIS", "gate")
if _profile not in ("gate", "explore"):
    raise ValueError(f"MILES_VL_HYPOTHESIS={_profile!r}: use 'gate' (the default: fixed draws) or 'explore'")
settings.load_profile(_profile)
