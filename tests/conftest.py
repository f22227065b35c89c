"""The suite's property tests draw the same examples on every run: `make test` is what CI gates on, and a failure
there must be reproducible by running it again, not a new random draw on a busy day. To explore new inputs locally:
`MILES_VL_HYPOTHESIS=explore make test` (random draws, as hypothesis does by default).

Both profiles name their parent: hypothesis loads its own "ci" profile (fixed draws, no deadline) on its own when
it sees a CI variable, and a profile registered without a parent inherits whatever is loaded, so "explore" would
draw fixed examples on CI and "gate" would keep the 200 ms deadline only off CI."""

import os
import signal
import sys

from hypothesis import settings

settings.register_profile("gate", settings.get_profile("ci"))
settings.register_profile("explore", settings.get_profile("default"))
_profile = os.environ.get("MILES_VL_HYPOTHESIS", "gate")
if _profile not in ("gate", "explore"):
    raise ValueError(f"MILES_VL_HYPOTHESIS={_profile!r}: use 'gate' (the default: fixed draws) or 'explore'")
settings.load_profile(_profile)


def pytest_testnodedown(node, error) -> None:
    """pytest-xdist, in the controlling process: a worker that died says only "node down: Not properly terminated"
    (what it wrote to stderr during a test was captured and died with it). Its exit status says how it died: -9 a
    SIGKILL (the OOM killer), -6 an abort (a C++ exception in a library's thread), a code of its own from an
    `os._exit` (70: the weight-sync watchdog, miles_vl/rollout/sglang/weights.py; 1: faulthandler's exit)."""
    if error is None:
        return
    popen = getattr(getattr(getattr(node, "gateway", None), "_io", None), "popen", None)  # execnet's, private
    if popen is None:
        return
    try:
        code = popen.wait(timeout=10)
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    except Exception as e:  # noqa: BLE001  (a diagnostic: never the cause of a second failure)
        how = f"ended, how is unknown ({e!r})"
    sys.stderr.write(f"\n[{node.gateway.id}] the worker process {popen.pid} {how}\n")
