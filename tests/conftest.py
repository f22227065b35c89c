"""The suite's property tests draw the same examples on every run: `make test` is what CI gates on, and a failure
there must be reproducible by running it again, not a new random draw on a busy day. To explore new inputs locally:
`MILES_VL_HYPOTHESIS=explore make test` (random draws, as hypothesis does by default).

Both profiles name their parent: hypothesis loads its own "ci" profile (fixed draws, no deadline) on its own when
it sees a CI variable, and a profile registered without a parent inherits whatever is loaded, so "explore" would
draw fixed examples on CI and "gate" would keep the 200 ms deadline only off CI."""

import os

from hypothesis import settings

settings.register_profile("gate", settings.get_profile("ci"))
settings.register_profile("explore", settings.get_profile("default"))
_profile = os.environ.get("MILES_VL_HYPOTHESIS", "gate")
if _profile not in ("gate", "explore"):
    raise ValueError(f"MILES_VL_HYPOTHESIS={_profile!r}: use 'gate' (the default: fixed draws) or 'explore'")
settings.load_profile(_profile)
