"""`miles-vl train` with a pause at the start of training, for tests that signal it from outside (test_faults.py).

    python -m tests.orchestration.slow_train MARKER CONFIG [key=value ...]

Before the first training call, MARKER is created and training waits 5 s: a signal sent once MARKER exists
arrives while the step trains.
"""

import sys
import time
from pathlib import Path

from miles_vl.cli import main
from miles_vl.orchestration.trainer import Trainer

_train = Trainer.train


def _slow_train(self, samples):
    marker = Path(sys.argv[1])
    if not marker.exists():
        marker.touch()
        time.sleep(5)
    return _train(self, samples)


if __name__ == "__main__":
    Trainer.train = _slow_train
    sys.exit(main(["train", *sys.argv[2:]]))
