"""Reward functions reached through `module:function` paths in the registry tests (`tests.reward.helpers:...`)."""

from miles_vl.reward import RewardSample

NOT_CALLABLE = 42
AS_LAMBDA = lambda sample: 1.0  # noqa: E731 (the case under test: a lambda pickles by value, with cloudpickle)


class _HoldsLock:
    """A callable that holds a lock: neither pickle nor cloudpickle can send it to a worker."""

    def __init__(self):
        import threading

        self.lock = threading.Lock()

    def __call__(self, sample: RewardSample) -> float:
        return 1.0


HOLDS_LOCK = _HoldsLock()


def exact_match(sample: RewardSample) -> float:
    return 1.0 if sample.response.strip() == sample.label else 0.0


async def async_exact_match(sample: RewardSample) -> dict[str, float]:
    score = 1.0 if sample.response.strip() == sample.label else 0.0
    return {"overall": score, "accuracy": score}


def two_samples(sample: RewardSample, other: RewardSample) -> float:
    return 0.0


def no_args() -> float:
    return 0.0


def with_bonus(sample: RewardSample, *, bonus: float = 0.0) -> float:
    return exact_match(sample) + bonus


class Graders:
    @staticmethod
    def strict(sample: RewardSample) -> float:
        return exact_match(sample)


# ---------------------------------------------------------------------------------------------------------------------
# rewards that misbehave on purpose (tests/reward/test_scoring.py): `sample.metadata["do"]` picks the behaviour


def misbehave(sample: RewardSample) -> float:
    """Scores 1.0 unless `sample.metadata["do"]` asks for a failure."""
    import os
    import subprocess
    import time

    do = sample.metadata.get("do", "ok")
    if do == "raise":
        raise ValueError("cannot parse")
    if do == "own_timeout":
        raise TimeoutError("upstream service")
    if do == "sleep":
        time.sleep(float(sample.metadata.get("seconds", 60)))
    if do == "spin":  # CPU-bound and never returns: only a kill stops it
        while True:
            pass
    if do == "spawn":  # starts a process of its own, then hangs: the kill must reach that process too
        child = subprocess.Popen(["sleep", "300"])
        with open(sample.metadata["pid_file"], "w") as f:
            f.write(str(child.pid))
        time.sleep(300)
    if do == "nan":
        return float("nan")
    if do == "huge":
        return 1e39
    if do == "junk":
        return "junk"  # type: ignore[return-value]
    if do == "exit":
        os._exit(3)
    if do == "pid":
        return float(os.getpid())
    return 1.0


async def async_misbehave(sample: RewardSample) -> float:
    """Async: sleeps `seconds` cooperatively (or blocks its event loop when do=block), then scores 1.0."""
    import asyncio
    import time

    if sample.metadata.get("do") == "block":
        time.sleep(60)  # blocks the worker's event loop: the pool must kill the worker
    await asyncio.sleep(float(sample.metadata.get("seconds", 0.0)))
    return 1.0
